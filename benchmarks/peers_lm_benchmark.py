"""tfpipe against torch.distributed.pipelining on a GPT-2-small-shaped LM, side by side.

Issue 39's comparison at the size tfpipe exists for: lm.pystdlib.GPT2SmallShapedLM
(85M parameters: 12 blocks of width 768, rows of 256 bytes, batch 8; benchmarks/peers/
lm_shape.py) at K=4 cells, M=4 micro-batches, recompute always, Adam, median step after
warm-ups. tfpipe runs the registered model's task and the trainer's update
(benchmarks/peers/tfpipe_lm.py); torch the same shapes as torch's docs run a pipeline,
one process per stage over gloo with ScheduleGPipe (benchmarks/peers/torch_lm.py).
Goal: tfpipe <= 0.8x torch's step.

The harness is peers_benchmark.py's (its venvs, its workers' timing in steps.py): each
setting a fresh process, every setting once per round in a new random order, each
setting's median over rounds, each system at its best setting. A step computes about
1.1 TFLOP, so on 2 cores a round takes several minutes.

Run (from the repository root):
    python benchmarks/peers_lm_benchmark.py                     # 3 rounds at K=4 M=4
    python benchmarks/peers_lm_benchmark.py --configs=4x4,2x4 --rounds=1
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from peers_benchmark import (DEFAULT_VENVS, VenvError, best, parse_configs, venv_python,
                             verdict, worker_run)

GOAL = 0.8
SETTINGS = {'tfpipe': {'onednn=1 threads=default': ('1', 'default'),
                       'onednn=0 threads=default': ('0', 'default')},
            'torch': {'threads=1': (None, '1'), 'threads=2': (None, '2')}}
BATCH, BLOCKS = 8, 12  # benchmarks/peers/lm_shape.py


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--configs', default='4x4', help='KxM, comma-separated')
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--warmup', type=int, default=1)
    ap.add_argument('--steps', type=int, default=3)
    ap.add_argument('--venvs', default=DEFAULT_VENVS,
                    help="where the peers' venvs are made once and reused")
    args = ap.parse_args(argv)
    args.config_list = parse_configs(ap, args.configs)
    for cells, micro in args.config_list:
        if not 2 <= cells <= min(BLOCKS, 8) or micro < 1 or BATCH % micro:
            ap.error(f'--configs: {cells}x{micro} needs 2 <= K <= 8 (one logical CPU or '
                     f'process per cell) and M dividing the batch {BATCH}, e.g. 4x4')
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        ap.error('--rounds and --steps must be >= 1, --warmup >= 0')
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        pythons = {'tfpipe': sys.executable, 'torch': venv_python(args.venvs, 'torch')}
    except VenvError as e:
        sys.exit(f'peers_lm_benchmark: {e}')
    runs = [(system, label) for system in SETTINGS for label in SETTINGS[system]]
    results = {system: {label: {} for label in SETTINGS[system]} for system in SETTINGS}
    print(f'{len(runs)} settings x {args.rounds} round(s), {args.warmup} warm-up(s) + '
          f'{args.steps} steps each, configs {args.configs}; load average '
          f'{os.getloadavg()[0]:.1f}. The ratios measured side by side are the result.',
          flush=True)
    for round_index in range(args.rounds):
        random.shuffle(runs)
        for system, label in runs:
            start = time.time()
            seen = worker_run(system, pythons[system], SETTINGS[system][label], args, 'lm')
            for config, ms in seen.items():
                results[system][label].setdefault(config, []).append(ms)
            print(f'round {round_index + 1}: {system} {label}: '
                  + ', '.join(f'{c} {ms / 1000:.2f} s' for c, ms in seen.items())
                  + f' ({time.time() - start:.0f} s, load {os.getloadavg()[0]:.1f})', flush=True)
    medians = {system: {label: {c: statistics.median(v) for c, v in per.items()}
                        for label, per in settings.items()}
               for system, settings in results.items()}
    print('\n| config | tfpipe best (s, setting) | torch best (s, setting) | tfpipe/torch |')
    print('| --- | --- | --- | --- |')
    for cells, micro in args.config_list:
        config = f'{cells}x{micro}'
        (mine_label, mine), (peer_label, peer) = (best(medians[s], config) for s in SETTINGS)
        ratio = mine / peer
        print(f'| K={cells} M={micro} | {mine / 1000:.2f} ({mine_label}) | '
              f'{peer / 1000:.2f} ({peer_label}) | {ratio:.2f} (goal <= {GOAL}: '
              f'{verdict(ratio, GOAL)}) |')


if __name__ == '__main__':
    main()
