"""Tensor parallelism on 4 logical CPUs: K=4,T=1 vs K=2,T=2 vs K=1,T=4, one MLP.

The same body (4 ParallelMLP blocks of width W, hidden 4W, each followed by a
LayerNorm) and batch, trained by ForwardBackward + SGD, M=4 micro-batches,
recompute 'always'. Prints side by side, as ratios to K=4,T=1:
  - step time: the three built in one process and timed in alternating rounds
    (median of each), so all see the same load;
  - per-device state: the largest over the 4 devices of weights + gradient sums +
    Adam slots, counted from the variables and gradients placed on each device
    (logical CPUs share one allocator, so a device's own peak cannot be read);
  - the host allocator's peak over a step (BFC, one subprocess per configuration
    so one allocator's history cannot colour another's);
  - bytes all-reduced per step (the collectives among a cell's T devices, read
    from the unrolled executor's traced step: every op there runs once per step)
    against the prediction: per block and micro-batch one all-reduce of the
    block's output forward (again in the recompute) and one of its input gradient
    backward, i.e. (2 + recompute) x N x W x 4 bytes per block per step.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/tensor_parallel_benchmark.py           # ~3 minutes
    PYTHONPATH=. python benchmarks/tensor_parallel_benchmark.py --quick   # ~1 minute
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

CONFIGS = [(4, 1), (2, 2), (1, 4)]  # (K, T)
WIDTH, BATCH, M, BLOCKS = 256, 64, 4, 4


def build(k: int, t: int, cell_functions: bool = True):
    import tensorflow as tf
    import tfpipe
    from tfpipe import layers
    from tfpipe.layers.tensor_parallel_dense import ParallelMLP
    body = []
    for i in range(BLOCKS):
        body.append(ParallelMLP.Params().Set(name=f'mlp{i}', input_dim=WIDTH,
                                             hidden_dim=4 * WIDTH))
        body.append(layers.LayerNorm.Params().Set(name=f'norm{i}', dim=WIDTH))
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=[len(body) // k] * k, num_micro_batches=M,
        tensor_parallel=t, recompute='always', cell_functions=cell_functions).Instantiate()
    x = tf.random.stateless_normal([BATCH, WIDTH], seed=[1, 2])
    y = tf.random.stateless_uniform([BATCH], seed=[3, 4], maxval=WIDTH, dtype=tf.int32)
    return pipe, x, y


def step_fn(pipe, x, y):
    import tensorflow as tf
    from tfpipe import fprop_context

    def loss_fn(logits, labels):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

    @tf.function
    def step():
        with fprop_context.training(step=1):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, y)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(0.01 * g)
        return loss
    return step


def state_per_device(pipe, x, y) -> dict[str, int]:
    """Weights, Adam's two slots (2x weights) and gradient sums by device."""
    import tensorflow as tf
    from tfpipe import fprop_context
    out: dict[str, int] = {}
    for var in tf.nest.flatten(pipe.theta):
        out[var.device] = out.get(var.device, 0) + 3 * var.shape.num_elements() * 4
    sums = []

    @tf.function
    def trace():
        with fprop_context.training(step=1):
            _, grads = pipe.ForwardBackward(
                pipe.theta, x, lambda o, t: tf.nn.sparse_softmax_cross_entropy_with_logits(t, o),
                y)
        sums.extend((g.device, g.shape.num_elements() * 4) for g in tf.nest.flatten(grads))
    trace.get_concrete_function()
    for device, size in sums:
        out[device] = out.get(device, 0) + size
    return out


def all_reduced_bytes(k: int, t: int) -> int:
    """Bytes all-reduced per step: one count per collective instance of the traced step."""
    pipe, x, y = build(k, t, cell_functions=False)
    graph = step_fn(pipe, x, y).get_concrete_function().graph
    instances = {}
    for op in graph.get_operations():
        if op.type == 'CollectiveReduce':
            tensor = op.inputs[0]
            instances[op.get_attr('instance_key')] = (tensor.shape.num_elements() *
                                                      tensor.dtype.size)
    return sum(instances.values())


def predicted_all_reduced_bytes(t: int) -> int:
    return 0 if t == 1 else BLOCKS * (2 + 1) * BATCH * WIDTH * 4  # recompute 'always'


def probe(k: int, t: int) -> None:
    """Subprocess: the host allocator's peak over a few steps of one configuration."""
    import tfpipe
    tfpipe.configure_logical_cpus(4)
    from tfpipe import memory_stats
    pipe, x, y = build(k, t)
    step = step_fn(pipe, x, y)
    for _ in range(3):
        step().numpy()
    peaks = memory_stats.peak_bytes(pipe.devices)
    print(json.dumps(max(peaks.values()) if peaks else None))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--quick', action='store_true')
    parser.add_argument('--probe', nargs=2, type=int)
    args = parser.parse_args()
    if args.probe:
        probe(*args.probe)
        return
    peaks = {}
    for k, t in CONFIGS:
        out = subprocess.run([sys.executable, __file__, '--probe', str(k), str(t)],
                             capture_output=True, text=True, check=True, env=dict(os.environ))
        peaks[(k, t)] = json.loads(out.stdout.strip().splitlines()[-1])
    import tfpipe
    tfpipe.configure_logical_cpus(4)
    built = {c: build(*c) for c in CONFIGS}
    steps = {c: step_fn(*built[c]) for c in CONFIGS}
    state = {c: max(state_per_device(*built[c]).values()) for c in CONFIGS}
    reduced = {c: all_reduced_bytes(*c) for c in CONFIGS}
    for c in CONFIGS:  # trace and warm up
        for _ in range(2):
            steps[c]().numpy()
    rounds, per_round = (3, 2) if args.quick else (7, 4)
    seconds = {c: [] for c in CONFIGS}
    for _ in range(rounds):
        for c in CONFIGS:
            begin = time.perf_counter()
            for _ in range(per_round):
                steps[c]().numpy()
            seconds[c].append((time.perf_counter() - begin) / per_round)
    base = CONFIGS[0]
    print(f'MLP: {BLOCKS} x ParallelMLP(width {WIDTH}, hidden {4 * WIDTH}) + LayerNorm, batch '
          f'{BATCH}, M={M}, recompute always, 4 logical CPUs; ratios to K=4,T=1 '
          f'({rounds} alternating rounds of {per_round} steps)')
    for c in CONFIGS:
        k, t = c
        median = statistics.median(seconds[c])
        peak = (f'{peaks[c] / peaks[base]:.2f}' if peaks[c] and peaks[base] else 'n/a')
        print(f'  K={k} T={t}: step time {median / statistics.median(seconds[base]):.2f}  '
              f'largest per-device state {state[c] / state[base]:.2f} '
              f'({state[c] / 2 ** 20:.2f} MiB)  host allocator peak {peak} '
              f'({(peaks[c] or 0) / 2 ** 20:.1f} MiB)  all-reduced per step '
              f'{reduced[c] / 2 ** 20:.2f} MiB (predicted '
              f'{predicted_all_reduced_bytes(t) / 2 ** 20:.2f} MiB)')


if __name__ == '__main__':
    main()
