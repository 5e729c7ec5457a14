"""tfpipe library defaults benchmark: a library user's step with nothing set, against
each oneDNN kernel setting, side by side.

TensorFlow 2.21 turns oneDNN's CPU kernels on by itself only on some CPUs; the
trainer and, since tfpipe/runtime_defaults.py, `import tfpipe` before TensorFlow
turn them on unless the user chose. This script runs the README's library order
(`import tfpipe`, `configure_logical_cpus(8)`, then TensorFlow) on 8 x Dense(1024)
relu, batch 256, recompute, K auto-balanced cells, SGD, in a fresh process per
setting and round, settings alternating:

- `default`: nothing set (what a library user gets);
- `onednn=1` / `onednn=0`: TF_ENABLE_ONEDNN_OPTS set by the user;
- `tf_first`: TensorFlow imported before tfpipe with nothing set (the late import
  tfpipe cannot fix, and warns about when it leaves oneDNN off).

It prints the median step (ms, 3 warm-ups then 10 steps) of each and the ratio of
`default` to the fastest setting (goal: within 1.05).

Run (from the repository root; about 1 minute per config and round):
    PYTHONPATH=. python benchmarks/library_defaults_benchmark.py
    PYTHONPATH=. python benchmarks/library_defaults_benchmark.py --configs=2x8,4x8 --rounds=3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {'default': {}, 'onednn=1': {'TF_ENABLE_ONEDNN_OPTS': '1'},
            'onednn=0': {'TF_ENABLE_ONEDNN_OPTS': '0'}, 'tf_first': {}}

CHILD = """
import json, sys, time
{first}
import tfpipe
tfpipe.configure_logical_cpus(8)
import tensorflow as tf
from tfpipe import fprop_context, layers

num_cells, num_micro = {cells}, {micro}
body = [layers.Dense.Params().Set(name=f'fc{{i}}', input_dim=1024, output_dim=1024,
                                  activation='relu') for i in range(8)]
pipe = tfpipe.PipeliningLayer.Params().Set(
    name='pipe', body=body, num_cells=num_cells, num_micro_batches=num_micro,
    recompute='always').Instantiate()

def loss_fn(outputs, targets):
    return tf.reduce_mean(tf.square(outputs), axis=-1)

@tf.function
def step(x):
    with fprop_context.training(step=tf.constant(0, tf.int64)):
        loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, x)
    for var, grad in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
        var.assign_sub(0.01 * grad)
    return loss

x = tf.random.normal([256, 1024])
for _ in range(3):
    step(x).numpy()
times = []
for _ in range(10):
    start = time.perf_counter()
    step(x).numpy()
    times.append(time.perf_counter() - start)
times.sort()
from tfpipe import runtime_defaults
print(json.dumps({{'ms': 1000 * times[len(times) // 2],
                  'onednn': runtime_defaults.onednn_enabled()}}))
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--configs', default='2x1,2x8,4x8', help='KxM, comma-separated')
    ap.add_argument('--rounds', type=int, default=2)
    return ap.parse_args(argv)


def run_child(setting: str, cells: int, micro: int) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ('TF_ENABLE_ONEDNN_OPTS', 'TF_CPU_ALLOCATOR_USE_BFC')}
    env.update(SETTINGS[setting], TF_CPP_MIN_LOG_LEVEL='3',
               PYTHONPATH=repo + os.pathsep + os.environ.get('PYTHONPATH', ''))
    first = 'import tensorflow' if setting == 'tf_first' else ''
    code = CHILD.format(first=first, cells=cells, micro=micro)
    done = subprocess.run([sys.executable, '-c', code], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f'load: {os.getloadavg()[0]:.1f}; median step ms (oneDNN on?), {args.rounds} '
          'rounds, settings alternating')
    for config in args.configs.split(','):
        cells, micro = (int(v) for v in config.split('x'))
        results = {name: [] for name in SETTINGS}
        onednn = {}
        for _ in range(args.rounds):
            for name in SETTINGS:
                seen = run_child(name, cells, micro)
                results[name].append(seen['ms'])
                onednn[name] = seen['onednn']
        medians = {name: statistics.median(v) for name, v in results.items()}
        fastest = min(medians['onednn=1'], medians['onednn=0'])
        row = ', '.join(f'{name} {medians[name]:.0f} ({"on" if onednn[name] else "off"})'
                        for name in SETTINGS)
        print(f'K={cells} M={micro}: {row}; default / fastest setting '
              f'{medians["default"] / fastest:.2f}')


if __name__ == '__main__':
    main()
