"""GPipe's Table 1, Transformer column: the deepest Transformer LM whose fullest device fits
a per-device budget at K = 1, 2, 4, 8 cells (T=1) and at T=2 devices per cell.

The paper (Table 1, Transformer-L) keeps the width and grows the number of layers with K:
each cell holds its share of the blocks, so the parameters grow near-linearly with K. Here
the model is lm.pystdlib.TransformerLM's body (tfpipe.bodies.transformer_lm_body: byte
vocabulary, rows of 128 bytes, batch 16, tied softmax) at a fixed width (256, 4 heads,
hidden 4 x width), Adam, recompute='always', M = max(4, K) micro-batches (--micro_batches
fixes one M for every column); the blocks are spread evenly over the K cells (embedding
and positions on the first, the final LayerNorm and logits on the last). The size searched
is the number of blocks.

A size fits when two checks pass:
- predicted: every device's bytes of one step within the budget, by `--mode=inspect_model`'s
  per-device prediction (table1_tensor_parallel.predict_devices: weights, gradient sums,
  Adam's slots, held micro-batches, and each cell's backward working set measured by
  inspect_modes.working_sets). The search (table1_benchmark.search) runs on this, one child
  process per column with the BFC allocator on (the working sets need its statistics).
- measured: the trainer's real step (train_job.Trainer's step, on its own input) of that
  size, in a child with the BFC allocator on and capped (TF_CPU_BFC_MEM_LIMIT_IN_MB), peaks
  within K x T x budget; if not, one block fewer is measured. The K x T logical CPUs share
  one host allocator, so the host's peak over all devices is what can be measured here (it
  also holds what no device would: the input's buffers, Adam's update temporaries beside
  the state); on GPUs each device reports its own peak.

The default budget is 128 MiB per device, not the issue's 1 GiB: at 1 GiB, K=8 is an 8 GiB
model whose steps take minutes on 2 cores and whose tracing (8 cells x 8 micro-batches of
hundreds of blocks) takes longer; the shape of the table (parameters against K) is what
the benchmark shows. Pass --budget=1GiB on GPUs or for a patient run.

Run (from the repository root; the plot needs `pip install -e '.[plot]'`):
    PYTHONPATH=. python benchmarks/table1_lm_benchmark.py --plot=docs/table1_lm.png
    PYTHONPATH=. python benchmarks/table1_lm_benchmark.py --budget=1GiB --columns=1x1,2x1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

from table1_benchmark import MIB, mib, params_str, parse_bytes, search
from table1_tensor_parallel import HEADS, MODEL, lm_params, predict_devices

COLUMNS = ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2))  # (K, T)
PLOT_ERROR = "--plot needs matplotlib: pip install -e '.[plot]'"


def micro_batches(k: int, fixed: int = 0) -> int:
    """`fixed`, or M = max(4, K): every cell has work while the pipeline is full (batch 16)."""
    return fixed or max(4, k)


# --- Child processes (TensorFlow loads only there) ---------------------------------------------

def predict_blocks(k: int, t: int, blocks: int, width: int, m: int) -> dict:
    """The LM of `blocks` blocks at `width` over K cells of T devices: its parameters and
    its fullest device's predicted bytes ('peak'). Fewer blocks than cells do not fit."""
    from trainer.inspect_modes import profile_model, working_sets

    if blocks < k:
        return dict(params=0, oom=True, reason=f'{blocks} blocks cannot fill {k} cells')
    params = lm_params(width, t, blocks, m, cells=k)
    task = params.task.Instantiate()
    working, inputs, *_ = working_sets(params, task)  # every cell recomputes: none saved
    if working is None:
        raise RuntimeError('the working sets need the BFC allocator: run with '
                           'TF_CPU_ALLOCATOR_USE_BFC=true (run_child does)')
    devices = predict_devices(params, task, profile_model(params, task, m, timed=False),
                              working, inputs)
    fullest = max(devices, key=lambda d: d.total)
    return dict(params=sum(v.shape.num_elements()
                           for v in task.VariablesByPath().values() if v.trainable),
                peak=fullest.total, device=fullest.device.split('device:')[-1], oom=False,
                balance=list(task.pipe.balance))


def search_in_process(k: int, t: int, width: int, m: int, budget: int, start: int,
                      resolution: float) -> dict:
    """table1_benchmark.search over the blocks, on the prediction, in this process (K x T
    logical CPUs configured)."""
    return search(lambda blocks: predict_blocks(k, t, blocks, width, m), start, budget, resolution)


def measure_in_process(k: int, t: int, blocks: int, width: int, m: int) -> dict:
    """The host allocator's peak over the trainer's third step of the LM (measure_peak)."""
    return measure_peak(lm_params(width, t, blocks, m, cells=k))


def measure_peak(params) -> dict:
    """The host allocator's peak over the trainer's third step (the first traces) of
    `params`; the environment switched BFC on. The input's shuffle buffer (about 10 MiB of
    documents, host memory no accelerator would hold) is off."""
    import tensorflow as tf
    from trainer import runtime_options, train_job

    params.input.train.shuffle_buffer = 0
    with tempfile.TemporaryDirectory() as train_dir:
        trainer = train_job.Trainer(params, train_dir, runtime_options.RuntimeOptions())
        out = dict(oom=False)
        try:
            for _ in range(2):
                trainer._step(next(trainer.iterator))  # the trainer's own tf.function
            batch = next(trainer.iterator)
            tf.config.experimental.reset_memory_stats('CPU:0')
            start = time.perf_counter()
            loss = float(trainer._step(batch)[0].numpy())
            out.update(step_s=time.perf_counter() - start, loss=loss,
                       peak=tf.config.experimental.get_memory_info('CPU:0')['peak'])
        except tf.errors.ResourceExhaustedError:
            out['oom'] = True
    return out


def run_child(task: str, args: dict, devices: int, cap_bytes: int = 0,
              timeout: float = 3600, script: str = __file__) -> dict:
    """`task` ('search', 'predict' or 'measure') with `args` in a child of `devices` logical CPUs
    (`script --child task devices args`, this file's by default); with `cap_bytes`, the BFC
    allocator on and capped there."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    env['PYTHONPATH'] = os.pathsep.join([repo, os.path.dirname(os.path.abspath(__file__))]
                                        + [p for p in [env.get('PYTHONPATH')] if p])
    if cap_bytes:
        env.update(TF_CPU_ALLOCATOR_USE_BFC='true',
                   TF_CPU_BFC_MEM_LIMIT_IN_MB=str(max(1, cap_bytes // MIB)))
    cmd = [sys.executable, os.path.abspath(script), '--child', task, str(devices),
           json.dumps(args)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=repo)
    lines = [line for line in res.stdout.splitlines() if line.startswith('{')]
    if res.returncode != 0 or not lines:
        tail = res.stderr.strip().splitlines()[-1:] or [f'exit code {res.returncode}']
        raise RuntimeError(f'{task} {args}: {tail[0]}')
    return json.loads(lines[-1])


# --- The table (parent process) ------------------------------------------------------------

def run_column(k: int, t: int, args, start: int, log=print) -> dict:
    """The search's answer for (K, T) on the prediction, then its measured host peak: while
    that exceeds K x T x budget, one block fewer (measured again)."""
    devices, host_budget = k * t, k * t * args.budget
    m = micro_batches(k, args.micro_batches)
    # Measuring the working sets of sizes up to twice the budget needs room; the cap keeps
    # an oversized one from exhausting the shared machine.
    found = run_child('search', dict(k=k, t=t, width=args.width, m=m, budget=args.budget,
                                     start=start, resolution=args.resolution),
                      devices, 4 * host_budget)
    found['measured_misses'] = []
    while 'size' in found:
        measured = run_child('measure', dict(k=k, t=t, blocks=found['size'],
                                             width=args.width, m=m), devices, 2 * host_budget)
        if not measured['oom'] and measured['peak'] <= host_budget:
            found['measured'] = measured
            break
        log(f"  {column_name(k, t)}: {found['size']} blocks measured "
            + ('out of memory' if measured['oom'] else mib(measured['peak']))
            + f' > {devices} x {mib(args.budget)}: one block fewer')
        found['measured_misses'].append(dict(measured, size=found['size']))
        if found['size'] <= k:
            found.pop('size')
            break
        fewer = found['size'] - 1
        found.update(run_child('predict', dict(k=k, t=t, blocks=fewer, width=args.width, m=m),
                               devices, 4 * host_budget), size=fewer)
    return found


def column_name(k: int, t: int) -> str:
    return f'K={k}' + (f' T={t}' if t > 1 else '')


def report(results: dict, budget: int) -> list[str]:
    """One line per column: blocks, parameters (and over K=1's), the fullest device's
    prediction, the next size's, and the measured host peak over the devices."""
    base = results.get((1, 1), {}).get('params')
    lines = [f"{'column':9s} {'blocks':>6s} {'params':>8s} {'x K=1':>6s}  "
             f"{'fullest device, predicted':27s} {'next (does not fit)':20s} "
             f"{'host peak measured / devices':30s}"]
    for (k, t), r in results.items():
        if 'size' not in r:
            lines.append(f'{column_name(k, t):9s} not even {k} blocks fit {mib(budget)}')
            continue
        miss, meas = r['first_miss'], r['measured']
        ratio = f"{r['params'] / base:.2f}" if base else '-'
        measured = ('out of memory' if meas['oom'] else
                    f"{mib(meas['peak'])} / {k * t} = {mib(meas['peak'] / (k * t))} "
                    + ('fits' if meas['peak'] <= k * t * budget else 'OVER'))
        lines.append(f"{column_name(k, t):9s} {r['size']:>6d} {params_str(r['params']):>8s} "
                     f"{ratio:>6s}  {r['device'] + ' ' + mib(r['peak']):27s} "
                     f"{str(miss['size']) + ': ' + (mib(miss['peak']) if 'peak' in miss else 'none'):20s} "
                     f"{measured}")
    return lines


def plot(results: dict, path: str, budget: int) -> None:
    """Parameters against K (T=1 and T=2 columns), with the ideal K x K=1 line, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(PLOT_ERROR) from None
    matplotlib.use('Agg')  # no display: a file
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=100)
    base = results.get((1, 1), {}).get('params')
    for t, marker in ((1, 'o'), (2, 's')):
        points = sorted((k, r['params'] / 1e6) for (k, tt), r in results.items()
                        if tt == t and 'size' in r)
        if points:
            ax.plot(*zip(*points), marker=marker, label=f'T={t} (largest that fits)')
            for k, p in points:
                ax.annotate(f"{results[(k, t)]['size']} blocks", (k, p), fontsize=7,
                            textcoords='offset points', xytext=(4, -10))
    ks = sorted({k for k, _ in results})
    if base:
        ax.plot(ks, [k * base / 1e6 for k in ks], '--', color='gray', label='K x (K=1)')
    ax.set_xscale('log', base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel('K (pipeline cells)')
    ax.set_ylabel('parameters (millions)')
    ax.set_title(f'Transformer LM that fits {mib(budget)} per device', fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_columns(text: str) -> list[tuple[int, int]]:
    """'1x1,2x1' -> [(1, 1), (2, 1)]: K x T per column."""
    try:
        out = [tuple(int(n) for n in c.split('x')) for c in text.split(',') if c.strip()]
    except ValueError:
        out = []
    if not out or any(len(c) != 2 or min(c) < 1 for c in out):
        raise argparse.ArgumentTypeError(
            f'--columns {text!r}: write K x T pairs, e.g. 1x1,2x1,4x1,8x1,1x2')
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--budget', type=parse_bytes, default=parse_bytes('128MiB'),
                    help='bytes per device: the prediction of the fullest device must fit it')
    ap.add_argument('--width', type=int, default=256, help=f'model width ({HEADS} heads)')
    ap.add_argument('--columns', type=parse_columns,
                    default=list(COLUMNS), help='K x T pairs, e.g. 1x1,2x1,4x1,8x1,1x2,2x2')
    ap.add_argument('--micro_batches', type=int, default=0,
                    help='M for every column (0: max(4, K)); a divisor of the batch, 16')
    ap.add_argument('--start', type=int, default=4, help="K=1's first size probed (blocks)")
    ap.add_argument('--resolution', type=float, default=0.0,
                    help='stop when the next size is within this fraction (0: exact)')
    ap.add_argument('--plot', default='', help='write a PNG of parameters against K here')
    args = ap.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before a run of minutes)
        except ImportError:
            ap.error(PLOT_ERROR)
    return args


def main(args) -> int:
    t0, load = time.perf_counter(), os.getloadavg()[0]
    print(f'Table 1, Transformer column: deepest {MODEL} body (width {args.width}, {HEADS} '
          f'heads, hidden {4 * args.width}, Adam, recompute, '
          f"M={args.micro_batches or 'max(4, K)'}) whose fullest "
          f"device's predicted step fits {mib(args.budget)}; load {load:.1f}", flush=True)
    results: dict = {}
    for k, t in args.columns:
        start_time = time.perf_counter()
        known = [r['size'] * k // kk for (kk, _), r in results.items() if 'size' in r]
        start = max(known + [k]) if known else max(k, args.start)
        results[(k, t)] = run_column(k, t, args, start)
        print('\n'.join(report({(k, t): results[(k, t)]}, args.budget)[1:])
              + f'  ({results[(k, t)]["probes"]} sizes, '
                f'{time.perf_counter() - start_time:.0f} s)', flush=True)
    print()
    for line in report(results, args.budget):
        print(line)
    if args.plot:
        plot(results, args.plot, args.budget)
        print(f'wrote {args.plot}')
    print(f'\n{time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f} at end')
    return 0


if __name__ == '__main__':
    if len(sys.argv) == 5 and sys.argv[1] == '--child':
        import tfpipe
        tfpipe.configure_logical_cpus(int(sys.argv[3]))
        run = {'search': search_in_process, 'predict': predict_blocks,
               'measure': measure_in_process}[sys.argv[2]]
        print(json.dumps(run(**json.loads(sys.argv[4]))), flush=True)
        sys.exit(0)
    sys.exit(main(parse_args()))
