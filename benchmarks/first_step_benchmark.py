"""tfpipe first-step benchmark: where the first step's time goes, over K and M.

The first call of a pipelined `tf.function` step traces it (Python), optimises the
graph (grappler), places and partitions it over the devices, and runs it. This
script measures, for a 16 x Dense(256) stack at batch 256 on 8 logical CPUs, each
(K, M) and each variant in a fresh subprocess:

  trace     get_concrete_function(): Python tracing of the step;
  first     the first call after tracing: grappler + placement/partitioning +
            executor creation + the run itself;
  grappler  the sum of grappler's own per-pass timings in that call (parsed from
            TF_CPP_VMODULE=meta_optimizer=1), per pass in --detail;
  steady    median of later steps.

Variants: `unrolled` (PipeliningLayer cell_functions=False: every task's ops in
the step's graph), `functions` (cell_functions=True, the default: each cell's
forward and backward traced once and called per micro-batch, calls kept as calls),
`functions_inline` (the same with the calls inlined by TensorFlow), and any of
them with grappler's meta optimizer off (`+nometa`,
tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})).
Rounds interleave the variants; each figure is the median over rounds with its
spread (min-max), and `vs unrolled` is the median of per-round ratios.

`--section=steady` compares steady-state step time side by side in one process:
`unrolled`, `functions` and `functions+jit` (cell_functions with jit_compile=True,
each cell function compiled by XLA) on the 16 x Dense(256) stack (K=4, M=8) and on
the AmoebaNet body of tfpipe/bodies.py (16x16x3 images, batch 32, K=4, M=4),
interleaving the variants round by round.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/first_step_benchmark.py           # ~15-25 minutes
    PYTHONPATH=. python benchmarks/first_step_benchmark.py --quick   # K=8 M=64 only, ~4 min
    PYTHONPATH=. python benchmarks/first_step_benchmark.py --section=steady   # ~3 minutes
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time

GRID = {'full': [(2, 4), (2, 32), (2, 64), (8, 4), (8, 32), (8, 64)], 'quick': [(8, 64)]}
VARIANTS = ('unrolled', 'functions')
GOAL = 8.0  # seconds: first step (trace + first call) at K=8, M=64
_PASS = re.compile(r'meta_optimizer\.cc:\d+\] ([A-Za-z_]+)[^:]*: Graph size after: .* '
                   r'time = ([\d.]+)ms')


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--section', default='first', choices=['first', 'steady'])
    ap.add_argument('--rounds', type=int, default=None, help='default 2, quick 1')
    ap.add_argument('--variants', default=','.join(VARIANTS),
                    help=f'comma list from {VARIANTS + ("functions_inline",)}, each optionally '
                         'with +nometa')
    ap.add_argument('--grid', default=None, help='K,M;K,M;... (default: the full or quick grid)')
    ap.add_argument('--detail', action='store_true', help='print grappler time per pass')
    ap.add_argument('--child', default=None, help='internal: K,M,variant; prints one JSON line')
    return ap.parse_args(argv)


def child(spec: str) -> None:
    """One fresh process: build, trace, first call, steady steps of one variant."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)  # as timeline_benchmark.py
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import tfpipe
    from tfpipe import fprop_context, layers
    from tfpipe.pipeline import cell_functions, partition

    k, m, variant = spec.split(',')
    k, m = int(k), int(m)
    variant, _, option = variant.partition('+')
    if option == 'nometa':
        tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})
    if variant == 'functions_inline':
        defaults = list(cell_functions.CellFunctions.__init__.__defaults__)
        defaults[0] = False  # no_inline
        cell_functions.CellFunctions.__init__.__defaults__ = tuple(defaults)
    tfpipe.configure_logical_cpus(8)
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=256, output_dim=256,
                                      activation='relu') for i in range(16)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(16, k), num_micro_batches=m,
        devices=[f'/CPU:{i}' for i in range(k)],
        cell_functions=variant.startswith('functions')).Instantiate()
    x = tf.random.stateless_normal([256, 256], seed=[1, 2])
    t = tf.random.stateless_normal([256, 256], seed=[3, 4])

    @tf.function
    def step():
        with fprop_context.training(step=0):
            loss, grads = pipe.ForwardBackward(
                pipe.theta, x, lambda o, y: tf.reduce_mean(tf.square(o - y), axis=-1), t)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(1e-4 * g)
        return loss

    t0 = time.perf_counter()
    concrete = step.get_concrete_function()
    trace = time.perf_counter() - t0
    nodes = len(concrete.graph.as_graph_def().node)
    t1 = time.perf_counter()
    float(step())
    first = time.perf_counter() - t1
    steady = []
    for _ in range(7):
        t2 = time.perf_counter()
        float(step())
        steady.append(time.perf_counter() - t2)
    print(json.dumps(dict(trace=trace, first=first, steady=statistics.median(steady),
                          nodes=nodes)), flush=True)


def run_child(k: int, m: int, variant: str) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='0', TF_CPP_VMODULE='meta_optimizer=1',
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get('PYTHONPATH', ''))
    out = subprocess.run([sys.executable, __file__, f'--child={k},{m},{variant}'], env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f'K={k} M={m} {variant}: {out.stderr[-3000:]}')
    result = json.loads(out.stdout.strip().splitlines()[-1])
    passes: dict = collections.Counter()
    for name, ms in _PASS.findall(out.stderr):
        passes[name] += float(ms) / 1e3
    result['passes'] = dict(passes)
    result['grappler'] = sum(passes.values())
    return result


def spread(values: list[float], scale: float = 1.0, fmt: str = '.2f') -> str:
    med = statistics.median(values) * scale
    if len(values) == 1:
        return f'{med:{fmt}}'
    return f'{med:{fmt}} [{min(values) * scale:{fmt}}-{max(values) * scale:{fmt}}]'


STEADY_VARIANTS = ('unrolled', 'functions', 'functions+jit')


def steady_section(rounds: int, calls: int) -> None:
    """Steady-state step time of each variant, interleaved round by round in one process."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import tfpipe
    from tfpipe import bodies, fprop_context, layers
    from tfpipe.pipeline import partition
    tfpipe.configure_logical_cpus(8)

    def dense():
        body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=256, output_dim=256,
                                          activation='relu') for i in range(16)]
        x = tf.random.stateless_normal([256, 256], seed=[1, 2])
        t = tf.random.stateless_normal([256, 256], seed=[3, 4])
        return (body, partition.even_balance(16, 4), 8, x, t,
                lambda o, y: tf.reduce_mean(tf.square(o - y), axis=-1))

    def amoeba():
        x = tf.random.stateless_normal([32, 16, 16, 3], seed=[1, 2])
        t = tf.random.stateless_uniform([32], seed=[3, 4], maxval=4, dtype=tf.int32)
        return (bodies.amoebanet_body(4), None, 4, x, t,
                lambda o, y: tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=o))

    for model, make in (('16 x Dense(256), batch 256, K=4 M=8', dense),
                        ('AmoebaNet body, batch 32, K=4 M=4', amoeba)):
        body, balance, m, x, t, loss_fn = make()
        steps = {}
        for variant in STEADY_VARIANTS:
            pipe = tfpipe.PipeliningLayer.Params().Set(
                name='pipe', body=body, balance=balance, num_cells=None if balance else 4,
                num_micro_batches=m, devices=[f'/CPU:{i}' for i in range(4)],
                cell_functions=variant != 'unrolled',
                jit_compile=variant.endswith('jit')).Instantiate()

            def step(pipe=pipe):
                with fprop_context.training(step=0):
                    loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, t)
                for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
                    v.assign_sub(1e-4 * g)
                return loss
            steps[variant] = tf.function(step)
            t0 = time.perf_counter()
            float(steps[variant]())
            print(f'  {model}: {variant} first step {time.perf_counter() - t0:.1f} s',
                  flush=True)
        times = {v: [] for v in STEADY_VARIANTS}
        for r in range(rounds):
            order = STEADY_VARIANTS[r % 3:] + STEADY_VARIANTS[:r % 3]
            for v in order:
                t0 = time.perf_counter()
                for _ in range(calls):
                    float(steps[v]())
                times[v].append((time.perf_counter() - t0) / calls)
        for v in STEADY_VARIANTS:
            vs = [a / b for a, b in zip(times[v], times['unrolled'])]
            vf = [a / b for a, b in zip(times[v], times['functions'])]
            print(f'{model}  {v:14s} steady {spread(times[v], 1e3, ".1f")} ms  vs unrolled '
                  f'{spread(vs)}x  vs functions {spread(vf)}x  (load '
                  f'{os.getloadavg()[0]:.2f})', flush=True)


def main(args) -> int:
    if args.child:
        child(args.child)
        return 0
    if args.section == 'steady':
        print(f'steady state, {args.rounds or 9} rounds of 5 calls, interleaved; 1-min load '
              f'average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores', flush=True)
        steady_section(args.rounds or 9, 5)
        return 0
    grid = GRID['quick' if args.quick else 'full'] if args.grid is None else [
        tuple(int(v) for v in km.split(',')) for km in args.grid.split(';')]
    rounds = args.rounds or (1 if args.quick else 2)
    variants = args.variants.split(',')
    print(f'first step of a 16 x Dense(256) step, batch 256, 8 logical CPUs (intra_op=1, '
          f'inter_op=2); {rounds} round(s); 1-min load average at start '
          f'{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores', flush=True)
    header = ['K', 'M', 'variant', 'nodes', 'trace s', 'first call s', 'grappler s',
              'trace+first s', 'vs unrolled', 'steady ms', 'steady vs unrolled']
    rows = []
    for k, m in grid:
        results = {v: [] for v in variants}
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                results[v].append(run_child(k, m, v))
                print(f'  K={k} M={m} {v} round {r}: {json.dumps(results[v][-1])} '
                      f'(load {os.getloadavg()[0]:.2f})', flush=True)
        base = results.get('unrolled')
        for v in variants:
            res = results[v]
            total = [x['trace'] + x['first'] for x in res]
            ratio = steady_ratio = ''
            if base is not None:
                ratio = spread([(a['trace'] + a['first']) / (b['trace'] + b['first'])
                                for a, b in zip(res, base)], fmt='.2f') + 'x'
                steady_ratio = spread([a['steady'] / b['steady'] for a, b in zip(res, base)],
                                      fmt='.2f') + 'x'
            rows.append([k, m, v, res[0]['nodes'], spread([x['trace'] for x in res]),
                         spread([x['first'] for x in res]), spread([x['grappler'] for x in res]),
                         spread(total), ratio, spread([x['steady'] for x in res], 1e3, '.0f'),
                         steady_ratio])
            if args.detail:
                passes = sorted(res[0]['passes'].items(), key=lambda kv: -kv[1])[:6]
                print(f'  K={k} M={m} {v} grappler passes (round 0): ' +
                      ', '.join(f'{n} {s:.2f} s' for n, s in passes), flush=True)
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print('  '.join(str(v).ljust(w) for v, w in zip(r, widths)))
    for r in rows:
        if (r[0], r[1]) == (8, 64):
            total = float(str(r[7]).split()[0])
            print(f'goal K=8 M=64 first step <= {GOAL:.0f} s: {r[2]} {total:.1f} s '
                  f'{"PASS" if total <= GOAL else "MISS"}')
    print(f'note: 1-min load average at end {os.getloadavg()[0]:.2f}')
    return 0


if __name__ == '__main__':
    sys.exit(main(parse_args()))
