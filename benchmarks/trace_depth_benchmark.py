"""tfpipe trace-depth benchmark: how the trainer's first-step overheads grow with depth.

Issue 39 asks that tracing a GPT-2-sized LM grow no faster than its number of blocks:
24 blocks within 2.2x of 12. This script builds the trainer's own step function
(train_job.Trainer, as `trace_cost_benchmark.py` does) for GPT2SmallShapedLM's shape
(width 768, 12 heads, feed-forward 3072, rows of 256 bytes, batch 8, K=4, M=4, recompute
always) at 12 and at 24 blocks (cells of 3 and of 6 blocks), each in a fresh process,
and times:

  trace  get_concrete_function(): Python building every op of the step (the cell
         functions' forward and backward, the recompute, the update);
  ops    the ops of the traced step (its graph and every function in its library);
  first  with --first, the first call less the second: grappler, placement, executor
         creation (the step's own compute taken out). A step of the 12-block model
         computes for about 25 s on 2 cores here, so --first takes minutes.

Rounds alternate the two depths; figures are medians with the ratio 24/12 beside the
goal (2.2x). The widths are GPT-2 small's, so the 24-block model holds 170M parameters
(about 2.7 GB with Adam's slots) while it traces.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/trace_depth_benchmark.py            # ~3 minutes
    PYTHONPATH=. python benchmarks/trace_depth_benchmark.py --first    # ~10 minutes
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPTHS = {12: [5, 3, 3, 6], 24: [8, 6, 6, 9]}  # blocks: balance (embedding, position, head)
GOAL = 2.2


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rounds', type=int, default=2)
    ap.add_argument('--first', action='store_true',
                    help='also time the first call less the second (runs two steps)')
    ap.add_argument('--measure', type=int, default=None, help='internal: a depth')
    return ap.parse_args(argv)


def measure(blocks: int, first: bool) -> None:
    """One JSON line: the trace's seconds and ops (and the first call's overhead) of the
    trainer's step for GPT2SmallShapedLM's shape at `blocks` blocks."""
    import tfpipe
    tfpipe.configure_logical_cpus(8)  # the trainer's --num_logical_cpus default
    from benchmarks.trace_cost_benchmark import step_costs
    from params.lm.pystdlib import GPT2SmallShapedLM

    class Deep(GPT2SmallShapedLM):
        SIZES = (768, 3072, 12, blocks)
        BALANCE = DEPTHS[blocks]

    costs = step_costs(Deep().Model(), calls=2 if first else 0)
    out = dict(ops=costs['ops'], trace=costs['trace'])
    if first:
        out['first'] = costs['calls'][0] - costs['calls'][1]
    print(json.dumps(out), flush=True)


def run_measure(blocks: int, first: bool) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
               PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
    command = [sys.executable, os.path.abspath(__file__), f'--measure={blocks}']
    out = subprocess.run(command + (['--first'] if first else []), cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f'measuring {blocks} blocks: {out.stderr[-3000:]}')
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.measure:
        measure(args.measure, args.first)
        return
    results = {blocks: [] for blocks in DEPTHS}
    for r in range(args.rounds):
        for blocks in (list(DEPTHS) if r % 2 == 0 else list(DEPTHS)[::-1]):
            results[blocks].append(run_measure(blocks, args.first))
            print(f'round {r} {blocks} blocks: {results[blocks][-1]}', flush=True)
    print(f'\nGPT2SmallShapedLM shape, K=4 M=4, medians over {args.rounds} rounds '
          f'(12 blocks, 24 blocks, 24/12; goal <= {GOAL}x)')
    for what, key in (('ops in the traced step', 'ops'), ('tracing the step (s)', 'trace'),
                      ('first call less second (s)', 'first')):
        if key not in results[12][0]:
            continue
        a, b = (statistics.median(x[key] for x in results[n]) for n in (12, 24))
        print(f'  {what:28s}{a:10.2f} {b:10.2f} {b / a:6.2f}x')


if __name__ == '__main__':
    main()
