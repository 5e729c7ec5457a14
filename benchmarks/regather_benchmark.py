"""ZeRO stage 3 with and without task.train.regather_per_micro_batch, side by side.

benchmarks/zero_stages_benchmark.py's weight-dominated Dense stack (K=2 cells, every
cell recomputing, Adam, the trainer's step) at R=2, both built in one process with the
BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=true: the only CPU allocator that keeps
statistics, shared by all logical CPUs, so the figure is the host's) and run in
alternating rounds. Prints per mode the median step time, the paired ratio to gathering
once, and the step's peak above the bytes in use before it (after a warm-up step; the
allocator's statistics reset before each measured step), with one replica's whole
weights for scale. On logical CPUs sharing two cores the devices run their tasks
concurrently in one memory, so the saving is what is not gathered at the host's peak.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/regather_benchmark.py [--quick] [--num_micro_batches=4]
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from benchmarks.optimizer_sharding_benchmark import NUM_CELLS, parse_args  # noqa: E402
from benchmarks.zero_stages_benchmark import build  # noqa: E402

MODES = {'gather once': False, 'regather per task': True}
NUM_REPLICAS = 2
MIB = 2 ** 20


def measure(args) -> None:
    """In this (BFC-allocator) process: prints the table."""
    import tfpipe  # before TensorFlow (its oneDNN setting)
    import tensorflow as tf
    tfpipe.configure_logical_cpus(NUM_REPLICAS * NUM_CELLS)
    steps = {mode: build(args, NUM_REPLICAS, 'weights', regather)[0]
             for mode, regather in MODES.items()}
    peaks, times = {}, {mode: [] for mode in MODES}
    for mode, step in steps.items():
        float(step())  # traces and warms up
        before = tf.config.experimental.get_memory_info('CPU:0')['current']
        tf.config.experimental.reset_memory_stats('CPU:0')
        float(step())
        peaks[mode] = tf.config.experimental.get_memory_info('CPU:0')['peak'] - before
    for i in range(args.rounds):
        for mode in (list(MODES) if i % 2 == 0 else list(MODES)[::-1]):
            start = time.perf_counter()
            float(steps[mode]())
            times[mode].append(time.perf_counter() - start)
    whole = args.layers * (args.width * args.width + args.width) * 4
    print(f'{args.layers} x Dense({args.width}), K={NUM_CELLS}, R={NUM_REPLICAS}, '
          f'M={args.num_micro_batches}, recompute always, Adam, stage 3; one replica\'s '
          f'whole weights {whole / MIB:.1f} MiB; {args.rounds} rounds')
    print('  mode                step ms  x once  step peak MiB (host, above the start)')
    first = list(MODES)[0]
    for mode in MODES:
        ratio = statistics.median(b / a for a, b in zip(times[first], times[mode]))
        print(f'  {mode:18}  {1e3 * statistics.median(times[mode]):7.1f}  {ratio:6.2f}  '
              f'{peaks[mode] / MIB:13.1f}')


def main(args) -> int:
    if args.probe:
        measure(args)
        return 0
    cmd = [sys.executable, os.path.abspath(__file__), f'--layers={args.layers}',
           f'--width={args.width}', f'--batch_per_replica={args.batch_per_replica}',
           f'--num_micro_batches={args.num_micro_batches}', f'--rounds={args.rounds}',
           '--probe=memory']
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true', TF_CPP_MIN_LOG_LEVEL='2')
    return subprocess.run(cmd, env=env).returncode


if __name__ == '__main__':
    sys.exit(main(parse_args()))
