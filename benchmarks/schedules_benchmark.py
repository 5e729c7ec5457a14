"""Schedules side by side: fill_drain, 1f1b, interleaved_1f1b (v=2), zb_h1, zb_h2.

For K in {2, 4} and M in {4, 8} on a balanced Dense stack, prints per schedule:
  - step time (median of interleaved rounds) relative to fill_drain;
  - peak memory of one step (BFC allocator; all logical CPUs share it), relative too;
  - the bubble measured by the timeline (tf.timestamp around every task, median over
    rounds), and the idle fraction of the schedule's data on unit costs.

Logical CPUs share two cores here, so a smaller bubble need not shorten the step.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/schedules_benchmark.py           # a few minutes
    PYTHONPATH=. python benchmarks/schedules_benchmark.py --quick   # about a minute
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'  # memory statistics need it (shared notes)

ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
ap.add_argument('--quick', action='store_true')
ap.add_argument('--layers', type=int, default=16)
ap.add_argument('--width', type=int, default=None, help='default 1024 (quick: 256)')
ap.add_argument('--batch', type=int, default=None, help='default 512 (quick: 128)')
ap.add_argument('--rounds', type=int, default=None, help='default 7 (quick: 3)')
ARGS = ap.parse_args()
ARGS.width = ARGS.width or (256 if ARGS.quick else 1024)
ARGS.batch = ARGS.batch or (128 if ARGS.quick else 512)
ARGS.rounds = ARGS.rounds or (3 if ARGS.quick else 7)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpipe  # noqa: E402
from tfpipe import fprop_context, layers  # noqa: E402
from tfpipe.pipeline import partition, schedule  # noqa: E402
from tfpipe.tuning import timeline  # noqa: E402
from tfpipe.pipeline.pipelining_layer import SCHEDULES  # noqa: E402

tf.get_logger().setLevel('ERROR')  # one tf.function per variant is intended
tf.config.threading.set_intra_op_parallelism_threads(1)  # as pipeline_benchmark.py
tf.config.threading.set_inter_op_parallelism_threads(2)
tfpipe.configure_logical_cpus(4)
MIB = 1024.0 * 1024.0
VARIANTS = [('fill_drain', 1), ('1f1b', 1), ('interleaved_1f1b', 2), ('zb_h1', 1), ('zb_h2', 1)]


def loss_fn(outputs, targets):
    return tf.reduce_mean(tf.square(outputs - targets), axis=-1)


def build(name: str, v: int, k: int, m: int):
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=ARGS.width,
                                      output_dim=ARGS.width, activation='relu')
            for i in range(ARGS.layers)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(len(body), k * v),
        num_micro_batches=m, schedule=name, virtual_stages=v,
        devices=[f'/CPU:{i}' for i in range(k)]).Instantiate()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=[ARGS.batch, ARGS.width]), tf.float32)
    y = tf.constant(rng.normal(size=[ARGS.batch, ARGS.width]), tf.float32)

    recorders = []

    def body(record: bool):
        with fprop_context.training(step=0):
            if record:
                with pipe.RecordTimeline() as recorder:
                    loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, y)
                recorders.append(recorder)
            else:
                loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, y)
        for var, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            var.assign_sub(1e-6 * g)
        return (loss, recorders[-1].stamps()) if record else loss

    step = tf.function(lambda: body(False))
    recorded = tf.function(lambda: body(True))

    def measured_bubble() -> float:
        _, stamps = recorded()
        return timeline.Timeline.from_stamps(recorders[-1], stamps.numpy()).bubble()['overall']

    return step, measured_bubble


def unit_bubble(name: str, v: int, k: int, m: int) -> float:
    ticks = SCHEDULES[name].build(k, m, v)
    return schedule.idle_slots(ticks, k) / (len(ticks) * k)


def peak_mib(step) -> float:
    tf.config.experimental.reset_memory_stats('CPU:0')
    step().numpy()
    return tf.config.experimental.get_memory_info('CPU:0')['peak'] / MIB


def main() -> None:
    print(f'{ARGS.layers} x Dense({ARGS.width}), batch {ARGS.batch}, recompute always, '
          f'{ARGS.rounds} interleaved rounds; ratios against fill_drain of the same K, M')
    print(f'{"K":>2} {"M":>2}  {"schedule":<20} {"ms/step":>8} {"time":>6} {"peak MiB":>9} '
          f'{"memory":>7} {"bubble measured":>16} {"unit":>6}')
    for k in (2, 4):
        for m in (4, 8):
            steps, bubbles = {}, {}
            for name, v in VARIANTS:
                steps[name], bubbles[name] = build(name, v, k, m)
                steps[name]().numpy()  # trace and warm up
                bubbles[name]()
            peaks = {}
            for name in steps:  # one at a time, so peaks are each step's own
                gc.collect()
                peaks[name] = peak_mib(steps[name])
            times = {name: [] for name in steps}
            measured = {name: [] for name in steps}
            names = list(steps)
            for r in range(ARGS.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    start = time.perf_counter()
                    steps[name]().numpy()
                    times[name].append(time.perf_counter() - start)
                    measured[name].append(bubbles[name]())
            base = statistics.median(times['fill_drain'])
            for name, v in VARIANTS:
                med = statistics.median(times[name])
                label = f'{name} (v={v})' if v > 1 else name
                print(f'{k:>2} {m:>2}  {label:<20} {1e3 * med:8.1f} {med / base:5.2f}x '
                      f'{peaks[name]:9.1f} {peaks[name] / peaks["fill_drain"]:6.2f}x '
                      f'{statistics.median(measured[name]):16.3f} '
                      f'{unit_bubble(name, v, k, m):6.3f}')


if __name__ == '__main__':
    main()
