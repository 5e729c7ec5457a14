"""tfpipe executor memory benchmark: gradient accumulation's peak, per executor.

Exact accumulation over M micro-batches needs one gradient set (the running sums)
beyond what M=1 holds; anything more is memory the executor wastes. This script
measures, for each executor (`unrolled`: PipeliningLayer cell_functions=False;
`functions`: cell_functions=True, the default) and M in 1, 4, 8, the peak bytes of
one training step of a weight-dominated stack: 8 x Dense(2048), batch 256, K=2
([4, 4]) on 4 logical CPUs, recompute 'always', `ForwardBackward`, every gradient
consumed (summed into the step's output). Each (executor, M) runs in a fresh
process with the BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`, the only CPU
allocator that keeps peak statistics); the peak is counted from before the model
is built, so it includes the weights, and is read after a warm-up step.

Printed: M=1 and M=4 peaks, (M=4 - M=1) in gradient sets (the bytes of one set of
weight gradients), M=8 / M=4, and the M=1 peak of each executor relative to the
unrolled one. Goal (issue 17): the default within 1.1 gradient sets and its M=1
peak within 5% of the unrolled executor's.

The peak depends on which ops the two inter-op threads run at once, so it moves
from run to run (M=4 301-347 MiB on one tree at load 3-10): compare trees over
several alternating runs. `--trace` also records the measured step with the
profiler and prints the buffers (1 MiB and more) allocated during the step and
alive at its peak, with their ops: how the regression in benchmarks/README.md,
"Dense input gradient and executor memory", was found (the profiler's own work
shifts the timing a little).

Run (from the repository root; about 2 minutes):
    PYTHONPATH=. python benchmarks/executor_memory_benchmark.py
    PYTHONPATH=. python benchmarks/executor_memory_benchmark.py --width=1024   # smaller
    PYTHONPATH=. python benchmarks/executor_memory_benchmark.py --executors=functions \
        --micro_batches=1,4 --trace
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Optional

EXECUTORS = ('unrolled', 'functions')
MICRO_BATCHES = (1, 4, 8)
GOAL_SETS, GOAL_M1 = 1.1, 1.05
MIB = 2 ** 20


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--width', type=int, default=2048)
    ap.add_argument('--layers', type=int, default=8)
    ap.add_argument('--batch', type=int, default=256)
    ap.add_argument('--cells', type=int, default=2)
    ap.add_argument('--micro_batches', default=','.join(map(str, MICRO_BATCHES)))
    ap.add_argument('--executors', default=','.join(EXECUTORS))
    ap.add_argument('--trace', action='store_true', help='print the buffers alive at each '
                    "measured step's peak (profiler trace)")
    ap.add_argument('--child', default=None, help='internal: executor,M; prints one JSON line')
    return ap.parse_args(argv)


def measure(executor: str, num_micro_batches: int, width: int, layers: int, batch: int,
            cells: int, trace: bool = False) -> dict:
    """In this (fresh, BFC-allocator) process: {'peak': bytes of one step's peak counted
    from before the model was built, 'grad_set': bytes of one set of weight gradients},
    with `trace` also 'live': `live_at_peak` of the measured step."""
    import tempfile

    import tensorflow as tf

    import tfpipe
    from tfpipe import fprop_context
    from tfpipe import layers as tfl
    from tfpipe.pipeline import partition

    tfpipe.configure_logical_cpus(2 * cells)
    before = tf.config.experimental.get_memory_info('CPU:0')['current']
    body = [tfl.Dense.Params().Set(name=f'fc{i}', input_dim=width, output_dim=width,
                                   activation='relu') for i in range(layers)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(layers, cells),
        num_micro_batches=num_micro_batches, recompute='always',
        cell_functions=executor == 'functions',
        devices=[f'/CPU:{i}' for i in range(cells)]).Instantiate()
    x = tf.random.stateless_normal([batch, width], seed=[1, 2])
    t = tf.random.stateless_normal([batch, width], seed=[3, 4])

    @tf.function
    def step():
        with fprop_context.training(step=0):
            loss, grads = pipe.ForwardBackward(
                pipe.theta, x, lambda out, y: tf.reduce_mean(tf.square(out - y), -1), t)
        return loss + tf.add_n([tf.reduce_sum(g) for g in tf.nest.flatten(grads)])

    step().numpy()  # traces and warms up
    tf.config.experimental.reset_memory_stats('CPU:0')
    logdir = tempfile.mkdtemp(prefix='executor_memory_') if trace else None
    if trace:
        tf.profiler.experimental.start(
            logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
    step().numpy()
    if trace:
        tf.profiler.experimental.stop()
    peak = tf.config.experimental.get_memory_info('CPU:0')['peak'] - before
    grad_set = sum(v.shape.num_elements() * v.dtype.size for v in tf.nest.flatten(pipe.theta))
    result = {'peak': peak, 'grad_set': grad_set}
    if trace:
        result['live'] = live_at_peak(logdir)
    return result


def live_at_peak(logdir: str, smallest: int = MIB) -> list[tuple[str, int]]:
    """From the profiler trace in `logdir`: (op, bytes) of every buffer of `smallest` bytes
    or more that was allocated during the traced step and still alive when the allocator's
    bytes in use peaked (the BFC allocator's MemoryAllocation / MemoryDeallocation events).
    Buffers allocated before the step (weights, inputs) are not in the trace."""
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # the trace's format

    space = xplane_pb2.XSpace()
    with open(glob.glob(os.path.join(logdir, 'plugins/profile/*/*.xplane.pb'))[0], 'rb') as f:
        space.ParseFromString(f.read())
    host = next(plane for plane in space.planes if plane.name == '/host:CPU')

    def value(stat):
        kind = stat.WhichOneof('value')
        v = getattr(stat, kind)
        return host.stat_metadata[v].name if kind == 'ref_value' else v

    events = []
    for line in host.lines:
        for event in line.events:
            kind = host.event_metadata[event.metadata_id].name
            if kind in ('MemoryAllocation', 'MemoryDeallocation'):
                stats = {host.stat_metadata[s.metadata_id].name: value(s) for s in event.stats}
                events.append((line.timestamp_ns * 1000 + event.offset_ps, kind, stats))
    live, best, at_best = {}, -1, {}
    for _, kind, stats in sorted(events, key=lambda e: e[0]):
        if kind == 'MemoryAllocation':
            live[stats['addr']] = (stats.get('tf_op', '?'), stats['allocation_bytes'])
        else:
            live.pop(stats['addr'], None)
        if stats['bytes_allocated'] > best:
            best, at_best = stats['bytes_allocated'], dict(live)
    return sorted((v for v in at_best.values() if v[1] >= smallest), key=lambda v: -v[1])


def run_child(executor: str, num_micro_batches: int, width: int, layers: int, batch: int,
              cells: int, trace: bool = False, timeout: float = 600) -> dict:
    """measure() in a fresh process with the BFC allocator on (set before TF loads)."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true', TF_CPP_MIN_LOG_LEVEL='2')
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env['PYTHONPATH'] = os.pathsep.join(p for p in (repo, env.get('PYTHONPATH')) if p)
    cmd = [sys.executable, os.path.abspath(__file__), f'--child={executor},{num_micro_batches}',
           f'--width={width}', f'--layers={layers}', f'--batch={batch}', f'--cells={cells}']
    cmd += ['--trace'] if trace else []
    result = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f'{executor} M={num_micro_batches} failed:\n{result.stderr[-3000:]}')
    return json.loads(result.stdout.strip().splitlines()[-1])


def summary(peaks: dict[int, int], grad_set: int) -> dict:
    """The issue's columns from one executor's {M: peak}: extra gradient sets M=4 over
    M=1, and M=8 / M=4 (flat when accumulation is bounded)."""
    out = {'m1': peaks[1], 'm4': peaks[4], 'sets': (peaks[4] - peaks[1]) / grad_set}
    if 8 in peaks:
        out['m8_over_m4'] = peaks[8] / peaks[4]
    return out


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    sizes = dict(width=args.width, layers=args.layers, batch=args.batch, cells=args.cells)
    if args.child:
        executor, m = args.child.split(',')
        print(json.dumps(measure(executor, int(m), trace=args.trace, **sizes)))
        return
    executors = args.executors.split(',')
    micro = [int(m) for m in args.micro_batches.split(',')]
    print(f'{args.layers} x Dense({args.width}), batch {args.batch}, K={args.cells}, recompute '
          "'always', BFC allocator, peak counted from before the model is built", flush=True)
    rows, grad_set = {}, None
    for executor in executors:
        peaks = {}
        for m in micro:
            r = run_child(executor, m, trace=args.trace, **sizes)
            peaks[m], grad_set = r['peak'], r['grad_set']
            print(f'  {executor} M={m}: {r["peak"] / MIB:.0f} MiB', flush=True)
            if 'live' in r:
                print('    allocated in the step, alive at its peak: ' + ', '.join(
                    f'{op} {size / MIB:.1f}' for op, size in r['live']), flush=True)
        rows[executor] = summary(peaks, grad_set)
    print(f'one gradient set = {grad_set / MIB:.0f} MiB')
    print('| executor | M=1 peak | M=4 peak | (M=4 - M=1) in gradient sets | M=8 / M=4 '
          '| M=1 vs unrolled |')
    print('| --- | --- | --- | --- | --- | --- |')
    base = rows.get('unrolled', {}).get('m1')
    for executor, r in rows.items():
        vs = f'{r["m1"] / base:.2f}' if base else '-'
        m8 = f'{r["m8_over_m4"]:.2f}' if 'm8_over_m4' in r else '-'
        print(f'| {executor} | {r["m1"] / MIB:.0f} MiB | {r["m4"] / MIB:.0f} MiB | '
              f'{r["sets"]:.2f} | {m8} | {vs} |')
    print(f'goal: functions within {GOAL_SETS} gradient sets, M=1 within '
          f'{GOAL_M1 - 1:.0%} of unrolled')


if __name__ == '__main__':
    main()
