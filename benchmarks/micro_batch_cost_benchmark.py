"""tfpipe micro-batch cost benchmark: how much a step grows from M=1 to M=4 and M=8.

GPipe's point is that micro-batches are free: M only splits the same work into
smaller pieces, so the step at M=8 should cost what it costs at M=1 (issue 26
asks for within 1.1x at K=2 and K=4, on both models, at each kernel setting).
This script measures the step of two models through the library, as a user
builds it (`import tfpipe`, `configure_logical_cpus(8)`, a `PipeliningLayer`,
`ForwardBackward` and SGD lr 0.01 in a `tf.function`), recompute always:

- `mlp`: 8 x Dense(1024) relu, batch 256, loss mean(y^2) (the issue's model);
- `transformer`: tfpipe.bodies.transformer_body (vocab 1024, 32 tokens, model
  256, hidden 1024, 4 heads, 3 blocks), batch 32, softmax cross-entropy, sized so
  its step is close to the MLP's.

One child process per kernel setting (`TF_ENABLE_ONEDNN_OPTS=0`, `=1`: TensorFlow
reads it once per process) builds every (model, K, M) step, runs 3 warm-ups of
each, then 10 rounds that interleave the steps, so every config sees the same
load. It prints, per setting, model and K, the median ms at M=1, 4, 8 and the
ratios M=4/M=1 and M=8/M=1, the CPU ms of each step (getrusage: the work done,
less inflated than wall time by other processes on a loaded machine), then the
wall ratios against the faster of the two settings' M=1 (the issue's "within 1.1x
of the faster M=1").

Run (from the repository root; about 3 minutes on 2 quiet cores):
    PYTHONPATH=. python benchmarks/micro_batch_cost_benchmark.py
    PYTHONPATH=. python benchmarks/micro_batch_cost_benchmark.py --models=mlp --cells=2 \
        --settings=1 --rounds=20
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MICRO = (1, 4, 8)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--settings', default='0,1', help='TF_ENABLE_ONEDNN_OPTS values, one '
                    'child process each')
    ap.add_argument('--models', default='mlp,transformer')
    ap.add_argument('--cells', default='2,4', help='K values')
    ap.add_argument('--micro', default=','.join(map(str, MICRO)), help='M values (1 first)')
    ap.add_argument('--rounds', type=int, default=10)
    ap.add_argument('--warmups', type=int, default=3)
    ap.add_argument('--threads', default='', help='intra/inter, e.g. 1/2 (default: '
                    'configure_logical_cpus\'s own)')
    ap.add_argument('--child', action='store_true', help='internal: measure in this process')
    return ap.parse_args(argv)


def build_step(model: str, cells: int, micro: int):
    """(a traced step function, its input) for one config, in the library's order."""
    import tensorflow as tf
    import tfpipe
    from tfpipe import fprop_context, layers
    from tfpipe.bodies import transformer_body

    if model == 'mlp':
        body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=1024, output_dim=1024,
                                          activation='relu') for i in range(8)]
        x = tf.random.stateless_normal([256, 1024], [1, 2])
        targets = x

        def loss_fn(outputs, _):
            return tf.reduce_mean(tf.square(outputs), axis=-1)
    else:
        body = transformer_body(1024, 32, 256, 1024, 4, 3)
        x = tf.random.stateless_uniform([32, 32], [1, 2], maxval=1024, dtype=tf.int32)
        targets = x

        def loss_fn(outputs, ids):
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=ids, logits=outputs), axis=-1)
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name=f'{model}_{cells}_{micro}', body=body, num_cells=cells, num_micro_batches=micro,
        recompute='always').Instantiate()

    @tf.function
    def step(x, targets):
        with fprop_context.training(step=tf.constant(0, tf.int64)):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, targets)
        for var, grad in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            var.assign_sub(0.01 * grad)
        return loss

    return lambda: step(x, targets).numpy()


def child(args) -> None:
    import tfpipe
    intra, inter = ((int(v) for v in args.threads.split('/')) if args.threads else (None, None))
    tfpipe.configure_logical_cpus(8, intra, inter)
    from tfpipe import runtime_defaults
    import tensorflow as tf
    configs = [(model, int(k), int(m)) for model in args.models.split(',')
               for k in args.cells.split(',') for m in args.micro.split(',')]
    steps = {}
    for config in configs:
        steps[config] = build_step(*config)
        for _ in range(args.warmups):
            steps[config]()
    times = {config: [] for config in configs}
    cpu = {config: [] for config in configs}
    for _ in range(args.rounds):
        for config in configs:
            used, start = _cpu_seconds(), time.perf_counter()
            steps[config]()
            times[config].append(1000 * (time.perf_counter() - start))
            cpu[config].append(1000 * (_cpu_seconds() - used))
    print(json.dumps({'onednn': runtime_defaults.onednn_enabled(),
                      'threads': [tf.config.threading.get_intra_op_parallelism_threads(),
                                  tf.config.threading.get_inter_op_parallelism_threads()],
                      'ms': [[*config, statistics.median(times[config]),
                              statistics.median(cpu[config])] for config in configs]}))


def _cpu_seconds() -> float:
    """This process's CPU time (user + system): the work a step did, which other
    processes on a loaded machine inflate far less than its wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_child(setting: str, args) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=setting, TF_CPP_MIN_LOG_LEVEL='3',
               PYTHONPATH=repo + os.pathsep + os.environ.get('PYTHONPATH', ''))
    argv = [sys.executable, os.path.abspath(__file__), '--child', f'--models={args.models}',
            f'--cells={args.cells}', f'--micro={args.micro}', f'--rounds={args.rounds}',
            f'--warmups={args.warmups}', f'--threads={args.threads}']
    done = subprocess.run(argv, env=env, cwd=repo, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    print(f'load before: {os.getloadavg()[0]:.1f}; median step ms of {args.rounds} '
          f'interleaved rounds after {args.warmups} warm-ups')
    results = {}
    for setting in args.settings.split(','):
        seen = run_child(setting, args)
        results[setting] = {tuple(row[:3]): row[3] for row in seen['ms']}
        cpu = {tuple(row[:3]): row[4] for row in seen['ms']}
        print(f'TF_ENABLE_ONEDNN_OPTS={setting} (oneDNN {"on" if seen["onednn"] else "off"}, '
              f'intra/inter {seen["threads"][0]}/{seen["threads"][1]})')
        for model in args.models.split(','):
            for k in args.cells.split(','):
                ms = {int(m): results[setting][(model, int(k), int(m))]
                      for m in args.micro.split(',')}
                base = ms[min(ms)]
                row = ' '.join(f'M={m} {v:6.1f}' for m, v in ms.items())
                ratios = ' '.join(f'M={m}/M=1 {v / base:.2f}' for m, v in ms.items() if m > 1)
                cpu_ms = {int(m): cpu[(model, int(k), int(m))] for m in args.micro.split(',')}
                cpu_row = ' '.join(f'{v:.0f}' for v in cpu_ms.values())
                print(f'  {model:12s} K={k}: {row} | {ratios} | CPU ms {cpu_row}')
    if len(results) > 1:
        print('against the faster setting\'s M=1 (goal <= 1.10 at M=8):')
        for model in args.models.split(','):
            for k in args.cells.split(','):
                best = min(r[(model, int(k), 1)] for r in results.values())
                row = '; '.join(
                    f'{s}: ' + ' '.join(f'M={m} {r[(model, int(k), int(m))] / best:.2f}'
                                        for m in args.micro.split(',') if int(m) > 1)
                    for s, r in results.items())
                print(f'  {model:12s} K={k}: {row}')
    print(f'load after: {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
    main()
