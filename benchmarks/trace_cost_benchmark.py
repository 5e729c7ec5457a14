"""tfpipe trace-cost benchmark: this checkout's trainer against a git revision's, side by side.

Tracing a step is Python building every op of the step's graph, the cell
functions' and the recompute's included, at about half a millisecond per op
here; on the registered models it is most of the trainer's first step, and most
of what the test suite spends inside its workers. A layer form that builds fewer
ops (a bias added with `tf.nn.bias_add`, whose gradient is one BiasAddGrad
instead of the broadcast reductions of an add) cuts it, and may move the steady
step (grappler fuses MatMul + BiasAdd) and the peak.

For each model, each round runs, for both trees in alternating order and each in
fresh processes:
- the trainer's own step function, built and traced once: the ops of the traced
  step (its graph and every function in its library), the seconds tracing took
  and the seconds of its first call (grappler, placement, the step itself);
- the trainer binary for --steps steps (`trainer_defaults_benchmark.run_trainer`):
  the steps/s from the end of the first step to the last, and the peak bytes of
  CPU:0 (data from the default tfds data dir, where the trainer generates the
  shipped datasets).
Figures are medians over rounds, with the ratio this/against.

Run (from the repository root; about 1 minute per model, tree and round):
    PYTHONPATH=. python benchmarks/trace_cost_benchmark.py --against=5a30ddd
    PYTHONPATH=. python benchmarks/trace_cost_benchmark.py --against=HEAD~1 \
        --models=lm.pystdlib.TinyTransformerLM --rounds=3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = ('image.shapes.AmoebaNetPipe', 'lm.pystdlib.TinyTransformerLM',
          'mt.reverse.TransformerPipe')


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--against', help='a git revision of this repository (required)')
    ap.add_argument('--models', default=','.join(MODELS))
    ap.add_argument('--steps', type=int, default=60)
    ap.add_argument('--rounds', type=int, default=2)
    ap.add_argument('--count_ops', default=None, help='internal: a model; prints one JSON line')
    args = ap.parse_args(argv)
    if not (args.against or args.count_ops):
        ap.error('--against=REV is required')
    return args


def step_costs(params, calls: int = 1) -> dict:
    """The trainer's own step function for `params` (train_job.Trainer), traced on the
    first training batch: `ops` of the traced step (its graph and every function in its
    library), the seconds tracing took (`trace`) and those of each of its first `calls`
    calls (`calls`; the first pays grappler, placement and executors beside the step)."""
    from trainer import runtime_options, train_job

    batch = next(iter(params.input.train.Instantiate().Dataset()))
    with tempfile.TemporaryDirectory() as train_dir:
        trainer = train_job.Trainer(params, train_dir, runtime_options.RuntimeOptions())
        step = trainer._step  # pylint: disable=protected-access
        start = time.perf_counter()
        graph = step.get_concrete_function(batch).graph
        trace, seconds = time.perf_counter() - start, []
        for _ in range(calls):
            start = time.perf_counter()
            float(step(batch)[0])
            seconds.append(time.perf_counter() - start)
    library = graph.as_graph_def().library.function
    ops = len(graph.get_operations()) + sum(len(f.node_def) for f in library)
    return dict(ops=ops, trace=trace, calls=seconds)


def count_ops(model: str) -> None:
    """Prints one JSON line: the ops of the model's traced training step, the seconds
    tracing it took and those of its first call, as the trainer builds the step."""
    import tfpipe
    tfpipe.configure_logical_cpus(8)  # the trainer's --num_logical_cpus default
    import model_registry

    costs = step_costs(model_registry.get_params(model))
    print(json.dumps(dict(ops=costs['ops'], trace=costs['trace'], first=costs['calls'][0])),
          flush=True)


def run_count(tree: str, model: str) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
               PYTHONPATH=tree + os.pathsep + os.environ.get('PYTHONPATH', ''))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), f'--count_ops={model}'],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f'counting {model} from {tree}: {out.stderr[-3000:]}')
    return json.loads(out.stdout.strip().splitlines()[-1])


def checkout(revision: str, into: str) -> str:
    """A detached worktree of `revision` under `into` (removed by the caller's cleanup)."""
    path = os.path.join(into, 'against')
    subprocess.run(['git', '-C', REPO, 'worktree', 'add', '--detach', '-q', path, revision],
                   check=True)
    return path


def median_ratio(this: list[float], against: list[float]) -> str:
    a, b = statistics.median(this), statistics.median(against)
    return f'{a:8.2f} {b:8.2f} {a / b:6.2f}x'


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.count_ops:
        count_ops(args.count_ops)
        return
    # Here, not at the top: a --count_ops child imports from the other tree's checkout.
    from benchmarks.trainer_defaults_benchmark import run_trainer
    models = [m for m in args.models.split(',') if m]
    with tempfile.TemporaryDirectory() as scratch:
        against = checkout(args.against, scratch)
        try:
            trees = {'this': REPO, 'against': against}
            results = {(t, m): [] for t in trees for m in models}
            counts = {(t, m): [] for t in trees for m in models}
            data_dir = os.path.expanduser('~/tensorflow_datasets')  # the trainer's default
            for r in range(args.rounds):
                for m in models:
                    order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                    for t in order:
                        counts[t, m].append(run_count(trees[t], m))
                        rate, peak = run_trainer(m, args.steps, data_dir, {}, 8, trees[t])
                        results[t, m].append(dict(rate=rate, peak=peak))
                        print(f'round {r} {m} {t}: {counts[t, m][-1]} {results[t, m][-1]}',
                              flush=True)
        finally:
            subprocess.run(['git', '-C', REPO, 'worktree', 'remove', '--force', against],
                           check=False)
    print(f'\nthis checkout against {args.against}: medians over {args.rounds} rounds '
          '(this, against, this/against)')
    for m in models:
        print(m)
        for what, key, source in (('ops in the traced step', 'ops', counts),
                                  ('tracing the step (s)', 'trace', counts),
                                  ('first call of the step (s)', 'first', counts),
                                  ('trainer steps/s', 'rate', results),
                                  ('trainer peak CPU:0 (MiB)', 'peak', results)):
            print(f'  {what:28s}' + median_ratio([x[key] for x in source['this', m]],
                                                 [x[key] for x in source['against', m]]))


if __name__ == '__main__':
    main()
