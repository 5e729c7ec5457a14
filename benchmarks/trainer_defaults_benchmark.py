"""tfpipe trainer defaults benchmark: what each environment default of the trainer costs.

The trainer sets two TensorFlow environment variables unless the user did
(trainer/main.py `run`):

- `TF_CPU_ALLOCATOR_USE_BFC=true`: the CPU allocator that keeps peak statistics, so
  the trainer can print and summarise the peak bytes per device;
- `TF_ENABLE_ONEDNN_OPTS=1`: oneDNN's CPU kernels, which TensorFlow turns on by
  itself only on some Intel CPUs. Elsewhere (AMD EPYC here) a convolution's
  backward falls back to kernels that allocate a scratch buffer the size of the L3
  cache per call, which dominates a small model's peak.

This script runs the trainer binary on a model for a few steps with the chosen
variable on and off, alternating, in fresh processes, and prints per round the
steady steps/s of each (the rate of the last progress line, which excludes the
first, tracing step), the step-time ratio on/off, and the peak bytes each run
reports (none with the BFC allocator off).

Run (from the repository root; about 1 minute per trainer run):
    PYTHONPATH=. python benchmarks/trainer_defaults_benchmark.py --variable=onednn
    PYTHONPATH=. python benchmarks/trainer_defaults_benchmark.py --variable=bfc \
        --model=mt.reverse.TransformerPipe
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RATE = re.compile(r'([\d.]+) steps/s')
_PEAK = re.compile(r'peak CPU:0 ([\d.]+) MiB')
# --variable -> (environment variable, its value on, its value off)
VARIABLES = {'bfc': ('TF_CPU_ALLOCATOR_USE_BFC', 'true', 'false'),
             'onednn': ('TF_ENABLE_ONEDNN_OPTS', '1', '0')}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--variable', choices=sorted(VARIABLES), default='onednn')
    ap.add_argument('--model', default='image.shapes.AmoebaNetPipe')
    ap.add_argument('--steps', type=int, default=60)
    ap.add_argument('--rounds', type=int, default=2)
    ap.add_argument('--num_logical_cpus', type=int, default=4)
    return ap.parse_args(argv)


def run_trainer(model: str, steps: int, data_dir: str, env_update: dict, cpus: int,
                repo: str = REPO) -> tuple[float, Optional[float]]:
    """(the trainer's last reported steps/s, its last reported peak MiB or None) for
    `steps` steps in a fresh logdir, with `env_update` in its environment; the trainer
    of the checkout at `repo` (trace_cost_benchmark.py runs another revision's)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
               PYTHONPATH=repo + os.pathsep + os.environ.get('PYTHONPATH', ''))
    env.update(env_update)
    with tempfile.TemporaryDirectory() as logdir:
        result = subprocess.run(
            [sys.executable, '-m', 'trainer', f'--model={model}', f'--logdir={logdir}',
             f'--tfds_data_dir={data_dir}', f'--num_logical_cpus={cpus}',
             f'--max_steps={steps}', f'--params_override=task.train.summary_interval_steps='
             f'{steps}'], env=env, cwd=repo, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    peaks = _PEAK.findall(result.stderr)
    return float(_RATE.findall(result.stderr)[-1]), float(peaks[-1]) if peaks else None


def _mib(peak: Optional[float]) -> str:
    return 'no peak' if peak is None else f'peak {peak:.1f} MiB'


def main(argv=None) -> None:
    args = parse_args(argv)
    name, on, off = VARIABLES[args.variable]
    from tfpipe import datasets
    with tempfile.TemporaryDirectory() as data_dir:
        for dataset in ('tfpipe_shapes', 'tfpipe_reverse'):
            datasets.prepare(dataset, data_dir)
        ratios = []
        print(f'{name} {on} vs {off}: {args.model}, {args.steps} steps, '
              f'{args.num_logical_cpus} logical CPUs; load {os.getloadavg()[0]:.1f}', flush=True)
        for r in range(args.rounds):
            order = (on, off) if r % 2 else (off, on)
            runs = {value: run_trainer(args.model, args.steps, data_dir, {name: value},
                                       args.num_logical_cpus) for value in order}
            ratios.append(runs[off][0] / runs[on][0])
            print(f'  round {r}: on {runs[on][0]:.2f} steps/s {_mib(runs[on][1])}, off '
                  f'{runs[off][0]:.2f} steps/s {_mib(runs[off][1])}, step time on/off '
                  f'{ratios[-1]:.3f}', flush=True)
        print(f'step time {name}={on} / {off}: median {statistics.median(ratios):.3f} over '
              f'{len(ratios)} rounds; load {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
    main()
