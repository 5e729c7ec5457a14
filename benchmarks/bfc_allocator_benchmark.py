"""tfpipe BFC allocator benchmark: what the CPU allocator that keeps peak statistics costs.

The trainer can print and summarise the measured peak bytes per device only where
the allocator keeps statistics: on CPUs, the BFC allocator
(`TF_CPU_ALLOCATOR_USE_BFC=true`). This script runs the trainer binary on a model
for a few steps with the variable set and unset, alternating, in fresh processes,
and prints the steady steps/s of each (the rate of the last progress line, which
excludes the first, tracing step) and their ratio per round.

Run (from the repository root; about 1 minute per trainer run):
    PYTHONPATH=. python benchmarks/bfc_allocator_benchmark.py
    PYTHONPATH=. python benchmarks/bfc_allocator_benchmark.py --model=mt.reverse.TransformerPipe
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

_RATE = re.compile(r'([\d.]+) steps/s')


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--model', default='image.shapes.AmoebaNetPipe')
    ap.add_argument('--steps', type=int, default=60)
    ap.add_argument('--rounds', type=int, default=2)
    ap.add_argument('--num_logical_cpus', type=int, default=4)
    return ap.parse_args(argv)


def steps_per_sec(model: str, steps: int, data_dir: str, bfc: bool, cpus: int) -> float:
    """The trainer's last reported steps/s for `steps` steps in a fresh logdir."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
               PYTHONPATH=repo + os.pathsep + os.environ.get('PYTHONPATH', ''))
    env['TF_CPU_ALLOCATOR_USE_BFC'] = 'true' if bfc else 'false'
    with tempfile.TemporaryDirectory() as logdir:
        result = subprocess.run(
            [sys.executable, '-m', 'trainer', f'--model={model}', f'--logdir={logdir}',
             f'--tfds_data_dir={data_dir}', f'--num_logical_cpus={cpus}',
             f'--max_steps={steps}', f'--params_override=task.train.summary_interval_steps='
             f'{steps}'], env=env, cwd=repo, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return float(_RATE.findall(result.stderr)[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    from tfpipe import datasets
    with tempfile.TemporaryDirectory() as data_dir:
        for name in ('tfpipe_shapes', 'tfpipe_reverse'):
            datasets.prepare(name, data_dir)
        ratios = []
        print(f'{args.model}, {args.steps} steps, {args.num_logical_cpus} logical CPUs; '
              f'load {os.getloadavg()[0]:.1f}', flush=True)
        for r in range(args.rounds):
            order = (True, False) if r % 2 else (False, True)
            rate = {bfc: steps_per_sec(args.model, args.steps, data_dir, bfc,
                                       args.num_logical_cpus) for bfc in order}
            ratios.append(rate[False] / rate[True])
            print(f'  round {r}: BFC on {rate[True]:.2f} steps/s, off {rate[False]:.2f} '
                  f'steps/s, step time on/off {ratios[-1]:.3f}', flush=True)
        print(f'step time BFC on / off: median {statistics.median(ratios):.3f} over '
              f'{len(ratios)} rounds; load {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
    main()
