"""GPipe's Table 1, measured: the largest model whose training step fits a peak budget.

Two configurations on one device (K=1), as in the paper's first two columns, and a third:

  naive       M=1, recompute='never'   (the model without GPipe)
  Pipeline-1  M=8, recompute='always'  (GPipe on one accelerator)
  R=2 sharded Pipeline-1 on each of 2 data-parallel replicas (one device each, the same
              batch per replica) with task.train.shard_optimizer_states: each device keeps
              half of the optimizer slots. Its size is the model per device; its peak is
              the allocator's (shared by the logical CPUs) divided by R.

The tensor-parallel column (the widest Transformer LM per device budget at T = 1, 2, 4
devices per cell, predicted) is benchmarks/table1_tensor_parallel.py.

Each probe (one model size, one configuration) runs in its own subprocess with the BFC
allocator on (TF_CPU_ALLOCATOR_USE_BFC=true, the only CPU allocator that keeps peak
statistics), builds the model with tfpipe.PipeliningLayer, runs the trainer's real step
(ForwardBackward + trainer.guarded_update with an optimizer), and reports the peak
bytes of the second step (after a warm-up step that traces), read with
tf.config.experimental.get_memory_info. A probe fits when that peak is within the budget;
an out-of-memory error counts as "does not fit" (the allocator is capped at a multiple of
the budget, TF_CPU_BFC_MEM_LIMIT_IN_MB, so an oversized probe cannot exhaust the shared
machine). The size (AmoebaNet filters, or Dense layers) is searched per configuration by
doubling, then by narrowing the bracket with interpolated bisection (see `search`).

Run (from the repository root):
    PYTHONPATH=. python benchmarks/table1_benchmark.py                  # full, 256 MiB
    PYTHONPATH=. python benchmarks/table1_benchmark.py --quick          # 128 MiB smoke run
    PYTHONPATH=. python benchmarks/table1_benchmark.py --budget=1GiB --models=amoebanet
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Optional

MIB = 1024 ** 2
GIB = 1024 ** 3
CONFIGS = {'naive': dict(num_micro_batches=1, recompute='never'),
           'pipeline1': dict(num_micro_batches=8, recompute='always'),
           'r2_sharded': dict(num_micro_batches=8, recompute='always', num_replicas=2)}
SHARDED = {'r2_sharded'}  # configurations whose optimizer slots are sharded over replicas
CONFIG_NAMES = {'naive': 'naive (M=1, no recompute)',
                'pipeline1': 'Pipeline-1 (K=1, M=8, recompute)',
                'r2_sharded': 'R=2 x Pipeline-1, sharded slots'}
# GPipe (arXiv 1811.06965) Table 1, AmoebaNet-D on one 8 GB accelerator.
PAPER = {'naive': ('(L=18, D=208)', 82e6), 'pipeline1': ('(L=18, D=416)', 318e6)}
GOAL = 3.9  # Pipeline-1 / naive in parameters, AmoebaNet (the paper's 318M / 82M)
OPTIMIZERS = ('sgd', 'momentum', 'rmsprop', 'adam')
LEARNING_RATE = 1e-4
# How a capped allocator's failure ends a child that did not raise ResourceExhaustedError:
# oneDNN kernels abort on a null allocation (mkl_util.h: "'tensor' Must be non NULL").
OOM_MARKERS = ('ResourceExhausted', "'tensor' Must be non NULL", 'std::bad_alloc')

# Sizes per mode. AmoebaNet is scaled by filters (the paper's D) at a fixed number of cells;
# the Dense stack by its number of layers.
# AmoebaNet's image and batch put its naive answer near the paper's split of the peak
# (activations 6.26 GB : parameter memory 1.05 GB, about 6:1); the Dense stack is the
# brief's Dense(512) at batch 4096. A Pipeline-1 probe of AmoebaNet traces 8 micro-batches'
# forward, recompute and backward (about 17k graph nodes for 5 cells), which is most of a
# probe's time here: that, not memory, sets the default budget of the full run.
PRESETS = {
    'full': dict(budget='256MiB', amoeba_cells_per_stage=1, amoeba_stages=3, amoeba_image=28,
                 amoeba_batch=16, amoeba_start=64, dense_width=512, dense_batch=4096,
                 dense_start=8, resolution=0.1, probe_timeout=900),
    'quick': dict(budget='128MiB', amoeba_cells_per_stage=1, amoeba_stages=1, amoeba_image=16,
                  amoeba_batch=16, amoeba_start=192, dense_width=512, dense_batch=2048,
                  dense_start=8, resolution=0.5, probe_timeout=300),
}


@dataclasses.dataclass(frozen=True)
class ProbeSpec:
    """One model size in one configuration: everything the child process needs."""
    model: str          # 'amoebanet' (size = filters) or 'dense' (size = layers)
    size: int
    config: str         # a key of CONFIGS
    batch: int
    width: int = 0      # dense: layer width; amoebanet: image height and width
    cells_per_stage: int = 1
    num_stages: int = 3
    optimizer: str = 'rmsprop'
    cap_bytes: int = 4 * GIB


def parse_bytes(text: str) -> int:
    """'1GiB', '128MiB', '1.5GiB' or a plain number of bytes."""
    m = re.fullmatch(r'\s*([0-9.]+)\s*(GiB|MiB|KiB|B)?\s*', text)
    if not m:
        raise argparse.ArgumentTypeError(
            f'budget {text!r} is not a size: write e.g. 1GiB, 128MiB or a number of bytes')
    scale = {'GiB': GIB, 'MiB': MIB, 'KiB': 1024, 'B': 1, None: 1}[m.group(2)]
    return int(float(m.group(1)) * scale)


# --- The probe (child process) -----------------------------------------------------------------

def _build(spec: ProbeSpec):
    """Model, inputs, targets and per-example loss of one probe (TensorFlow loaded)."""
    import tensorflow as tf
    import tfpipe
    from tfpipe import layers
    from tfpipe.bodies import amoebanet_body

    if spec.model == 'amoebanet':
        body = amoebanet_body(10, filters=spec.size, cells_per_stage=spec.cells_per_stage,
                              num_stages=spec.num_stages)
        x = tf.random.stateless_normal([spec.batch, spec.width, spec.width, 3], seed=[1, 2])
        t = tf.random.stateless_uniform([spec.batch], [3, 4], maxval=10, dtype=tf.int32)

        def loss_fn(logits, labels):
            return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    elif spec.model == 'dense':
        body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=spec.width,
                                          output_dim=spec.width, activation='relu')
                for i in range(spec.size)]
        x = tf.random.stateless_normal([spec.batch, spec.width], seed=[1, 2])
        t = tf.random.stateless_normal([spec.batch, spec.width], seed=[3, 4])

        def loss_fn(outputs, targets):
            return tf.reduce_mean(tf.square(outputs - targets), axis=-1)
    else:
        raise ValueError(f"model {spec.model!r} is unknown: use 'amoebanet' or 'dense'")
    num_replicas = CONFIGS[spec.config].get('num_replicas', 1)
    x, t = (tf.concat([v] * num_replicas, 0) for v in (x, t))  # the same batch per replica
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=[len(body)],
        devices=[f'/CPU:{r}' for r in range(num_replicas)], **CONFIGS[spec.config]).Instantiate()
    return pipe, x, t, loss_fn


def _optimizer(name: str, config: str, replica_variables: list[dict]):
    """The optimizer `name` over the replicas' variables: sharded, or one per replica."""
    from tfpipe import optimizers
    from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
    params = {'sgd': lambda: optimizers.SGD.Params(),
              'momentum': lambda: optimizers.SGD.Params().Set(momentum=0.9),
              'rmsprop': lambda: optimizers.RMSProp.Params(),
              'adam': lambda: optimizers.Adam.Params()}[name]()
    if config in SHARDED:
        return ShardedOptimizer(params, replica_variables)
    out = [params.Instantiate() for _ in replica_variables]
    for optimizer, variables in zip(out, replica_variables):
        optimizer.CreateSlots(variables)
    return out


def probe_in_process(spec: ProbeSpec) -> dict:
    """Peak bytes of the trainer's step for `spec`; must run in a fresh process whose
    environment switched the BFC allocator on before TensorFlow loaded."""
    import tensorflow as tf
    import tfpipe
    from tfpipe import fprop_context
    from tfpipe.base_layer import flatten_by_path
    from trainer.guarded_update import guarded_update

    num_replicas = CONFIGS[spec.config].get('num_replicas', 1)
    if num_replicas > 1:
        tfpipe.configure_logical_cpus(num_replicas)
    pipe, x, t, loss_fn = _build(spec)
    replica_variables = [{p: v for p, v in copy.items() if v.trainable}
                         for copy in pipe.ReplicaVariablesByPath()]
    optimizer = _optimizer(spec.optimizer, spec.config, replica_variables)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False)

    @tf.function(autograph=False)  # nothing to convert; autograph only slows tracing
    def step():
        with fprop_context.training(step=global_step):
            theta = pipe.ReplicaThetas() if num_replicas > 1 else pipe.theta
            loss, grads = pipe.ForwardBackward(theta, x, loss_fn, t)
        grads = grads if isinstance(grads, list) else [grads]
        guarded_update(loss, [flatten_by_path(g, pipe.path) for g in grads], None, optimizer,
                       replica_variables, tf.constant(LEARNING_RATE), global_step)
        return loss

    # Per device: one replica's parameters, and the shared allocator's bytes over R.
    params = sum(int(v.shape.num_elements()) for v in replica_variables[0].values())
    out = dict(params=params, oom=False)
    try:
        t0 = time.perf_counter()
        step().numpy()  # traces
        out['first_step_s'] = time.perf_counter() - t0
        tf.config.experimental.reset_memory_stats('CPU:0')
        between_steps = [tf.config.experimental.get_memory_info('CPU:0')['current']]
        t0 = time.perf_counter()
        loss = float(step().numpy())
        out['step_s'] = time.perf_counter() - t0
        out['peak'] = tf.config.experimental.get_memory_info('CPU:0')['peak'] // num_replicas
        between_steps.append(tf.config.experimental.get_memory_info('CPU:0')['current'])
        step().numpy()
        between_steps.append(tf.config.experimental.get_memory_info('CPU:0')['current'])
        # What stays between steps (weights, slots, the input): the allocator's current
        # bytes also hold, now and then, 0.2-0.7 MiB of buffers the runtime has yet to
        # free, so one reading is not the state; the least of three is.
        out['resident'] = min(between_steps) // num_replicas
        if loss != loss:
            raise FloatingPointError(f'{spec}: the step returned NaN')
    except tf.errors.ResourceExhaustedError:
        out['oom'] = True
    return out


def run_probe(spec: ProbeSpec, timeout: float = 300) -> dict:
    """Runs one probe in its own process (BFC allocator on, capped) and returns its report:
    params, peak and resident bytes, step times, oom; 'error' if the child failed."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true', TF_CPP_MIN_LOG_LEVEL='2',
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(max(1, spec.cap_bytes // MIB)))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env['PYTHONPATH'] = os.pathsep.join([repo] + [p for p in [env.get('PYTHONPATH')] if p])
    cmd = [sys.executable, os.path.abspath(__file__), '--probe',
           json.dumps(dataclasses.asdict(spec))]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f'timed out after {timeout:.0f} s')
    lines = [line for line in res.stdout.splitlines() if line.startswith('{')]
    if res.returncode != 0 or not lines:
        if any(marker in res.stderr for marker in OOM_MARKERS):
            return dict(oom=True, params=None)
        tail = res.stderr.strip().splitlines()[-1:] or [f'exit code {res.returncode}']
        return dict(error=tail[0])
    return json.loads(lines[-1])


def fits(report: dict, budget: int) -> bool:
    return not report.get('oom') and 'peak' in report and report['peak'] <= budget


# --- The search (parent process; never loads TensorFlow) ---------------------------------------

def search(probe, start: int, budget: int, resolution: float) -> dict:
    """Largest size that fits. Doubles from `start` (or halves, if it does not fit) until
    the answer is bracketed, then narrows the bracket [lo fits, hi does not] until
    hi <= lo * (1 + resolution). Each narrowing probe is the size where the straight line
    through the bracket's two measured peaks meets the budget (the midpoint if one of them
    ran out of memory), kept inside the middle half of the bracket; when it fits, the next
    probe is lo * (1 + resolution), which closes the bracket if it does not fit. The peak
    grows smoothly with the size, so this needs fewer probes than halving, and a probe of
    Pipeline-1 costs minutes of tracing here. Returns the largest fitting probe's report
    plus 'probes' and 'first_miss', or only 'probes' if size 1 does not fit."""
    reports: dict[int, dict] = {}

    def fit(size: int) -> bool:
        reports[size] = dict(probe(size), size=size)
        return fits(reports[size], budget)

    lo = hi = None
    size = start
    if fit(size):
        lo = size
        while hi is None:
            size *= 2
            lo, hi = (size, None) if fit(size) else (lo, size)
    else:
        hi = size
        while lo is None:
            if size == 1:
                return dict(probes=len(reports))
            size = max(1, size // 2)
            lo, hi = (size, hi) if fit(size) else (None, size)
    close_next = False
    while hi - lo > 1 and hi > lo * (1 + resolution):
        if close_next:
            size = min(hi - 1, max(lo + 1, int(lo * (1 + resolution)) + 1))
        else:
            p_lo, p_hi = reports[lo].get('peak'), reports[hi].get('peak')
            if p_hi is None or p_hi <= p_lo:
                size = (lo + hi) // 2
            else:
                size = int(lo + (hi - lo) * (budget - p_lo) / (p_hi - p_lo))
            quarter = max(1, (hi - lo) // 4)
            size = min(hi - quarter, max(lo + quarter, size))
        if fit(size):
            lo, close_next = size, not close_next
        else:
            hi, close_next = size, False
    return dict(reports[lo], probes=len(reports), first_miss=reports[hi])


# --- Command line and report ------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument('--quick', action='store_true',
                    help='128 MiB budget, small models, coarse search (a smoke run)')
    ap.add_argument('--models', default='amoebanet,dense',
                    help='comma list of amoebanet (scaled by filters) and dense (by layers)')
    ap.add_argument('--optimizer', choices=OPTIMIZERS, default='rmsprop',
                    help="whose slots sit beside the weights: rmsprop (tfpipe's defaults, GPipe's "
                         'AmoebaNet recipe) keeps two, momentum one, sgd none, adam two')
    ap.add_argument('--parallel', type=int, default=2,
                    help='models searched at the same time (each search is sequential)')
    defaults = PRESETS['full']
    ap.add_argument('--budget', type=parse_bytes, default=None,
                    help=f"peak budget per step (full: {defaults['budget']}, quick: "
                         f"{PRESETS['quick']['budget']})")
    for name, value in defaults.items():
        if name != 'budget':
            ap.add_argument(f'--{name}', type=type(value), default=None,
                            help=f"default {value} (quick: {PRESETS['quick'][name]})")
    args = ap.parse_args(argv)
    for name, value in PRESETS['quick' if args.quick else 'full'].items():
        if getattr(args, name) is None:
            setattr(args, name, parse_bytes(value) if name == 'budget' else value)
    args.models = [m.strip() for m in args.models.split(',') if m.strip()]
    for m in args.models:
        if m not in ('amoebanet', 'dense'):
            ap.error(f"--models: {m!r} is unknown; use amoebanet and/or dense")
    return args


def spec_maker(args, model: str, config: str):
    cap = 2 * args.budget * CONFIGS[config].get('num_replicas', 1)  # one allocator for all

    def make(size: int) -> ProbeSpec:
        if model == 'amoebanet':
            return ProbeSpec('amoebanet', size, config, args.amoeba_batch, args.amoeba_image,
                             args.amoeba_cells_per_stage, args.amoeba_stages, args.optimizer,
                             cap)
        return ProbeSpec('dense', size, config, args.dense_batch, args.dense_width,
                         optimizer=args.optimizer, cap_bytes=cap)
    return make


def size_name(model: str, size: int) -> str:
    return f'F={size}' if model == 'amoebanet' else f'L={size}'


def mib(nbytes: float) -> str:
    return f'{nbytes / MIB:.0f} MiB'


def params_str(n: float) -> str:
    return f'{n / 1e6:.2f}M' if n >= 1e5 else f'{n / 1e3:.0f}k'


def search_model(args, model: str, log) -> dict:
    """Naive first, then Pipeline-1 starting from twice naive's answer (it fits at least
    as much; the search halves if twice does not fit)."""
    out = {}
    start = args.amoeba_start if model == 'amoebanet' else args.dense_start
    for config in CONFIGS:
        make = spec_maker(args, model, config)

        def probe(size: int, make=make, config=config) -> dict:
            t0 = time.perf_counter()
            r = run_probe(make(size), args.probe_timeout)
            if 'error' in r:
                raise RuntimeError(f'{model} {config} {size_name(model, size)}: {r["error"]}')
            verdict = ('out of memory' if r['oom'] else
                       'fits' if fits(r, args.budget) else 'over budget')
            peak = f"peak {mib(r['peak'])}, resident {mib(r['resident'])}" if 'peak' in r else ''
            log(f'  {model:9s} {config:9s} {size_name(model, size):6s} params '
                f'{params_str(r["params"]) if r["params"] else "?":>7s}  {peak:34s} '
                f'{verdict:13s} '
                f'({time.perf_counter() - t0:.0f} s)')
            return r

        out[config] = search(probe, start, args.budget, args.resolution)
        start = 2 * out[config].get('size', start)
    return out


def report(args, results: dict) -> list[str]:
    """The table, the ratio beside the paper's, and what limits Pipeline-1 (from the probes)."""
    lines = [f"{'model':9s}  {'configuration':33s}  {'largest':8s}  {'params':>8s}  "
             f"{'peak':>8s}  {'resident':>8s}  {'probes':>6s}  "
             f"{'next size (does not fit)':26s}  paper (AmoebaNet-D, 8 GB)"]
    for model, res in results.items():
        for config, r in res.items():
            paper = (f'{PAPER[config][1] / 1e6:.0f}M {PAPER[config][0]}'
                     if model == 'amoebanet' and config in PAPER else '-')
            if 'size' not in r:
                lines.append(f'{model:9s}  {CONFIG_NAMES[config]:33s}  size 1 does not fit')
                continue
            miss = r['first_miss']
            miss_text = size_name(model, miss['size']) + ': ' + (
                'out of memory' if miss.get('oom') else mib(miss['peak']))
            lines.append(f"{model:9s}  {CONFIG_NAMES[config]:33s}  "
                         f"{size_name(model, r['size']):8s}  {params_str(r['params']):>8s}  "
                         f"{mib(r['peak']):>8s}  {mib(r['resident']):>8s}  {r['probes']:>6d}  "
                         f"{miss_text:26s}  {paper}")
    lines.append('')
    paper_ratio = PAPER['pipeline1'][1] / PAPER['naive'][1]
    for model, res in results.items():
        naive, pipe1 = res.get('naive', {}), res.get('pipeline1', {})
        if 'size' not in naive or 'size' not in pipe1:
            continue
        ratio = pipe1['params'] / naive['params']
        lines.append(f'{model}: Pipeline-1 / naive = {ratio:.2f}x parameters '
                     f"({size_name(model, pipe1['size'])} vs {size_name(model, naive['size'])})"
                     + (f'; paper {paper_ratio:.2f}x, goal >= {GOAL:.1f}x: '
                        + ('PASS' if ratio >= GOAL else 'MISS') if model == 'amoebanet' else ''))
        lines += ['  ' + line for line in limits(model, naive, pipe1, args.budget)]
        sharded = res.get('r2_sharded', {})
        if 'size' in sharded:
            lines.append(f"{model}: R=2 sharded / Pipeline-1 = "
                         f"{sharded['params'] / pipe1['params']:.2f}x parameters per device "
                         f"({size_name(model, sharded['size'])}; weights + slots + inputs "
                         f"{sharded['resident'] / sharded['params']:.1f} B/param against "
                         f"{pipe1['resident'] / pipe1['params']:.1f})")
    return lines


def limits(model: str, naive: dict, pipe1: dict, budget: int) -> list[str]:
    """Splits each peak into per-parameter state and the rest (activations and transients).

    resident = weights + optimizer slots + the input batch; the trainer's step adds one
    gradient per weight, all alive at the global norm. The rest is what micro-batching and
    recompute shrink; it grows linearly with filters (AmoebaNet) and with layers (Dense),
    so naive's rest scaled to Pipeline-1's size says how much of it Pipeline-1 removed."""
    out, rest = [], {}
    for name, r in (('naive', naive), ('Pipeline-1', pipe1)):
        state = r['resident'] + 4 * r['params']
        rest[name] = r['peak'] - state
        out.append(f"{name:10s} at {size_name(model, r['size'])}: weights + slots + inputs "
                   f"{mib(r['resident'])} ({r['resident'] / r['params']:.1f} B/param), "
                   f"gradients {mib(4 * r['params'])}, activations and transients "
                   f"{mib(rest[name])}: {rest[name] / state:.1f}:1 to the per-parameter state")
    scaled = rest['naive'] * pipe1['size'] / naive['size']
    out.append(f"naive's activations scaled to {size_name(model, pipe1['size'])}: {mib(scaled)}; "
               f"Pipeline-1 keeps {rest['Pipeline-1'] / scaled:.2f} of them (M=8: 0.125 for one "
               f'micro-batch, plus every micro-batch\'s input and the backward\'s temporaries); '
               f'paper, naive: 6.26 GB activations : 1.05 GB parameters = 6.0:1')
    out.append(f"of Pipeline-1's rest, up to one more gradient set ({mib(4 * pipe1['params'])}) "
               "can be a micro-batch's weight gradients on their way into the sums "
               "(pipeline_benchmark.py's accumulation bound, row 4)")
    per_param = (pipe1['resident'] + 4 * pipe1['params']) / pipe1['params']
    out.append(f'ceiling with no activations at all: {budget / per_param / 1e6:.2f}M parameters '
               f"= {budget / per_param / naive['params']:.2f}x naive, at {per_param:.1f} B/param")
    return out


def main(args) -> int:
    import concurrent.futures
    import threading
    t_start, load_start = time.perf_counter(), os.getloadavg()
    print('=' * 100)
    print(f"GPipe Table 1, measured ({'quick' if args.quick else 'full'}): largest model whose "
          f'training step peaks within {mib(args.budget)} (BFC allocator, CPU:0)')
    print(f'Python {platform.python_version()}, {os.cpu_count()} cores, host {platform.node()}, '
          f'load average {load_start[0]:.2f} at start')
    print(f"step: ForwardBackward + trainer.guarded_update, optimizer {args.optimizer}; "
          'K=1 on /CPU:0 (R=2: /CPU:0 and /CPU:1); peak of the second step (the first traces)')
    if 'amoebanet' in args.models:
        print(f'amoebanet: tfpipe.bodies.amoebanet_body, {args.amoeba_cells_per_stage} normal '
              f'cell(s) per stage x {args.amoeba_stages} stage(s) + {args.amoeba_stages - 1} '
              f'reduction cell(s), scaled by filters F (the '
              f"paper's D); {args.amoeba_image}x{args.amoeba_image}x3 images, batch "
              f'{args.amoeba_batch}, softmax cross-entropy over 10 classes')
    if 'dense' in args.models:
        print(f'dense: L x Dense({args.dense_width}) relu, batch {args.dense_batch}, MSE, scaled '
              'by layers L')
    print(f'search: doubling from the start size, then narrowing until hi <= lo x '
          f'{1 + args.resolution:.2f}; one subprocess per probe, allocator capped at '
          f'{mib(2 * args.budget)}')
    print('=' * 100, flush=True)
    lock = threading.Lock()

    def log(line: str) -> None:
        with lock:
            print(line, flush=True)

    with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
        futures = {m: pool.submit(search_model, args, m, log) for m in args.models}
        results = {m: f.result() for m, f in futures.items()}
    print()
    for line in report(args, results):
        print(line)
    load_end = os.getloadavg()
    print(f'\n1-min load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end; '
          f'total wall time {time.perf_counter() - t_start:.0f} s')
    return 0


def _probe_main(spec_json: str) -> int:
    spec = ProbeSpec(**json.loads(spec_json))
    print(json.dumps(probe_in_process(spec)), flush=True)
    return 0


if __name__ == '__main__':
    if len(sys.argv) == 3 and sys.argv[1] == '--probe':
        sys.exit(_probe_main(sys.argv[2]))
    sys.exit(main(parse_args()))
