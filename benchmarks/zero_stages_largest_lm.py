"""The deepest Transformer LM that fits a per-device budget at R replicas x K cells, per ZeRO
stage (task.train.sharding): how much bigger a model each stage lets you train.

The model is table1_lm_benchmark's (lm.pystdlib.TransformerLM's body at a fixed width,
4 heads, hidden 4 x width, Adam, recompute='always', rows of 128 bytes), over K cells of
R replicas in one process (R x K logical CPUs), the global batch of 16 split over the
replicas, M micro-batches. The size searched is the number of blocks, on the *measured*
peak only: the trainer's real step (train_job.Trainer's tf.function, its third step) in a
child with the BFC allocator on and capped, whose host peak must stay within
R x K x budget. The R x K logical CPUs share one host allocator, so that host peak over
all devices is what can be measured here; on GPUs each device reports its own.

Columns: 'none', 'optimizer_states' (stage 1), 'gradients' (stage 2), 'weights' (stage 3,
weights gathered once a step and kept through the cell's micro-batches) and
'weights+regather' (stage 3 with task.train.regather_per_micro_batch: each task gathers its
cell's weights and frees them after).

What to expect (docs/optimizer_sharding.md): between steps a replica holds 16/R bytes per
parameter at stage 3, but at the step's peak a cell accumulates its micro-batches' gradient
sums whole until its last backward, and stage 3 holds its gathered weights whole through
the step (or, regathering, for one task at a time), so stages 2 and 3 gain over stage 1
only the reduced gradients' and the weights' parts, not the whole 16/R.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/zero_stages_largest_lm.py                  # R=4 K=2, 128 MiB
    PYTHONPATH=. python benchmarks/zero_stages_largest_lm.py --budget=1GiB    # patient
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the table1 siblings

from table1_benchmark import fits, mib, params_str, parse_bytes, search  # noqa: E402
from table1_lm_benchmark import measure_peak, run_child  # noqa: E402
from table1_tensor_parallel import lm_params  # noqa: E402

COLUMNS = ('none', 'optimizer_states', 'gradients', 'weights', 'weights+regather')


def stage_params(stage: str, replicas: int, k: int, blocks: int, width: int, m: int):
    """table1_lm_benchmark's LM of `blocks` blocks over K cells, R replicas, at `stage`
    ('weights+regather': stage 3 regathering per micro-batch)."""
    params = lm_params(width, 1, blocks, m, cells=k)
    params.task.pipeline.num_replicas = replicas
    sharding, _, regather = stage.partition('+')
    params.task.train.Set(sharding=sharding, regather_per_micro_batch=bool(regather))
    return params


def measure_in_process(stage: str, replicas: int, k: int, blocks: int, width: int,
                       m: int) -> dict:
    """The trainer's measured host peak at `blocks` (fewer blocks than cells do not fit),
    with the model's parameter count."""
    if blocks < k:
        return dict(params=0, oom=True)
    params = stage_params(stage, replicas, k, blocks, width, m)
    out = measure_peak(params)
    task = params.task.Instantiate()
    out['params'] = sum(v.shape.num_elements()
                        for v in task.VariablesByPath().values() if v.trainable)
    return out


def run_column(stage: str, args, start: int, walk: bool = False, log=print) -> dict:
    """The largest size at `stage`, each measured in a child: table1_benchmark.search, or
    with `walk` step_search from `start`."""
    devices = args.replicas * args.cells
    host_budget = devices * args.budget

    def probe(blocks: int) -> dict:
        t0 = time.perf_counter()
        r = run_child('measure', dict(stage=stage, replicas=args.replicas, k=args.cells,
                                      blocks=blocks, width=args.width, m=args.micro_batches),
                      devices, 2 * host_budget, script=__file__)
        log(f'  {stage:17s} {blocks:3d} blocks  '
            + ('out of memory' if r['oom'] else
               f"host peak {mib(r['peak'])} ({mib(r['peak'] / devices)} per device)")
            + f'  ({time.perf_counter() - t0:.0f} s)')
        return r

    if not walk:
        return search(probe, start, host_budget, args.resolution)
    return step_search(probe, start, host_budget)


def step_search(probe, start: int, budget: int) -> dict:
    """The largest size that fits, one block at a time from `start` (up while it fits, else
    down): a later stage's answer lies a few blocks from an earlier one's, where doubling
    first would trace a model twice the size (minutes at R x K devices here). The same
    report as table1_benchmark.search."""
    reports = {start: dict(probe(start), size=start)}
    step = 1 if fits(reports[start], budget) else -1
    size = start
    while True:
        size += step
        if size < 1:
            return dict(probes=len(reports))
        reports[size] = dict(probe(size), size=size)
        if fits(reports[size], budget) != (step == 1):
            break
    lo, hi = (size - 1, size) if step == 1 else (size, size + 1)
    return dict(reports[lo], probes=len(reports), first_miss=reports[hi])


def report(results: dict, args) -> list[str]:
    """One line per stage: blocks, parameters (and over 'none'), the measured host peak per
    device, the first size that did not fit."""
    devices = args.replicas * args.cells
    base = results.get('none', {}).get('params')
    lines = [f"{'stage':17s} {'blocks':>6s} {'params':>8s} {'x none':>6s}  "
             f"{'host peak / devices':20s} {'next (does not fit)':22s} {'step':>7s}"]
    for stage, r in results.items():
        if 'size' not in r:
            lines.append(f'{stage:17s} not even {args.cells} blocks fit {mib(args.budget)}')
            continue
        miss = r.get('first_miss', {})
        missed = ('out of memory' if miss.get('oom') else
                  mib(miss['peak'] / devices) if 'peak' in miss else '-')
        ratio = f"{r['params'] / base:.2f}" if base else '-'
        lines.append(f"{stage:17s} {r['size']:>6d} {params_str(r['params']):>8s} {ratio:>6s}  "
                     f"{mib(r['peak'] / devices):20s} "
                     f"{str(miss.get('size', '-')) + ': ' + missed:22s} {r['step_s']:6.2f}s")
    return lines


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--budget', type=parse_bytes, default=parse_bytes('128MiB'),
                    help='bytes per device; the host peak must fit R x K x budget')
    ap.add_argument('--replicas', type=int, default=4, help='R')
    ap.add_argument('--cells', type=int, default=2, help='K')
    ap.add_argument('--micro_batches', type=int, default=4,
                    help='M; a divisor of each replica\'s share of the batch of 16')
    ap.add_argument('--width', type=int, default=256, help='model width (4 heads)')
    ap.add_argument('--stages', default=','.join(COLUMNS),
                    help=f'comma-separated, of {", ".join(COLUMNS)}')
    ap.add_argument('--start', type=int, default=8,
                    help="the first column's first size (later ones walk from the last answer)")
    ap.add_argument('--walk', action='store_true',
                    help='the first column too walks one block at a time from --start')
    ap.add_argument('--resolution', type=float, default=0.0,
                    help='stop when the next size is within this fraction (0: exact)')
    args = ap.parse_args(argv)
    args.stages = [s for s in args.stages.split(',') if s]
    unknown = [s for s in args.stages if s not in COLUMNS]
    if unknown:
        ap.error(f'--stages: unknown {unknown}; use some of {list(COLUMNS)}')
    if args.replicas < 2 or 16 % (args.replicas * args.micro_batches):
        ap.error(f'--replicas={args.replicas} x --micro_batches={args.micro_batches}: R must '
                 'be at least 2 and R x M divide the batch of 16')
    return args


def main(args) -> int:
    t0 = time.perf_counter()
    print(f'Deepest TransformerLM body (width {args.width}, Adam, recompute, M='
          f'{args.micro_batches}) at R={args.replicas} x K={args.cells} whose measured host '
          f'peak fits {args.replicas * args.cells} x {mib(args.budget)}; load '
          f'{os.getloadavg()[0]:.1f}', flush=True)
    results: dict = {}
    for stage in args.stages:
        # A later stage's answer is a few blocks from the last one's: walk from there.
        known = [r['size'] for r in results.values() if 'size' in r]
        results[stage] = run_column(stage, args, known[-1] if known else args.start,
                                    walk=bool(known) or args.walk)
    print()
    print('\n'.join(report(results, args)))
    print(f'\n{time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f} at end')
    return 0


if __name__ == '__main__':
    if len(sys.argv) == 5 and sys.argv[1] == '--child':
        import tfpipe
        tfpipe.configure_logical_cpus(int(sys.argv[3]))
        print(json.dumps(measure_in_process(**json.loads(sys.argv[4]))), flush=True)
        sys.exit(0)
    sys.exit(main(parse_args()))
