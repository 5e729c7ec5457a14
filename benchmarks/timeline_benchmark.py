"""tfpipe timeline benchmark: the measured bubble against the theory, side by side in one run.

K=2 (--bubble_k), M=1/2/4/8 fill-drain and K=2 x v=2 interleaved, on a balanced Dense
stack: the bubble measured by the timeline (tf.timestamp per task,
`PipeliningLayer.RecordTimeline`) next to the schedule's bubble on unit costs,
(K-1)/(M+K-1) or (K-1)/(vM+K-1), and on the measured per-phase costs
(`Timeline.modelled_bubble`), with the latency between tasks (`Timeline.latency`) and the
per-phase times; intra_op=1 and inter_op=2 threads so the two devices run at once on two
cores. The time to the first step is first_step_benchmark.py's.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/timeline_benchmark.py                  # ~5-10 minutes
    PYTHONPATH=. python benchmarks/timeline_benchmark.py --quick          # ~2 minutes
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

BUBBLE_MICRO = (1, 2, 4, 8)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--width', type=int, default=None, help='Dense width (default 1024; '
                    '--quick 512)')
    ap.add_argument('--layers', type=int, default=8, help='Dense layers')
    ap.add_argument('--batch', type=int, default=None, help='batch (default 512; --quick 256)')
    ap.add_argument('--rounds', type=int, default=None, help='rounds (default 12; --quick 4)')
    ap.add_argument('--bubble_k', default='2', help='comma list of K (K=4 needs 4 of the '
                    '8 logical CPUs; on 2 cores they cannot all compute at once)')
    ap.add_argument('--intra_op_threads', type=int, default=1)
    ap.add_argument('--inter_op_threads', type=int, default=2)
    args = ap.parse_args(argv)
    args.width = args.width or (512 if args.quick else 1024)
    args.batch = args.batch or (256 if args.quick else 512)
    args.rounds = args.rounds or (4 if args.quick else 12)
    args.bubble_k = [int(k) for k in args.bubble_k.split(',')]
    return args


ARGS = parse_args()

import tensorflow as tf  # noqa: E402  (after the environment is set)

tf.get_logger().setLevel('ERROR')

import tfpipe  # noqa: E402
from tfpipe import fprop_context, layers  # noqa: E402
from tfpipe.pipeline import partition  # noqa: E402
from tfpipe.tuning import timeline  # noqa: E402

# Single-threaded ops and two inter-op threads (as pipeline_benchmark.py): the two devices of
# K=2 each get a core of this 2-core host and really run at the same time.
tfpipe.configure_logical_cpus(8, ARGS.intra_op_threads, ARGS.inter_op_threads)


def build(num_layers: int, width: int, batch: int, k: int, m: int, record: bool = False,
          cells: int = 0, **kw):
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=width, output_dim=width,
                                      activation='relu') for i in range(num_layers)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(num_layers, cells or k),
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


def _quartiles(values: list) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def section_bubble(args) -> None:
    """Measured bubble next to the schedule's unit-cost bubble and to the bubble the same
    schedule has on the measured per-phase costs, with the latency between tasks.

    Variants are interleaved round by round. Other processes preempt our threads at
    random (a 1 ms task can take 30 ms), and preemption only adds time, so besides the
    median over all rounds each variant is also read from its quietest quarter of rounds
    (shortest spans): the closest this machine gets to an undisturbed pipeline."""
    width, depth, batch = args.width, args.layers, args.batch
    variants = {}  # name -> (K, M, v, schedule)
    for k in args.bubble_k:
        for m in BUBBLE_MICRO:
            variants[f'K={k} M={m}'] = (k, m, 1, 'fill_drain')
    for m in (4, 8) if 2 in args.bubble_k else ():
        variants[f'K=2 M={m} v=2'] = (2, m, 2, 'interleaved_1f1b')
    steps = {}
    for name, (k, m, v, sched) in variants.items():
        extra = dict(schedule=sched, virtual_stages=v) if v > 1 else {}
        steps[name] = build(depth, width, batch, k, m, record=True, cells=k * v, **extra)
        for _ in range(2):
            steps[name][0]()  # trace and warm up
    lines = {name: [] for name in variants}
    names = list(variants)
    loads = []
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step, recorders = steps[name]
            _, stamps = step()
            lines[name].append(timeline.Timeline.from_stamps(recorders[0], stamps.numpy()))
        loads.append(os.getloadavg()[0])
    print(f'\nbubble, {depth} x Dense({width}), batch {batch}, recompute always, '
          f'{args.rounds} rounds; load average per round: ' + ' '.join(f'{v:.1f}' for v in loads))
    print('   unit: the schedule on unit costs ((K-1)/(M+K-1), interleaved (K-1)/(vM+K-1)); '
          'costs: the same schedule on the measured per-phase medians, no time between '
          'tasks; latency: idle after a task could start; overlap x: a task\'s time while '
          'the other device computes over its time alone; quiet: median of the quarter of '
          'rounds with the shortest span')
    header = ['variant', 'all rounds [q1, q3]', 'quiet', 'unit', 'quiet/unit', 'costs',
              'quiet/costs', 'latency', 'overlap x', 'span ms', 'F/R/B ms per cell (quiet)']
    rows = []
    for name, (k, m, v, sched) in variants.items():
        measured = [line.bubble()['overall'] for line in lines[name]]
        q1, med, q3 = _quartiles(measured)
        quiet = sorted(lines[name], key=lambda line: line.span)[:max(1, len(lines[name]) // 4)]
        bubble = statistics.median(line.bubble()['overall'] for line in quiet)
        modelled = statistics.median(line.modelled_bubble() for line in quiet)
        latency = statistics.median(line.latency()['overall'] for line in quiet)
        unit = quiet[0].theoretical_bubble()
        costs = {}
        for line in quiet:
            for key, value in line.phase_costs().items():
                costs.setdefault(key, []).append(value)
        phases = ' | '.join('/'.join(f'{1e3 * statistics.median(costs[(c, p)]):.1f}'
                                     for p in timeline.PHASES if (c, p) in costs)
                            for c in range(k * v))
        rows.append([f'{name} {sched}', f'{med:.3f} [{q1:.3f}, {q3:.3f}]', f'{bubble:.3f}',
                     f'{unit:.3f}', f'{bubble / unit:.2f}', f'{modelled:.3f}',
                     f'{bubble / modelled:.2f}', f'{latency:.3f}',
                     f'{_overlap_slowdown(lines[name]):.2f}',
                     f'{1e3 * statistics.median(line.span for line in quiet):.0f}', phases])
    _print_table(header, rows)


def _overlap_slowdown(lines: list) -> float:
    """Median over (cell, phase) of: a task's duration while another device computes over
    its duration while every other device idles. 1 for independent devices; logical CPUs
    share the host's cores (and, here, other processes' load)."""
    alone, overlapped = {}, {}
    for line in lines:
        for e in line.events:
            shared = sum(max(0.0, min(e.end, o.end) - max(e.start, o.start))
                         for o in line.events if o.label.device != e.label.device)
            share = shared / e.duration if e.duration > 0 else 0.0
            target = alone if share < 0.1 else overlapped if share > 0.9 else None
            if target is not None:
                target.setdefault((e.label.cell, e.label.phase), []).append(e.duration)
    ratios = [statistics.median(overlapped[key]) / statistics.median(alone[key])
              for key in alone if key in overlapped]
    return statistics.median(ratios) if ratios else float('nan')


def _print_table(header: list, rows: list) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print('  '.join(str(v).ljust(w) for v, w in zip(r, widths)), flush=True)


def main(args) -> int:
    load = os.getloadavg()[0]
    section_bubble(args)
    print(f'note: 1-min load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end on '
          f'{os.cpu_count()} cores; intra_op='
          f'{tf.config.threading.get_intra_op_parallelism_threads()}, inter_op='
          f'{tf.config.threading.get_inter_op_parallelism_threads()} threads, 8 logical CPUs')
    return 0


if __name__ == '__main__':
    sys.exit(main(ARGS))
