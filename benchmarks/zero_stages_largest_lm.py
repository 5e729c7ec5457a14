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

Run (from the repository root; the 1 GiB figure took 51 minutes here):
    PYTHONPATH=. python benchmarks/zero_stages_largest_lm.py                  # R=4 K=2, 128 MiB
    PYTHONPATH=. python benchmarks/zero_stages_largest_lm.py --budget=1GiB --width=1024 \\
        --walk --start=9
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
    """The largest size that fits, near `start`: a later stage's answer lies a few blocks
    from an earlier one's, where doubling first would trace a model twice the size
    (minutes at R x K devices here). Probes `start` and the next size toward the budget,
    then where the line through the last fitting and missing (or two fitting) peaks meets
    the budget, at most half the known size away (measured peaks are noisy: one block
    moved a host peak by 14 MiB once and 190 MiB another time), always strictly inside a
    bracket once there is one. The same report as table1_benchmark.search."""
    reports: dict[int, dict] = {}

    def fit(size: int) -> bool:
        if size not in reports:
            reports[size] = dict(probe(size), size=size)
        return fits(reports[size], budget)

    def line(a: int, b: int) -> int:  # where the line through a's and b's peaks meets budget
        pa, pb = reports[a].get('peak'), reports[b].get('peak')
        if pa is None or pb is None or pa == pb:
            return (a + b) // 2 if max(a, b) - min(a, b) > 1 else max(a, b) + 1
        return int(a + (budget - pa) * (b - a) / (pb - pa))

    lo = hi = None
    if fit(start):
        lo = start
    else:
        hi = start
    size = start + (1 if lo else -1)
    while True:
        if size < 1:
            return dict(probes=len(reports))
        if fit(size):
            lo = max(lo or size, size)
        else:
            hi = min(hi or size, size)
        if lo is not None and hi is not None and hi == lo + 1:
            return dict(reports[lo], probes=len(reports), first_miss=reports[hi])
        if lo is not None and hi is not None:  # bracketed: inside it
            guess = line(lo, hi)
            size = min(max(guess, lo + 1), hi - 1)
        elif lo is not None:  # everything fits so far: up, at most by half
            known = [n for n in sorted(reports) if 'peak' in reports[n]]
            guess = line(known[-2], known[-1]) if len(known) > 1 else lo + 1
            size = min(max(guess, lo + 1), lo + max(1, lo // 2))
        else:  # nothing fits yet: down, at most by half
            smallest = min(reports)
            size = max(smallest // 2, min(smallest - 1, line(smallest, smallest + 1)
                                          if smallest + 1 in reports else smallest - 1))


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
