"""Step time of a pipeline with an MoE layer at expert parallelism P = 1, 2, 4 (R = 4).

R = 4 data-parallel replicas (K = 1 cell each) on 4 logical CPUs train a Dense -> MoE
(8 experts, top-2, capacity factor 2) -> Dense body for one step through
ForwardBackward(ReplicaThetas()), as the trainer does; P = 1 holds all 8 experts on every
replica, P = 2 and 4 hold 4 and 2 and exchange tokens by all-to-all. The three P are
built in one process and timed round-robin (`--repeats` rounds, median per P), so the
ratios compare like with like on a shared host. Logical CPUs share the host's cores, so
P > 1 saves no compute here (each replica still runs its share of the expert FLOPs) and
the all-to-all is a memory copy: the figure is the cost of the exchange and its
ordering, not the speed-up GPUs would see.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/expert_parallel_benchmark.py --repeats=5
"""
from __future__ import annotations

import argparse
import statistics
import time

import tensorflow as tf

import tfpipe


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--batch', type=int, default=512)
    parser.add_argument('--width', type=int, default=128)
    parser.add_argument('--experts', type=int, default=8)
    args = parser.parse_args()
    tfpipe.configure_logical_cpus(4)
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
    times = {p: [] for p in steps}
    for _ in range(args.repeats):
        for p, fn in steps.items():
            start = time.perf_counter()
            fn().numpy()
            times[p].append(time.perf_counter() - start)
    base = statistics.median(times[1])
    for p, ts in times.items():
        med = statistics.median(ts)
        print(f'P={p}: step {med * 1e3:.1f} ms (median of {len(ts)}), {med / base:.2f}x P=1')


if __name__ == '__main__':
    main()
