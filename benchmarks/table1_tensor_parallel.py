"""Table 1's tensor-parallel column: the widest Transformer LM whose fullest device fits a
per-device budget at T = 1, 2 and 4 devices per cell.

GPipe's Table 1 (benchmarks/table1_benchmark.py) asks how large a model fits one
device's memory; tensor parallelism answers by splitting every block's weights over
the T devices of a cell. The model is lm.pystdlib.TransformerLM (byte vocabulary,
4 heads, hidden = 4 x width, tied softmax) as one cell (K=1) at M micro-batches with
recompute, its width the size searched (width = 4 x size: every T in 1, 2, 4
divides the 4 heads).

The bytes are `--mode=inspect_model`'s prediction per device
(tfpipe.tuning.tensor_parallel_memory.predict: weights, gradient sums, Adam's slots
and activations from the layers profiled at T=1 and the shares the built pipeline
puts on each device), not a measurement: logical CPUs share one allocator, so a
shard device's own peak cannot be read here, and the prediction of the state is
exact (tests/test_tensor_parallel.py). Each width is profiled and built at every
T in one subprocess (TensorFlow never loads in the parent); the search per T is
table1_benchmark.search.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/table1_tensor_parallel.py             # 32 MiB per device
    PYTHONPATH=. python benchmarks/table1_tensor_parallel.py --budget=64MiB
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional

from table1_benchmark import mib, params_str, parse_bytes, search

DEGREES = (1, 2, 4)
HEADS = 4
MODEL = 'lm.pystdlib.TransformerLM'


def lm_params(width: int, t: int, blocks: int, micro_batches: int, cells: int = 1):
    """MODEL at `width` (hidden 4 x width, HEADS heads, `blocks` blocks) as `cells` cells of
    T devices each, recomputing, at `micro_batches` micro-batches. The blocks are spread
    evenly over the cells; the layers before them (embedding, positions) join the first
    cell, those after (unpack, final LayerNorm, logits) the last."""
    from tfpipe import inputs
    from tfpipe.bodies import transformer_lm_body
    from tfpipe.pipeline.partition import even_balance
    from trainer.experiment import load_params

    params = load_params(MODEL)
    length = params.input.train.max_length
    body = transformer_lm_body(inputs.BYTE_VOCAB_SIZE, length, width, 4 * width, HEADS, blocks)
    balance = even_balance(blocks, cells)
    balance[0] += 2  # embedding, position
    balance[-1] += len(body) - blocks - 2
    params.task.pipeline.Set(body=body, balance=balance, num_micro_batches=micro_batches,
                             recompute='always', tensor_parallel=t)
    return params


def predict_devices(params, task, profiles, working=None, inputs=None) -> list:
    """Every device's predicted bytes of one step (memory_model.DeviceMemory, shard devices
    included) of the built `task`, from its T=1 layer `profiles`: inspect_model's
    prediction, with the cells' measured `working` sets and `inputs`
    (inspect_modes.working_sets) or, if None, the working sets estimated from the layer
    outputs."""
    from tfpipe.pipeline.partition import cell_ranges
    from tfpipe.tuning import memory_model, tensor_parallel_memory

    pipe = task.pipe
    cells = [memory_model.CellLayout(cell.device, start, stop, cell.recompute)
             for cell, (start, stop) in zip(pipe.replica_cells[0], cell_ranges(pipe.balance))]
    micro = params.input.train.batch_size / pipe.params.num_micro_batches
    prediction = tensor_parallel_memory.predict(pipe, profiles, [cells], micro, 1, working,
                                                inputs, params.task.train.optimizer)
    return [d for replica in prediction.devices for d in replica]


def predict_width(size: int, blocks: int, micro_batches: int) -> dict:
    """{T: report} of the LM at width 4 x size: its parameters, the fullest device's
    predicted bytes ('peak') and that device's state ('resident'). Needs max(DEGREES)
    logical CPUs configured before TensorFlow starts."""
    import dataclasses

    from trainer.inspect_modes import profile_model

    profiles, out = None, {}
    for t in DEGREES:
        params = lm_params(HEADS * size, t, blocks, micro_batches)
        task = params.task.Instantiate()
        if profiles is None:  # measured at T=1 whatever T is: one profile per width
            profiles = profile_model(params, task, micro_batches)
        devices = predict_devices(params, task, profiles)
        fullest = max(devices, key=lambda d: d.total)
        out[t] = dict(params=sum(v.shape.num_elements()
                                 for v in task.VariablesByPath().values() if v.trainable),
                      peak=fullest.total, resident=fullest.weights + fullest.slots,
                      device=fullest.device.split('device:')[-1], oom=False,
                      devices={d.device: dataclasses.asdict(d) for d in devices})
    return out


def run_width(size: int, blocks: int, micro_batches: int, timeout: float = 600) -> dict:
    """predict_width in its own process (DEGREES logical CPUs)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    env['PYTHONPATH'] = os.pathsep.join([repo] + [p for p in [env.get('PYTHONPATH')] if p])
    cmd = [sys.executable, os.path.abspath(__file__), '--probe',
           json.dumps(dict(size=size, blocks=blocks, micro_batches=micro_batches))]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=repo)
    lines = [line for line in res.stdout.splitlines() if line.startswith('{')]
    if res.returncode != 0 or not lines:
        tail = res.stderr.strip().splitlines()[-1:] or [f'exit code {res.returncode}']
        raise RuntimeError(f'width {HEADS * size}: {tail[0]}')
    return {int(t): r for t, r in json.loads(lines[-1]).items()}


def search_column(probe_width, start: int, budget: int, resolution: float) -> dict:
    """{T: table1_benchmark.search's result} with `probe_width(size) -> {T: report}`,
    each width probed once for every T."""
    cache: dict[int, dict] = {}

    def widths(size: int) -> dict:
        if size not in cache:
            cache[size] = probe_width(size)
        return cache[size]

    out = {}
    for t in DEGREES:
        out[t] = search(lambda size, t=t: widths(size)[t], start, budget, resolution)
        start = out[t].get('size', start)  # a larger T fits at least as wide a model
    out['widths_probed'] = len(cache)
    return out


def report(results: dict, budget: int) -> list[str]:
    lines = [f"{'T':>2s}  {'widest':>7s}  {'params':>8s}  {'fullest device':16s}  "
             f"{'predicted':>9s}  {'next width (does not fit)':26s}"]
    base = results[DEGREES[0]]
    for t in DEGREES:
        r = results[t]
        if 'size' not in r:
            lines.append(f'{t:>2d}  width {HEADS} does not fit {mib(budget)}')
            continue
        miss = r['first_miss']
        ratio = f"  {r['params'] / base['params']:.2f}x T=1's parameters" if 'size' in base else ''
        lines.append(f"{t:>2d}  {HEADS * r['size']:>7d}  {params_str(r['params']):>8s}  "
                     f"{r['device']:16s}  {mib(r['peak']):>9s}  "
                     f"{HEADS * miss['size']:>5d}: {mib(miss['peak']):>9s}{'':10s}{ratio}")
    return lines


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--budget', type=parse_bytes, default=parse_bytes('32MiB'),
                    help='predicted bytes allowed on the fullest device')
    ap.add_argument('--blocks', type=int, default=4, help='Transformer blocks')
    ap.add_argument('--micro_batches', type=int, default=4)
    ap.add_argument('--start', type=int, default=32, help='first size probed (width / 4)')
    ap.add_argument('--resolution', type=float, default=0.1)
    return ap.parse_args(argv)


def main(args) -> int:
    t0, load = time.perf_counter(), os.getloadavg()[0]
    print(f'Table 1, tensor-parallel column: widest {MODEL} (4 x width hidden, {HEADS} heads, '
          f'{args.blocks} blocks, K=1, M={args.micro_batches}, recompute, Adam) whose fullest '
          f"device's predicted step fits {mib(args.budget)}; load {load:.1f}", flush=True)

    def probe_width(size: int) -> dict:
        start = time.perf_counter()
        out = run_width(size, args.blocks, args.micro_batches)
        print(f'  width {HEADS * size:5d}: ' + '  '.join(
            f"T={t} {mib(r['peak'])} on {r['device']}" for t, r in out.items())
            + f' ({time.perf_counter() - start:.0f} s)', flush=True)
        return out

    results = search_column(probe_width, args.start, args.budget, args.resolution)
    print()
    for line in report(results, args.budget):
        print(line)
    print(f"\n{results['widths_probed']} widths probed, {time.perf_counter() - t0:.0f} s, "
          f'load {os.getloadavg()[0]:.1f} at end')
    return 0


if __name__ == '__main__':
    if len(sys.argv) == 3 and sys.argv[1] == '--probe':
        import tfpipe
        tfpipe.configure_logical_cpus(max(DEGREES))
        print(json.dumps(predict_width(**json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    sys.exit(main(parse_args()))
