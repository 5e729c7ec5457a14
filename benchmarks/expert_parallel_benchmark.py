"""Step time of a pipeline with an MoE layer at expert parallelism P = 1, 2, 4 (R = 4).

R = 4 data-parallel replicas (K = 1 cell each) on 4 logical CPUs train a Dense -> MoE
(8 experts, top-2, capacity factor 2) -> Dense body for one step through
ForwardBackward(ReplicaThetas()), as the trainer does; P = 1 holds all 8 experts on every
replica, P = 2 and 4 hold 4 and 2 and exchange tokens by all-to-all. The three P are
built in one process and timed round-robin (`--repeats` rounds, median per P), so the
ratios compare like with like on a shared host. Logical CPUs share the host's cores, so
P > 1 saves no compute here (each replica still runs its share of the expert FLOPs) and
the all-to-all is a memory copy: the figure is the cost of the exchange and its
ordering, not the speed-up GPUs would see. For P > 1 it also times the step's exchange
alone, timed in the same rounds: a function that runs just that step's all-to-alls
(per replica and micro-batch the dispatch and the combine, and their backwards) on
slots of the layer's shape, and prints it as a share of the step.

`--section=executors` compares the two executors at P > 1 on
lm.pystdlib.TinyMoETransformerLM (its experts in its recomputing last cell) at R=2, P=2,
K=2, M=4 on 4 logical CPUs: each round runs both in fresh processes, in alternating
order; each process times its first step (trace, grappler, placement and the run) and the
median of `--steps` later steps (ForwardBackward and SGD on every replica's variables).
Printed: per executor the medians over rounds, and cell functions / unrolled as the
median of per-round ratios.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/expert_parallel_benchmark.py --repeats=5
    PYTHONPATH=. python benchmarks/expert_parallel_benchmark.py --section=executors --rounds=3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import tfpipe  # before TensorFlow: it sets oneDNN's and the allocator's options at load
import tensorflow as tf  # noqa: E402


def build(p: int, width: int, experts: int):
    from tfpipe import layers
    body = [layers.Dense.Params().Set(name='fc0', input_dim=width, output_dim=width,
                                      activation='relu'),
            layers.MoEFeedForward.Params().Set(name='moe', model_dim=width,
                                               hidden_dim=2 * width, num_experts=experts,
                                               capacity_factor=2.0),
            layers.Dense.Params().Set(name='fc2', input_dim=width, output_dim=10)]
    return tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=[3], num_replicas=4, expert_parallel=p,
        num_micro_batches=2).Instantiate()


def exchange_alone(pipe, width: int, experts: int, tokens: int):
    """A tf.function running only the all-to-alls of `pipe`'s step: per replica and
    micro-batch the MoE layer's dispatch and combine on [E, C, D] slots of `tokens`
    tokens, under a tape, and their backwards."""
    from tfpipe.layers import moe_gating
    from tfpipe.pipeline import expert_parallel
    p = pipe.params.expert_parallel
    devices = [cells[0].device for cells in pipe.replica_cells]
    groups = expert_parallel.groups_of(devices, p)
    capacity = moe_gating.expert_capacity(2.0, tokens, experts, 2)

    def run():
        xs, outs = [], []
        with tf.GradientTape() as tape:
            for device, group in zip(devices, groups):
                with tf.device(device):
                    for _ in range(pipe.params.num_micro_batches):
                        x = tf.zeros([p, experts // p, capacity, width])
                        tape.watch(x)
                        xs.append(x)
                        there = expert_parallel.all_to_all(x, group, 'bench/moe/dispatch')
                        outs.append(expert_parallel.all_to_all(there, group,
                                                               'bench/moe/combine'))
        grads = tape.gradient(outs, xs)
        return tf.add_n([tf.reduce_sum(g) for g in grads])
    return tf.function(run, autograph=False)


EXECUTORS = ('functions', 'unrolled')


def lm_step_times(executor: str, steps: int) -> dict:
    """One executor's {first, steady} seconds on TinyMoETransformerLM (this process's)."""
    import numpy as np
    import model_registry
    from tfpipe import fprop_context, inputs
    params = model_registry.get_params('lm.pystdlib.TinyMoETransformerLM')
    params.task.pipeline.Set(num_replicas=2, expert_parallel=2, num_micro_batches=4,
                             cell_functions=executor == 'functions')
    task = params.task.Instantiate()
    batch, length = params.input.train.batch_size, params.input.train.max_length
    ids = np.random.default_rng(0).integers(2, inputs.BYTE_VOCAB_SIZE, size=[batch, length + 1])
    data = {'inputs': tf.constant(ids[:, :-1], tf.int32),
            'targets': tf.constant(ids[:, 1:], tf.int32),
            'segment_ids': tf.ones([batch, length], tf.int32),
            'positions': tf.tile(tf.range(length)[None], [batch, 1])}

    @tf.function
    def step():
        with fprop_context.training(step=1):
            loss, grads = task.ForwardBackward(task.theta, data)
        for theta, g in zip(task.pipe.ReplicaThetas(), grads):
            for v, d in zip(tf.nest.flatten(theta), tf.nest.flatten(g['pipe'])):
                v.assign_sub(0.01 * tf.convert_to_tensor(d))
        return loss
    start = time.perf_counter()
    step().numpy()
    first = time.perf_counter() - start
    step().numpy()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    return {'first': first, 'steady': statistics.median(times)}


def compare_executors(rounds: int, steps: int) -> None:
    got: dict[str, list[dict]] = {e: [] for e in EXECUTORS}
    for i in range(rounds):
        for executor in EXECUTORS[::1 if i % 2 == 0 else -1]:
            out = subprocess.run([sys.executable, __file__, f'--child={executor}',
                                  f'--steps={steps}'], check=True, capture_output=True,
                                 text=True).stdout
            got[executor].append(json.loads(out.strip().splitlines()[-1]))
    print(f'TinyMoETransformerLM R=2 P=2 K=2 M=4, 4 logical CPUs, {rounds} rounds, '
          f'steady = median of {steps} steps')
    for what in ('first', 'steady'):
        cells = ', '.join(f'{e} {statistics.median(r[what] for r in got[e]):.3f} s'
                          for e in EXECUTORS)
        ratios = [f[what] / u[what] for f, u in zip(got['functions'], got['unrolled'])]
        print(f'{what} step: {cells}; functions/unrolled {statistics.median(ratios):.2f}x '
              f'[{min(ratios):.2f}-{max(ratios):.2f}]')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--batch', type=int, default=512)
    parser.add_argument('--width', type=int, default=128)
    parser.add_argument('--experts', type=int, default=8)
    parser.add_argument('--section', default='p', choices=['p', 'executors'])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--child', choices=EXECUTORS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tfpipe.configure_logical_cpus(4)
    if args.child:
        print(json.dumps(lm_step_times(args.child, args.steps)))
        return
    if args.section == 'executors':
        compare_executors(args.rounds, args.steps)
        return
    from tfpipe import fprop_context
    x = tf.random.normal([args.batch, args.width], seed=1)
    y = tf.zeros([args.batch], tf.int32)

    def loss_fn(logits, labels):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    steps = {}
    for p in (1, 2, 4):
        pipe = build(p, args.width, args.experts)

        def step(pipe=pipe):
            with fprop_context.training(step=0):
                loss, _ = pipe.ForwardBackward(pipe.ReplicaThetas(), x, loss_fn, y)
            return loss
        steps[p] = tf.function(step, autograph=False)
        steps[p]()  # trace and warm up
        if p > 1:
            tokens = args.batch // pipe.num_replicas // pipe.params.num_micro_batches
            steps[f'exchange {p}'] = exchange_alone(pipe, args.width, args.experts, tokens)
            steps[f'exchange {p}']()
    times = {p: [] for p in steps}
    for _ in range(args.repeats):
        for p, fn in steps.items():
            start = time.perf_counter()
            fn().numpy()
            times[p].append(time.perf_counter() - start)
    base = statistics.median(times[1])
    for p, ts in times.items():
        med = statistics.median(ts)
        if isinstance(p, str):
            share = med / statistics.median(times[int(p.split()[1])])
            print(f'  P={p.split()[1]}\'s all-to-alls alone: {med * 1e3:.1f} ms, {share:.0%} of '
                  'its step')
        else:
            print(f'P={p}: step {med * 1e3:.1f} ms (median of {len(ts)}), {med / base:.2f}x P=1')


if __name__ == '__main__':
    main()
