"""tfpipe pipeline benchmark: overhead, scaling and memory, measured side by side.

Prints ONE table (see benchmarks/README.md for what each row means):

  1. overhead        plain tape step vs tfpipe K=1, M=1, both with the trainer's update
  2. scaling         K=2 with M=1,2,4,8 relative to K=1, M=1, next to the GPipe bubble
  3. recompute mem   peak memory of an activation-dominated stack, recompute always vs never
  4. accum mem       peak memory of a weight-dominated stack, M=1 vs M=4 vs M=8

The machine is shared and noisy, so timing variants are built once, warmed up, and then
timed in interleaved rounds (the order rotates every round); the table shows medians and
ratios computed per round (paired), not only absolute times. Memory variants run first,
one model alive at a time, so their peaks do not include each other's weights.

Run (from the repository root):
    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/pipeline_benchmark.py          # full
    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/pipeline_benchmark.py --quick  # ~15 s smoke run
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from typing import Callable, Optional

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# Only the BFC allocator keeps peak statistics on CPU ("Cannot reset memory stats"
# otherwise); it must be chosen before TensorFlow loads.
os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'

MIB = 1024.0 * 1024.0

# Sizes per mode; every entry can be overridden by the flag of the same name.
PRESETS = {
    'full': dict(
        # rows 1-2: timing model (the notes' reference: 8 x Dense(1024), batch 256)
        time_batch=256, time_width=1024, time_layers=8, rounds=21, calls=5, warmup=2,
        # row 3: activation-dominated (notes: B=4096, W=1024, 16 layers, K=4)
        act_batch=4096, act_width=1024, act_layers=16, act_cells=4, act_micro=4,
        # row 4: weight-dominated (notes: B=256, W=2048, 16 layers)
        acc_batch=256, acc_width=2048, acc_layers=16, acc_cells=2, acc_micro=4,
        # row 5: a skip from cell 0 to cell K-1; row 6: wmt14's batch, length and width
        skip_batch=1024, skip_width=512, skip_layers=8, emb_batch=64, emb_length=256,
        emb_dim=512, mem_repeats=3),
    'quick': dict(
        time_batch=128, time_width=512, time_layers=8, rounds=5, calls=3, warmup=1,
        act_batch=1024, act_width=512, act_layers=16, act_cells=4, act_micro=4,
        acc_batch=64, acc_width=1024, acc_layers=16, acc_cells=2, acc_micro=4,
        skip_batch=256, skip_width=256, skip_layers=8, emb_batch=16, emb_length=64,
        emb_dim=128, mem_repeats=1),
}
SCALING_MICRO = (1, 2, 4, 8)
SKIP_CELLS = 4
EMB_VOCABS = (258, 32768)  # params/mt/wmt14_ende.py's byte vocabulary; a subword-sized one
EMB_MICRO = 8  # wmt14's M
SCALING_CELLS = 2
OVERHEAD_TARGET = 1.05
ACCUM_FLAT = 1.05
LEARNING_RATE = 1e-4


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument('--quick', action='store_true', help='small sizes, ~1 minute smoke run')
    ap.add_argument('--devices', choices=('cpu', 'gpu'), default='cpu',
                    help="cpu: cells on /CPU:0../CPU:K-1 (logical CPUs); gpu: devices=None, "
                         "i.e. GPUs when there are at least K, else logical CPUs")
    ap.add_argument('--num_logical_cpus', type=int, default=8,
                    help='logical CPU devices to split the host CPU into (>= 4 for row 3)')
    ap.add_argument('--pin_threads', choices=('auto', 'on', 'off'), default='auto',
                    help='set intra_op_parallelism_threads/inter_op_parallelism_threads '
                         'before TF starts so two logical devices can overlap; auto: on for '
                         '--devices=cpu, off for gpu')
    ap.add_argument('--intra_op_threads', type=int, default=1, help='used when pinned')
    ap.add_argument('--inter_op_threads', type=int, default=2, help='used when pinned')
    ap.add_argument('--rows', default='1,2,3,4,5,6', help='comma-separated rows to run')
    for name in PRESETS['full']:
        ap.add_argument(f'--{name}', type=int, default=None,
                        help=f"default {PRESETS['full'][name]} (quick: {PRESETS['quick'][name]})")
    args = ap.parse_args(argv)
    for name, value in PRESETS['quick' if args.quick else 'full'].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.rows = {int(r) for r in args.rows.split(',') if r.strip()}
    if args.pin_threads == 'auto':
        args.pin_threads = 'on' if args.devices == 'cpu' else 'off'
    return args


ARGS = parse_args()
_T_START = time.perf_counter()

import tensorflow as tf  # noqa: E402  (after the environment is set)

tf.get_logger().setLevel('ERROR')  # one tf.function per variant is intended: no retrace warnings

import tfpipe  # noqa: E402
from tfpipe import devices as devices_lib  # noqa: E402
from tfpipe import fprop_context, layers, optimizers  # noqa: E402
from tfpipe.base_layer import flatten_by_path  # noqa: E402
from trainer.guarded_update import guarded_update  # noqa: E402
from tfpipe.pipeline import partition, schedule  # noqa: E402
from tfpipe.tuning import trace  # noqa: E402

# --- Runtime configuration: must happen before TensorFlow initialises. -------------------
if ARGS.pin_threads == 'on':
    tf.config.threading.set_intra_op_parallelism_threads(ARGS.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(ARGS.inter_op_threads)
tfpipe.configure_logical_cpus(ARGS.num_logical_cpus, 0, 0)  # threads: --pin_threads above


# --- Models and steps ---------------------------------------------------------------------

def make_body(num_layers: int, width: int) -> list:
    return [layers.Dense.Params().Set(name=f'fc{i}', input_dim=width, output_dim=width,
                                      activation='relu') for i in range(num_layers)]


def loss_fn(outputs, targets):
    """Per-example mean squared error, shape [b]."""
    return tf.reduce_mean(tf.square(outputs - targets), axis=-1)


def cell_devices(num_cells: int) -> Optional[list[str]]:
    """What the pipeline is given: explicit logical CPUs, or None (GPUs if enough)."""
    if ARGS.devices == 'cpu':
        return [f'/CPU:{i}' for i in range(num_cells)]
    return None


def resolved_devices(num_cells: int) -> list[str]:
    return devices_lib.resolve(cell_devices(num_cells), num_cells)


def short(devs: list[str]) -> str:
    specs = [tf.DeviceSpec.from_string(d) for d in devs]
    kinds = {s.device_type for s in specs}
    if len(kinds) == 1:
        idx = [s.device_index for s in specs]
        kind = specs[0].device_type
        if len(idx) > 1 and idx == list(range(idx[0], idx[0] + len(idx))):
            return f'{kind}:{idx[0]}-{idx[-1]}'
        return ','.join(f'{kind}:{i}' for i in idx)
    return ','.join(f'{s.device_type}:{s.device_index}' for s in specs)


def memory_devices(devs: list[str]) -> list[str]:
    """Allocators whose peaks make up the figure: CPU:0 (all logical CPUs share one
    allocator, so it is global) or each distinct GPU (peaks summed)."""
    out = []
    for d in devs:
        s = tf.DeviceSpec.from_string(d)
        name = 'CPU:0' if s.device_type == 'CPU' else f'{s.device_type}:{s.device_index or 0}'
        if name not in out:
            out.append(name)
    return out


def make_data(batch: int, width: int, device: str):
    with tf.device(device):
        x = tf.random.stateless_normal([batch, width], seed=[1, 2])
        t = tf.random.stateless_normal([batch, width], seed=[3, 4])
    return x, t


class TrainerUpdate:
    """The trainer's update, shared by every variant: trainer.guarded_update
    (global gradient norm, finiteness gate, SGD through tfpipe's optimizer, step += 1).
    The norm keeps every gradient alive until the update, so a step that skipped it
    would understate the trainer's peak memory and time."""

    def __init__(self, model):
        self.variables = {p: v for p, v in model.VariablesByPath().items() if v.trainable}
        self.optimizer = optimizers.SGD.Params().Instantiate()
        self.optimizer.CreateSlots(self.variables)
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.path = model.path

    def __call__(self, loss: tf.Tensor, grads: dict) -> tf.Tensor:
        guarded_update(loss, [flatten_by_path(grads, self.path)], None, [self.optimizer],
                       [self.variables], tf.constant(LEARNING_RATE), self.global_step)
        return loss


def build_plain(num_layers: int, width: int, batch: int):
    """The unpartitioned twin: Sequential + tf.GradientTape + the trainer's update."""
    device = resolved_devices(1)[0]
    with tf.device(device):
        model = layers.Sequential.Params().Set(
            name='pipe', body=make_body(num_layers, width)).Instantiate()
    x, t = make_data(batch, width, device)
    update = TrainerUpdate(model)

    @tf.function
    def step():
        with tf.device(device), fprop_context.training(step=0):
            with tf.GradientTape() as tape:
                out = model.FProp(model.theta, x)
                loss = tf.reduce_mean(loss_fn(out, t))
            grads = tape.gradient(loss, model.theta)
            return update(loss, grads)

    return model, step, [device]


def build_pipe(num_layers: int, width: int, batch: int, num_cells: int, num_micro: int,
               recompute: str, body: Optional[list] = None, data: Optional[tuple] = None,
               loss: Callable = loss_fn):
    """The trainer's step on a bare pipeline: ForwardBackward + the trainer's update.
    body / data / loss replace the Dense stack, its random data and MSE (rows 5-6)."""
    body = body or make_body(num_layers, width)
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(len(body), num_cells),
        num_micro_batches=num_micro, recompute=recompute,
        devices=cell_devices(num_cells)).Instantiate()
    x, t = data or make_data(batch, width, pipe.devices[0])
    update = TrainerUpdate(pipe)

    @tf.function
    def step():
        with fprop_context.training(step=0):
            loss_value, grads = pipe.ForwardBackward(pipe.theta, x, loss, t)
        return update(loss_value, grads)

    return pipe, step, list(pipe.devices)


def skip_body(num_layers: int, width: int) -> list:
    """The Dense stack with a skip from after its first layer to its end: with K cells
    it is stashed in cell 0 and popped in cell K-1."""
    body = make_body(num_layers, width)
    return (body[:1] + [layers.Stash.Params().Set(name='stash', key='skip')] + body[1:]
            + [layers.Pop.Params().Set(name='pop', key='skip')])


def build_embedding(vocab: int, batch: int, length: int, dim: int):
    """Embedding(vocab, dim) + Dense(dim, dim), K=2, M=8: cell 0's gradient is sparse.

    The batch x length tokens are one flat batch of ids: the embedding gradient has one
    row per token either way, and a rank-2 Dense avoids the [dim, dim, batch, length]
    intermediate that TensorFlow's einsum gradient builds for rank-3 inputs."""
    body = [layers.Embedding.Params().Set(name='emb', vocab_size=vocab, embedding_dim=dim),
            layers.Dense.Params().Set(name='fc', input_dim=dim, output_dim=dim)]
    with tf.device(resolved_devices(1)[0]):
        ids = tf.random.stateless_uniform([batch * length], [5, 6], maxval=vocab,
                                          dtype=tf.int32)
        t = tf.random.stateless_normal([batch * length, dim], seed=[7, 8])
    return build_pipe(0, dim, batch, 2, EMB_MICRO, 'always', body=body, data=(ids, t))


# --- Measurement ----------------------------------------------------------------------------

def sync_call(step: Callable) -> None:
    loss = step().numpy()
    if not (loss == loss):  # NaN would make timings meaningless
        raise FloatingPointError('benchmark step returned NaN')


def measure_memory(builder: Callable, repeats: int, warmup: int) -> dict:
    """Peak bytes of one step, after warm-up; one model alive; deleted afterwards."""
    gc.collect()
    before = None
    model, step, devs = builder()
    mem_devs = memory_devices(devs)
    for _ in range(max(1, warmup)):  # the first call traces
        sync_call(step)
    peaks, transients = [], []
    for _ in range(repeats):
        for d in mem_devs:
            tf.config.experimental.reset_memory_stats(d)
        base = sum(tf.config.experimental.get_memory_info(d)['current'] for d in mem_devs)
        sync_call(step)
        peak = sum(tf.config.experimental.get_memory_info(d)['peak'] for d in mem_devs)
        peaks.append(peak)
        transients.append(peak - base)
        before = base
    del model, step
    gc.collect()
    after = sum(tf.config.experimental.get_memory_info(d)['current'] for d in mem_devs)
    return dict(peak=statistics.median(peaks), peaks=peaks,
                transient=statistics.median(transients), resident=before, after=after,
                devs=devs, mem_devs=mem_devs)


def measure_times(builders: dict, rounds: int, calls: int, warmup: int) -> dict:
    """Builds every variant once, warms each up, then times interleaved rounds.

    Each round times `calls` synchronised calls of every variant, in an order rotated
    by one each round. Returns per-variant round means (seconds per step), their median
    and quartiles, and the median CPU use (process CPU seconds / wall seconds).
    """
    built = {}
    for name, builder in builders.items():
        model, step, devs = builder()
        for _ in range(max(1, warmup)):
            sync_call(step)
        built[name] = (model, step, devs)
    names = list(builders)
    per_round = {n: [] for n in names}
    cpu_use = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            step = built[name][1]
            c0, t0 = process_cpu_seconds(), time.perf_counter()
            for _ in range(calls):
                sync_call(step)
            wall = time.perf_counter() - t0
            per_round[name].append(wall / calls)
            cpu_use[name].append((process_cpu_seconds() - c0) / wall)
    out = {}
    for name in names:
        times = per_round[name]
        out[name] = dict(times=times, median=statistics.median(times), q=quartiles(times),
                         devs=built[name][2], cpu=statistics.median(cpu_use[name]))
    del built
    gc.collect()
    return out


def paired_ratio(res: dict, name: str, ref: str) -> tuple[float, tuple[float, float]]:
    """Median and quartiles of time(name) / time(ref), paired round by round."""
    ratios = [a / b for a, b in zip(res[name]['times'], res[ref]['times'])]
    return statistics.median(ratios), quartiles(ratios)


def process_cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    t = os.times()
    return t.user + t.system


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method='inclusive')
    return q[0], q[2]


# --- Output ---------------------------------------------------------------------------------

COLUMNS = [('row', 3), ('measurement', 13), ('variant', 36), ('devices', 7),
           ('median', 9), ('[p25, p75] / range', 18), ('ratio [p25, p75]', 18),
           ('verdict', 7), ('target / reference / detail', 0)]


def fmt_row(values) -> str:
    """values: row, measurement, variant, devices, median, spread, ratio, target, verdict."""
    values = list(values[:7]) + [values[8], values[7]]  # verdict before the long text
    return '  '.join(str(v).ljust(w) if i < len(COLUMNS) - 1 else str(v)
                     for i, (v, (_, w)) in enumerate(zip(values, COLUMNS)))


def ms(seconds: float) -> str:
    return f'{seconds * 1e3:.1f} ms'


def mib(nbytes: float) -> str:
    return f'{nbytes / MIB:.0f} MiB'


def header(args) -> list[str]:
    gpus = tf.config.list_physical_devices('GPU')
    cpus = tf.config.list_logical_devices('CPU')
    if args.devices == 'gpu' and gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get('device_name', 'GPU')
        kind = f'GPU ({len(gpus)} x {name})'
        if len(gpus) < 4:
            kind += (f'; pipelines with K > {len(gpus)} fall back to logical CPUs (see the '
                     'devices column: compare such rows with care)')
    elif args.devices == 'gpu':
        kind = 'GPU requested but none found: devices=None falls back to logical CPUs'
    else:
        kind = 'CPU (logical devices)'
    threads = (f'intra_op={tf.config.threading.get_intra_op_parallelism_threads()}, '
               f'inter_op={tf.config.threading.get_inter_op_parallelism_threads()} '
               f'(pinned {"ON" if args.pin_threads == "on" else "OFF"}: '
               + ('each op single-threaded so two logical devices can overlap; applies to '
                  'every row, the plain step included' if args.pin_threads == 'on' else
                  '0 = TensorFlow default, all cores per op; logical CPUs then compete for '
                  'one pool') + ')')
    lines = [
        '=' * 100,
        f'tfpipe pipeline benchmark ({"quick" if args.quick else "full"})   '
        f'{datetime.datetime.now().astimezone().isoformat(timespec="seconds")}',
        f'TensorFlow {tf.__version__}, Python {platform.python_version()}, '
        f'{platform.machine()} {os.cpu_count()} host cores, host {platform.node()}',
        f'device kind: {kind}; --devices={args.devices}; {len(cpus)} logical CPUs, '
        f'{len(gpus)} GPUs',
        f'threads: {threads}',
        f'timing model (rows 1-2): {args.time_layers} x Dense({args.time_width}) relu, batch '
        f'{args.time_batch}, f32, MSE, SGD; {args.rounds} interleaved rounds x {args.calls} '
        f'calls after {args.warmup} warm-up; median of round means, ratios paired per round',
        f'row 3 model: {args.act_layers} x Dense({args.act_width}), batch {args.act_batch}, '
        f'K={args.act_cells}, M={args.act_micro};  row 4 model: {args.acc_layers} x '
        f'Dense({args.acc_width}), batch {args.acc_batch}, K={args.acc_cells}; memory: peak of '
        f'one step after warm-up, median of {args.mem_repeats}',
        '=' * 100,
    ]
    return lines


def main(args) -> int:
    need_cells = max([1] + ([SCALING_CELLS] if 2 in args.rows else [])
                     + ([args.act_cells] if 3 in args.rows else [])
                     + ([args.acc_cells] if 4 in args.rows else [])
                     + ([SKIP_CELLS] if 5 in args.rows else []))
    if args.devices == 'cpu' and args.num_logical_cpus < need_cells:
        print(f'--num_logical_cpus={args.num_logical_cpus} is too few: the selected rows need '
              f'{need_cells} devices', file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    for line in header(args):
        print(line, flush=True)
    rows: list[list] = []
    notes: list[str] = []

    # Memory rows first (one model alive at a time), then timing rows.
    if 3 in args.rows:
        print('measuring row 3 (recompute memory)...', flush=True)
        k, m = args.act_cells, args.act_micro
        res = {}
        for rc in ('never', 'always'):
            res[rc] = measure_memory(
                lambda rc=rc: build_pipe(args.act_layers, args.act_width, args.act_batch, k, m,
                                         rc), args.mem_repeats, 1)
        ratio = res['always']['peak'] / res['never']['peak']
        tratio = res['always']['transient'] / max(res['never']['transient'], 1)
        for rc in ('never', 'always'):
            r = res[rc]
            rows.append([3, 'recompute mem', f'K={k} M={m} recompute={rc}', short(r['devs']),
                         mib(r['peak']), f'{mib(min(r["peaks"]))}..{mib(max(r["peaks"]))}',
                         '1.00' if rc == 'never' else f'{ratio:.2f}',
                         f'step transient {mib(r["transient"])} (resident {mib(r["resident"])})'
                         + ('' if rc == 'never' else f'; transient ratio {tratio:.2f}'),
                         ''])
        notes.append(f'row 3 memory read from {res["never"]["mem_devs"]}; after deleting each '
                     f'model: {mib(res["never"]["after"])}, {mib(res["always"]["after"])} live')

    if 4 in args.rows:
        print('measuring row 4 (accumulation memory)...', flush=True)
        k, mm = args.acc_cells, args.acc_micro
        micro = (1, mm, 2 * mm)
        res = {}
        for m in micro:
            res[m] = measure_memory(
                lambda m=m: build_pipe(args.acc_layers, args.acc_width, args.acc_batch, k, m,
                                       'always'), args.mem_repeats, 1)
        # One full set of weight gradients is as big as the weights. The trainer's step holds
        # every gradient until the norm is known, at M=1 too; M > 1 adds at most the running
        # sums of one more set, and the peak must not grow with M beyond that.
        grad_set = args.acc_layers * (args.acc_width + 1) * args.acc_width * 4
        bound = res[1]['peak'] + grad_set
        flat = res[2 * mm]['peak'] / res[mm]['peak']
        for m in micro:
            r = res[m]
            detail = f'step transient {mib(r["transient"])} (resident {mib(r["resident"])})'
            verdict = ''
            if m == 1:
                detail += f'; one gradient set = {mib(grad_set)}'
            elif m == mm:
                detail += f'; bound: M=1 peak + one gradient set = {mib(bound)}'
                verdict = 'PASS' if r['peak'] <= bound else 'MISS'
            else:
                detail += (f'; flat from M={mm}: M={m} / M={mm} = {flat:.2f} (target <= '
                           f'{ACCUM_FLAT:.2f})')
                verdict = 'PASS' if flat <= ACCUM_FLAT else 'MISS'
            rows.append([4, 'accum mem', f'K={k} M={m} recompute=always', short(r['devs']),
                         mib(r['peak']), f'{mib(min(r["peaks"]))}..{mib(max(r["peaks"]))}',
                         f'{r["peak"] / res[1]["peak"]:.2f}', detail, verdict])
        notes.append(f'row 4 memory read from {res[1]["mem_devs"]}; every variant runs the '
                     "trainer's step (global norm, finiteness gate, SGD update)")

    if 5 in args.rows:
        print('measuring row 5 (bytes between cells)...', flush=True)
        b, w = args.skip_batch, args.skip_width
        pipe, step, devs = build_pipe(0, w, b, SKIP_CELLS, 1, 'always',
                                      body=skip_body(args.skip_layers, w))
        moved = trace.bytes_between_devices(step.get_concrete_function())
        skip = b * w * 4  # the stashed activation, float32
        hops = SKIP_CELLS - 1
        # Carried in the activation, the skip is copied into each cell in between; its
        # gradient passes through them unchanged (the same tensor), so adds no hops.
        carried = sum(moved.values()) + skip * (hops - 1)
        first, last = short(devs[:1]), short(devs[-1:])
        portal = moved.get((first, last), 0) + moved.get((last, first), 0)
        rows.append([5, 'skip traffic', f'K={SKIP_CELLS} skip cell 0 -> {hops}, batch {b}',
                     short(devs), mib(sum(moved.values())), '',
                     f'{sum(moved.values()) / carried:.2f}',
                     f'bytes between devices per step, from the traced graph ({portal / MIB:.1f} '
                     f'MiB on the portal cell 0 <-> {hops}, both ways); carried through every '
                     f'cell, as before portals: {mib(carried)} (from shapes: + the skip copied into the '
                     f'{hops - 1} cells in between)', ''])
        del pipe, step

    if 6 in args.rows:
        print('measuring row 6 (embedding gradient memory)...', flush=True)
        for vocab in EMB_VOCABS:
            r = measure_memory(lambda vocab=vocab: build_embedding(
                vocab, args.emb_batch, args.emb_length, args.emb_dim), args.mem_repeats, 1)
            table = vocab * args.emb_dim * 4
            rows_per_micro = args.emb_batch * args.emb_length // EMB_MICRO
            sparse_for = min(EMB_MICRO, vocab // rows_per_micro)
            kind = ('as slices, made dense once' if sparse_for == EMB_MICRO else
                    f'as slices for {sparse_for} of {EMB_MICRO} micro-batches, then dense'
                    if sparse_for else 'densely (a micro-batch has more rows than V)')
            rows.append([6, 'sparse grads', f'Embedding V={vocab} D={args.emb_dim}, K=2 '
                         f'M={EMB_MICRO}', short(r['devs']), mib(r['peak']),
                         f'{mib(min(r["peaks"]))}..{mib(max(r["peaks"]))}', '',
                         f'step transient {mib(r["transient"])}; summed {kind}: dense table '
                         f'gradient {table / MIB:.1f} MiB, one micro-batch of slices '
                         f'{rows_per_micro * args.emb_dim * 4 / MIB:.1f} MiB', ''])

    if 1 in args.rows or 2 in args.rows:
        print('measuring rows 1-2 (timing, interleaved)...', flush=True)
        L, W, B = args.time_layers, args.time_width, args.time_batch
        k2, m_diag = SCALING_CELLS, max(SCALING_MICRO)
        builders = {}
        if 1 in args.rows:
            builders['plain'] = lambda: build_plain(L, W, B)
            builders['k1m1_never'] = lambda: build_pipe(L, W, B, 1, 1, 'never')
        builders['k1m1_always'] = lambda: build_pipe(L, W, B, 1, 1, 'always')
        if 2 in args.rows:
            for m in SCALING_MICRO:
                builders[f'k2m{m}'] = lambda m=m: build_pipe(L, W, B, k2, m, 'always')
            builders[f'k1m{m_diag}'] = lambda: build_pipe(L, W, B, 1, m_diag, 'always')
        res = measure_times(builders, args.rounds, args.calls, args.warmup)

        def trow(row, what, name, ref, variant, target, verdict=''):
            r = res[name]
            ratio, rq = paired_ratio(res, name, ref)
            rows.append([row, what, variant, short(r['devs']), ms(r['median']),
                         f'[{ms(r["q"][0])}, {ms(r["q"][1])}]'.replace(' ms', ''),
                         f'{ratio:.3f}' + ('' if name == ref else f' [{rq[0]:.2f},{rq[1]:.2f}]'),
                         f'{target}; cpu/wall {r["cpu"]:.2f}', verdict])
            return ratio

        if 1 in args.rows:
            trow(1, 'overhead', 'plain', 'plain', 'plain tape + trainer update',
                 'ratio = variant / plain, paired per round')
            ov = trow(1, 'overhead', 'k1m1_never', 'plain', 'tfpipe K=1 M=1 recompute=never',
                      f'target <= {OVERHEAD_TARGET:.2f}x plain')
            rows[-1][8] = 'PASS' if ov <= OVERHEAD_TARGET else 'MISS'
            trow(1, 'overhead', 'k1m1_always', 'plain', 'tfpipe K=1 M=1 recompute=always',
                 'info: recompute adds one forward (~4/3 FLOPs)')
        if 2 in args.rows:
            trow(2, 'scaling', 'k1m1_always', 'k1m1_always', 'tfpipe K=1 M=1 recompute=always',
                 'ratio = variant / K=1 M=1 (same recompute)')
            for m in SCALING_MICRO:
                bubble = schedule.bubble_fraction(k2, m)
                ideal = (m + k2 - 1) / (k2 * m)
                trow(2, 'scaling', f'k2m{m}', 'k1m1_always',
                     f'tfpipe K={k2} M={m} recompute=always',
                     f'bubble (K-1)/(M+K-1) = {bubble:.3f}; ideal {ideal:.3f}')
            trow(2, 'scaling', f'k1m{m_diag}', 'k1m1_always',
                 f'diag: K=1 M={m_diag} recompute=always',
                 'micro-batching alone, no pipeline: compare with K=2 of the same M')
    if 2 in args.rows:
        notes.append('row 2 "ideal" = (M+K-1)/(K*M): time relative to K=1 if K devices each as '
                     'fast as the K=1 step ran in parallel and only the bubble were lost. '
                     'Logical CPUs share the host cores, so on CPU it is reachable only when '
                     'the K=1 step leaves cores idle: "cpu/wall" is the process CPU time over '
                     'wall time (cores in use on average), the ceiling is the host core count.')

    print()
    names = [c for c, _ in COLUMNS]
    dashes = ['-' * max(w, len(c)) for c, w in COLUMNS]
    # fmt_row takes (..., target, verdict) and prints verdict first
    print(fmt_row(names[:7] + names[8:] + names[7:8]))
    print(fmt_row(dashes[:7] + dashes[8:] + dashes[7:8]))
    for row in sorted(rows, key=lambda r: r[0]):
        print(fmt_row(row))
    print()
    load_end = os.getloadavg()
    notes.append(f'1-min load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end, on '
                 f'{os.cpu_count()} cores (this run contributes up to ~2): other work on the '
                 'machine shows up as lower cpu/wall and higher times in every variant')
    for n in notes:
        print('note:', n)
    print(f'total wall time {time.perf_counter() - _T_START:.0f} s')
    return 0


if __name__ == '__main__':
    sys.exit(main(ARGS))
