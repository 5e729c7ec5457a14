"""How close tfpipe's pipelined step comes to this machine's matmul floor (issue 26).

The peers' model (benchmarks/peers/steps.py: 8 x Dense(1024) relu, batch 256, recompute) does
four matmuls per layer and micro-batch: the forward, its recomputation, the weight gradient
x^T @ dy and the input gradient (Dense's form, (w @ dy^T)^T; none for the first layer). This
script times each form at a micro-batch's rows, one thread per op (tfpipe's default on logical
CPUs) in chains inside one tf.function, and adds them up into the step's **matmul floor**: the
matmul work of one step divided by the machine's cores. No schedule, thread setting or
executor can beat it; everything else a step does (activations and their gradients, summing
the micro-batches' gradients, the update, hand-offs between cells, the bubble) comes on top.

It then times tfpipe's step (the library, peers/tfpipe_step.py, as peers_benchmark.py does) at
each schedule, rounds interleaved, and prints floor / step: the share of the step that is
unavoidable matmul work. A goal below the floor cannot be met on this machine.

Run (from the repository root; about 2 minutes on 2 quiet cores):
    PYTHONPATH=. python benchmarks/matmul_floor_benchmark.py
    PYTHONPATH=. python benchmarks/matmul_floor_benchmark.py --configs=2x4 --rounds=5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'peers'))
import steps  # noqa: E402  (the peers' model and timing)

import tfpipe  # noqa: E402  (before TensorFlow: its defaults)

CHAIN = 40  # matmuls per timed call


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--configs', default='2x4,2x8,4x8', help='KxM, comma-separated')
    ap.add_argument('--schedules', default='fill_drain,1f1b,zb_h2')
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--cpus', type=int, default=os.cpu_count(), help="the machine's cores")
    return ap.parse_args()


def form_ms(tf, rows: int, form: str) -> float:
    """Milliseconds per matmul of `form` on [rows, WIDTH] x [WIDTH, WIDTH], best of 7."""
    a = tf.random.normal([rows, steps.WIDTH])
    w = tf.random.normal([steps.WIDTH, steps.WIDTH]) * 0.03

    @tf.function(autograph=False)
    def chain(a, w):
        for _ in range(CHAIN):  # each call depends on the last: nothing is merged or skipped
            if form == 'forward':
                a = tf.matmul(a, w)
            elif form == 'weight_gradient':
                a = a + tf.matmul(a, a, transpose_a=True)[:rows] * 1e-6
            else:  # Dense's input gradient
                a = tf.transpose(tf.matmul(w, a, transpose_b=True))
        return a[0, 0]

    chain(a, w).numpy()
    best = float('inf')
    for _ in range(7):
        start = time.perf_counter()
        chain(a, w).numpy()
        best = min(best, time.perf_counter() - start)
    return 1000 * best / CHAIN


def floor_ms(ms: dict, micro: int, cpus: int) -> float:
    """The step's matmul work over the cores: every layer's forward, recomputation and
    weight gradient for each micro-batch, and every input gradient but the first layer's."""
    per_layer = 2 * ms['forward'] + ms['weight_gradient'] + ms['input_gradient']
    work = micro * (steps.LAYERS * per_layer - ms['input_gradient'])
    return work / cpus


def main() -> None:
    args = parse_args()
    tfpipe.configure_logical_cpus(8)
    import tensorflow as tf
    from tfpipe_step import build_step
    configs = steps.configs(args.configs)
    schedules = args.schedules.split(',')
    rows = sorted({steps.BATCH // micro for _, micro in configs})
    ms = {r: {form: form_ms(tf, r, form)
              for form in ('forward', 'weight_gradient', 'input_gradient')} for r in rows}
    print(f'load {os.getloadavg()[0]:.1f}; one thread per op; ms per matmul '
          f'[rows, {steps.WIDTH}] x [{steps.WIDTH}, {steps.WIDTH}] (GFLOPS)')
    flops = 2 * steps.WIDTH * steps.WIDTH
    for r in rows:
        print(f'  rows {r:3d}: ' + '  '.join(
            f'{form} {t:.2f} ({flops * r / t / 1e6:.0f})' for form, t in ms[r].items()))
    x = tf.random.normal([steps.BATCH, steps.WIDTH])
    built = {(c, m, s): build_step(c, m, s) for c, m in configs for s in schedules}
    times = {key: [] for key in built}
    for _ in range(args.rounds):
        for key, step in built.items():
            times[key].append(steps.median_step_ms(lambda: step(x).numpy(), 3, 10))
    print(f'step ms (median over {args.rounds} rounds) and matmul floor / step '
          f'({args.cpus} cores)')
    step_ms = {key: statistics.median(values) for key, values in times.items()}
    for cells, micro in configs:
        floor = floor_ms(ms[steps.BATCH // micro], micro, args.cpus)
        cols = '  '.join(f'{s} {step_ms[(cells, micro, s)]:.1f} '
                         f'({floor / step_ms[(cells, micro, s)]:.2f})' for s in schedules)
        print(f'  K={cells} M={micro}: floor {floor:.1f}  {cols}')
    print(f'load after: {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
    main()
