"""tfpipe timeline benchmark: measured bubble and time to the first step.

Prints one table, each section measured side by side in one run:

  A. bubble       K=2, M=1/2/4/8 on a balanced Dense stack: the bubble measured by the
                  timeline (tf.timestamp per task, `PipeliningLayer.RecordTimeline`) next
                  to (K-1)/(M+K-1); median over interleaved rounds.
  C. first step   trace + first run of a fresh process's step over K and M (each in its
                  own subprocess), against the goal of 8 s at K=8, M=64.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/timeline_benchmark.py          # ~5-10 minutes
    PYTHONPATH=. python benchmarks/timeline_benchmark.py --quick  # ~1-2 minutes
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

FIRST_STEP_GRID = {'full': [(2, 4), (4, 16), (8, 32), (8, 64)], 'quick': [(2, 4), (8, 64)]}
FIRST_STEP_GOAL = 8.0  # seconds, K=8 M=64 (issue 8)
BUBBLE_MICRO = (1, 2, 4, 8)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--sections', default='A,C')
    ap.add_argument('--first_step_child', default=None,
                    help='internal: K,M; prints one JSON line')
    args = ap.parse_args(argv)
    args.sections = set(args.sections.split(','))
    return args


ARGS = parse_args()

import tensorflow as tf  # noqa: E402  (after the environment is set)

tf.get_logger().setLevel('ERROR')
tf.config.threading.set_intra_op_parallelism_threads(1)  # as pipeline_benchmark.py: devices
tf.config.threading.set_inter_op_parallelism_threads(2)  # overlap on a 2-core host

import tfpipe  # noqa: E402
from tfpipe import fprop_context, layers  # noqa: E402
from tfpipe.pipeline import partition, schedule, timeline  # noqa: E402

tfpipe.configure_logical_cpus(8)


def build(num_layers: int, width: int, batch: int, k: int, m: int, record: bool = False,
          **kw):
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=width, output_dim=width,
                                      activation='relu') for i in range(num_layers)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(num_layers, k),
        num_micro_batches=m, devices=[f'/CPU:{i}' for i in range(k)], **kw).Instantiate()
    x = tf.random.stateless_normal([batch, width], seed=[1, 2])
    t = tf.random.stateless_normal([batch, width], seed=[3, 4])
    recorders = []

    def loss_fn(out, target):
        return tf.reduce_mean(tf.square(out - target), axis=-1)

    @tf.function
    def step():
        with fprop_context.training(step=0):
            if record:
                with pipe.RecordTimeline() as recorder:
                    loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, t)
                recorders.append(recorder)
            else:
                loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, t)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(1e-4 * g)
        return (loss, recorders[0].stamps()) if record else loss

    return step, recorders


def first_step_child(spec: str) -> None:
    k, m = spec.split(',')
    step, _ = build(16, 256, 256, int(k), int(m))
    t0 = time.perf_counter()
    step.get_concrete_function()
    traced = time.perf_counter() - t0
    float(step())
    first = time.perf_counter() - t0
    later = []
    for _ in range(3):
        t1 = time.perf_counter()
        float(step())
        later.append(time.perf_counter() - t1)
    print(json.dumps(dict(trace=traced, first=first, later=statistics.median(later))))


def section_bubble(rounds: int, rows: list) -> None:
    steps = {m: build(8, 512, 256, 2, m, record=True) for m in BUBBLE_MICRO}
    for step, _ in steps.values():
        step()  # trace and warm up
    measured = {m: [] for m in BUBBLE_MICRO}
    per_device = {m: [] for m in BUBBLE_MICRO}
    for r in range(rounds):
        order = BUBBLE_MICRO[r % 4:] + BUBBLE_MICRO[:r % 4]
        for m in order:
            step, recorders = steps[m]
            _, stamps = step()
            line = timeline.Timeline.from_stamps(recorders[0], stamps.numpy())
            bubble = line.bubble()
            measured[m].append(bubble['overall'])
            per_device[m].append([bubble[d] for d in line.devices])
    for m in BUBBLE_MICRO:
        theory = schedule.bubble_fraction(2, m)
        value = statistics.median(measured[m])
        devices = [statistics.median(d[i] for d in per_device[m]) for i in range(2)]
        error = (value - theory) / theory
        rows.append(['A bubble', f'K=2 M={m} (8 x Dense(512), batch 256)',
                     f'{value:.3f}', f'{theory:.3f}', f'{error:+.1%}',
                     'PASS' if abs(error) <= 0.10 else 'MISS',
                     f'per device {devices[0]:.3f} / {devices[1]:.3f}; median of {rounds}'])


def section_first_step(grid: list, rows: list) -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get('PYTHONPATH', ''))
    for k, m in grid:
        out = subprocess.run([sys.executable, __file__, f'--first_step_child={k},{m}'],
                             env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        goal = (k, m) == (8, 64)
        rows.append(['C first step', f'K={k} M={m} (16 x Dense(256), batch 256)',
                     f'{r["first"]:.1f} s', f'{FIRST_STEP_GOAL:.0f} s' if goal else '', '',
                     ('PASS' if r['first'] <= FIRST_STEP_GOAL else 'MISS') if goal else '',
                     f'trace {r["trace"]:.1f} s; later steps {r["later"] * 1e3:.0f} ms'])


def main(args) -> int:
    if args.first_step_child:
        first_step_child(args.first_step_child)
        return 0
    load = os.getloadavg()[0]
    rows = []
    header = ['section', 'variant', 'measured', 'reference', 'diff', 'verdict', 'detail']
    print('A: measured bubble vs (K-1)/(M+K-1); C: first step (trace + first run) against '
          'the goal', flush=True)
    if 'A' in args.sections:
        section_bubble(5 if args.quick else 15, rows)
    if 'C' in args.sections:
        section_first_step(FIRST_STEP_GRID['quick' if args.quick else 'full'], rows)
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print('  '.join(str(v).ljust(w) for v, w in zip(r, widths)))
    print(f'note: 1-min load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end on '
          f'{os.cpu_count()} cores; intra_op=1, inter_op=2 threads, 8 logical CPUs')
    return 0


if __name__ == '__main__':
    sys.exit(main(ARGS))
