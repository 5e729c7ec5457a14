"""tfpipe against its peers (torch.distributed.pipelining, Lingvo's GPipe), side by side.

Issue 26's table, run by this script itself: 8 x Dense(1024) relu, batch 256, recompute, SGD
lr 0.01, loss mean(y^2), even balance, median of 10 steps after 3 warm-ups (ms), at K=2 M=1,
K=2 M=4, K=2 M=8 and K=4 M=8 on this machine's cores:

- tfpipe: PipeliningLayer through the library on 8 logical CPUs (benchmarks/peers/
  tfpipe_pipe.py), at each kernel setting (TF_ENABLE_ONEDNN_OPTS=0/1) x thread setting
  (tfpipe's default, TensorFlow's 0/0);
- torch.distributed.pipelining (ScheduleGPipe, one process per stage over gloo, recompute by
  torch.utils.checkpoint; benchmarks/peers/torch_pipe.py) at torch.set_num_threads 1 and 2;
- Lingvo 0.14.2's lingvo.core.gpipe.PipeliningLayer on TensorFlow 2.21, K of 8 logical CPUs
  (benchmarks/peers/lingvo_pipe.py), at each kernel setting x threads (0/0, 1/2).

Each setting is a fresh process that runs every config; a round runs every setting once, in a
new random order, and the table takes each setting's median over rounds, so a slow phase of a
shared machine hits every system. Per config it prints each setting, each system's best, and
the ratios tfpipe/torch (goal <= 0.7 at K=2 M=4, K=2 M=8, K=4 M=8) and tfpipe/Lingvo (goal
<= 0.5), each system at its best setting.

The peers are no tfpipe dependency: on first use the script makes one venv each under
--venvs (default ~/.cache/tfpipe-peers) and reuses it afterwards. torch: the CPU build
(torch==2.13.0+cpu, a local wheel on this machine kind) or else PyPI's torch 2.14.1 (which
brings GBs of CUDA libraries). Lingvo: tensorflow-cpu 2.21.0 and lingvo==0.14.2 --no-deps (its
pins include jupyter, apache-beam and tensorflow-text) plus the three modules its GPipe imports.

Run (from the repository root; at load 10-20 on 2 cores a full run takes ~75 minutes, --quick
~13, most of it torch at 2 threads per stage; the first run ~8 minutes more to make the venvs):
    python benchmarks/peers_benchmark.py
    python benchmarks/peers_benchmark.py --quick          # 1 round, fewer settings and steps
    python benchmarks/peers_benchmark.py --configs=2x8 --rounds=5 --systems=tfpipe,torch
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, 'benchmarks', 'peers')
LAYERS, BATCH = 8, 256  # benchmarks/peers/steps.py's model
GOAL_TORCH, GOAL_LINGVO = 0.7, 0.5
TORCH_GOAL_CONFIGS = ('2x4', '2x8', '4x8')
DEFAULT_VENVS = os.path.join(os.path.expanduser('~'), '.cache', 'tfpipe-peers')
SYSTEMS = ('tfpipe', 'torch', 'lingvo')
# Per system: setting label -> (TF_ENABLE_ONEDNN_OPTS or None, the worker's --threads).
SETTINGS = {
    'tfpipe': {'onednn=0 threads=default': ('0', 'default'),
               'onednn=1 threads=default': ('1', 'default'),
               'onednn=0 threads=0/0': ('0', '0/0'),
               'onednn=1 threads=0/0': ('1', '0/0')},
    'torch': {'threads=1': (None, '1'), 'threads=2': (None, '2')},
    'lingvo': {'onednn=0 threads=0/0': ('0', 'default'),
               'onednn=1 threads=0/0': ('1', 'default'),
               'onednn=0 threads=1/2': ('0', '1/2'),
               'onednn=1 threads=1/2': ('1', '1/2')},
}
QUICK_SETTINGS = {'tfpipe': ('onednn=0 threads=default', 'onednn=1 threads=default'),
                  'torch': ('threads=1', 'threads=2'),
                  'lingvo': ('onednn=0 threads=0/0',)}
# venv name -> pip install steps, the first that succeeds wins; each step is a list of
# alternatives tried in order (torch: the CPU build, else PyPI's default build).
VENVS = {
    'torch': [[['torch==2.13.0+cpu', 'numpy'], ['torch==2.14.1', 'numpy']]],
    'lingvo': [[['tensorflow-cpu==2.21.0', 'sympy', 'sentencepiece', 'matplotlib']],
               [['--no-deps', 'lingvo==0.14.2']]],
}


class VenvError(RuntimeError):
    """A peer's venv could not be made (no network, no such release...)."""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--configs', default='2x1,2x4,2x8,4x8',
                    help=f'KxM, comma-separated; K must divide {LAYERS}, M {BATCH}')
    ap.add_argument('--systems', default=','.join(SYSTEMS), help='subset of ' + ','.join(SYSTEMS))
    ap.add_argument('--rounds', type=int, default=None, help='default 3 (--quick: 1)')
    ap.add_argument('--quick', action='store_true',
                    help='1 round, 2 warm-ups + 5 steps, fewer settings (see QUICK_SETTINGS)')
    ap.add_argument('--venvs', default=DEFAULT_VENVS,
                    help="where the peers' venvs are made once and reused")
    args = ap.parse_args(argv)
    args.config_list = parse_configs(ap, args.configs)
    for cells, micro in args.config_list:
        if cells < 2 or LAYERS % cells or micro < 1 or BATCH % micro:
            ap.error(f'--configs: {cells}x{micro} needs K >= 2 dividing {LAYERS} (even balance) '
                     f'and M dividing the batch {BATCH}, e.g. 2x4 or 4x8')
    args.system_list = args.systems.split(',')
    unknown = sorted(set(args.system_list) - set(SYSTEMS))
    if unknown or 'tfpipe' not in args.system_list:
        ap.error(f'--systems={args.systems!r}: pick from {",".join(SYSTEMS)}, tfpipe included '
                 '(the ratios are tfpipe\'s)')
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if args.rounds < 1:
        ap.error(f'--rounds={args.rounds}: at least 1')
    args.warmup, args.steps = (2, 5) if args.quick else (3, 10)
    return args


def parse_configs(ap: argparse.ArgumentParser, text: str) -> list[tuple[int, int]]:
    """'2x4,4x8' -> [(2, 4), (4, 8)]; anything else stops with one line (ap.error)."""
    try:
        configs = [tuple(int(v) for v in c.split('x')) for c in text.split(',')]
        if all(len(c) == 2 for c in configs):
            return configs
    except ValueError:
        pass
    ap.error(f'--configs={text!r}: write KxM items, e.g. --configs=2x4,4x8')


def venv_python(root: str, name: str) -> str:
    """The venv's Python, made on first use: a marker file records what was installed, so
    a half-made venv (a failed earlier try) is made anew. The venv gets no pip of its own
    (ensurepip takes ~25 s here): this Python's pip installs into it (pip --python)."""
    path = os.path.join(root, name)
    python = os.path.join(path, 'bin', 'python')
    marker = os.path.join(path, 'tfpipe-peers.json')
    if os.path.exists(marker):
        return python
    shutil.rmtree(path, ignore_errors=True)
    print(f'making the {name} venv in {path} (once; a few minutes)', flush=True)
    installed = []
    try:
        run_pip([sys.executable, '-m', 'venv', '--without-pip', path])
        for alternatives in VENVS[name]:
            errors = []
            for requirement in alternatives:
                try:
                    run_pip([sys.executable, '-m', 'pip', '--python', python, 'install', '-q',
                             *requirement])
                    installed.append(requirement)
                    break
                except VenvError as e:
                    errors.append(str(e))
            else:
                raise VenvError('; '.join(errors))
    except VenvError as e:
        shutil.rmtree(path, ignore_errors=True)
        raise VenvError(f'cannot make the {name} venv in {path}: {e} (needs PyPI; '
                        f'run with --systems without {name} to skip it)') from None
    with open(marker, 'w') as f:
        json.dump(installed, f)
    return python


def run_pip(cmd: list[str]) -> None:
    """Runs `python -m venv|pip ...`; its failure is a VenvError naming pip's first error."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines()
                 if line.strip() and not line.startswith('WARNING')]
        errors = [line for line in lines if line.startswith('ERROR:')] or lines
        what = ' '.join(cmd[cmd.index('install'):] if 'install' in cmd else cmd[1:])
        raise VenvError(f'{what} failed: '
                        f'{errors[0] if errors else "exit " + str(done.returncode)}')


def worker_run(system: str, python: str, setting: tuple[Optional[str], str],
               args: argparse.Namespace, model: str = 'pipe') -> dict[str, float]:
    """One process of `system` at `setting` over every config: config -> median step ms.
    `model` picks the worker file, benchmarks/peers/<system>_<model>.py."""
    onednn, threads = setting
    env = {k: v for k, v in os.environ.items() if k not in (
        'TF_ENABLE_ONEDNN_OPTS', 'TF_NUM_INTRAOP_THREADS', 'TF_NUM_INTEROP_THREADS',
        'OMP_NUM_THREADS', 'PYTHONPATH')}
    env['TF_CPP_MIN_LOG_LEVEL'] = '3'
    if onednn is not None:
        env['TF_ENABLE_ONEDNN_OPTS'] = onednn
    if system == 'tfpipe':
        env['PYTHONPATH'] = REPO
    cmd = [python, os.path.join(WORKERS, f'{system}_{model}.py'), f'--configs={args.configs}',
           f'--threads={threads}', f'--warmup={args.warmup}', f'--steps={args.steps}']
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        print(f'  {system} {setting} failed: {done.stderr.strip().splitlines()[-1:]}', flush=True)
        return {}
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{')]
    return {row['config']: row['ms'] for row in rows}


def best(medians: dict[str, dict[str, float]], config: str) -> tuple[str, float]:
    """The fastest setting of one system at `config`: (label, ms)."""
    seen = [(ms[config], label) for label, ms in medians.items() if config in ms]
    if not seen:
        return '-', float('nan')
    ms, label = min(seen)
    return label, ms


def verdict(ratio: float, goal: float) -> str:
    """Judged on the printed two decimals, so a 0.70 never reads 'NOT met' against 0.7."""
    return 'n/a' if ratio != ratio else ('met' if round(ratio, 2) <= goal else 'NOT met')


def print_table(args: argparse.Namespace, results: dict) -> None:
    medians = {system: {label: {c: statistics.median(v) for c, v in per.items()}
                        for label, per in settings.items()}
               for system, settings in results.items()}
    configs = [f'{k}x{m}' for k, m in args.config_list]
    print('\nmedian step (ms) per setting, over rounds (KxM):')
    for system, settings in medians.items():
        for label, per in settings.items():
            row = '  '.join(f'{c} {per[c]:5.0f}' if c in per else f'{c} failed'
                            for c in configs)
            print(f'  {system:7} {label:26} {row}')
    print('\n| config | ' + ' | '.join(f'{s} best (ms, setting)' for s in medians)
          + ' | tfpipe/torch | tfpipe/Lingvo |')
    print('| --- ' * (len(medians) + 3) + '|')
    for config in configs:
        cells = [best(medians[s], config) for s in medians]
        mine = cells[0][1]
        ratios = []
        for peer, goal in (('torch', GOAL_TORCH), ('lingvo', GOAL_LINGVO)):
            if peer not in medians:
                ratios.append('-')
                continue
            ratio = mine / best(medians[peer], config)[1]
            applies = peer == 'lingvo' or config in TORCH_GOAL_CONFIGS
            ratios.append(f'{ratio:.2f}' + (f' (goal <= {goal}: {verdict(ratio, goal)})'
                                             if applies else ''))
        k, m = config.split('x')
        print(f'| K={k} M={m} | ' + ' | '.join(f'{ms:.0f} ({label})' for label, ms in cells)
              + ' | ' + ' | '.join(ratios) + ' |')


def main(argv=None) -> None:
    args = parse_args(argv)
    pythons = {'tfpipe': sys.executable}
    try:
        for system in args.system_list:
            if system != 'tfpipe':
                pythons[system] = venv_python(args.venvs, system)
    except VenvError as e:
        sys.exit(f'peers_benchmark: {e}')
    runs = [(system, label) for system in args.system_list for label in SETTINGS[system]
            if not args.quick or label in QUICK_SETTINGS[system]]
    results = {system: {label: {} for s, label in runs if s == system}
               for system in args.system_list}
    print(f'{len(runs)} settings x {args.rounds} round(s), {args.warmup} warm-ups + '
          f'{args.steps} steps each, configs {args.configs}. The machine is shared (other '
          'work runs on it): absolute ms are inflated and noisy, the ratios measured side by '
          'side in this run are the result.', flush=True)
    for round_index in range(args.rounds):
        random.shuffle(runs)
        for system, label in runs:
            start = time.time()
            seen = worker_run(system, pythons[system], SETTINGS[system][label], args)
            for config, ms in seen.items():
                results[system][label].setdefault(config, []).append(ms)
            print(f'round {round_index + 1}: {system} {label}: '
                  + ', '.join(f'{c} {ms:.0f}' for c, ms in seen.items())
                  + f' ({time.time() - start:.0f} s, load {os.getloadavg()[0]:.1f})', flush=True)
    print_table(args, results)


if __name__ == '__main__':
    main()
