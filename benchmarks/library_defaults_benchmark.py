"""tfpipe library defaults benchmark: a library user's step with nothing set, against
each oneDNN kernel setting, side by side.

TensorFlow 2.21 turns oneDNN's CPU kernels on by itself only on some CPUs; the
trainer and, since tfpipe/runtime_defaults.py, `import tfpipe` before TensorFlow
turn them on unless the user chose. This script runs the README's library order
(`import tfpipe`, `configure_logical_cpus(8)`, then TensorFlow) on 8 x Dense(1024)
relu, batch 256, recompute, K auto-balanced cells, SGD, one process per setting
(TensorFlow reads the kernel setting once per process):

- `default`: nothing set (what a library user gets);
- `onednn=1` / `onednn=0`: TF_ENABLE_ONEDNN_OPTS set by the user;
- `tf_first`: TensorFlow imported before tfpipe with nothing set (the late import
  tfpipe cannot fix, and warns about when it leaves oneDNN off).

All the settings' processes stay alive and take turns step by step (lock-step:
one runs a step while the others wait on their pipe), in a new random order each
round, so every setting's step n sees the same moment of a shared machine's load.
It prints, per config, each setting's median step (wall ms and CPU ms, getrusage,
after 3 warm-ups) and the median over rounds of `default` over the fastest of
`onednn=1` and `onednn=0` (by median wall time) in the same round (goal: within 1.05),
wall and CPU.

Run (from the repository root; about 2 minutes per config at 20 rounds, quiet):
    PYTHONPATH=. python benchmarks/library_defaults_benchmark.py
    PYTHONPATH=. python benchmarks/library_defaults_benchmark.py --configs=2x8,4x8 --rounds=40
    git archive main | tar -x -C /tmp/main && PYTHONPATH=. python \
        benchmarks/library_defaults_benchmark.py --settings=default,onednn=0 --baseline=/tmp/main
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

SETTINGS = {'default': {}, 'onednn=1': {'TF_ENABLE_ONEDNN_OPTS': '1'},
            'onednn=0': {'TF_ENABLE_ONEDNN_OPTS': '0'}, 'tf_first': {}}

CHILD = """
import json, resource, sys, time
{first}
import tfpipe
tfpipe.configure_logical_cpus(8)
import tensorflow as tf
from tfpipe import fprop_context, layers, runtime_defaults


def build(num_cells, num_micro):
    body = [layers.Dense.Params().Set(name=f'fc{{i}}', input_dim=1024, output_dim=1024,
                                      activation='relu') for i in range(8)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name=f'pipe{{num_cells}}x{{num_micro}}', body=body, num_cells=num_cells,
        num_micro_batches=num_micro, recompute='always').Instantiate()

    def loss_fn(outputs, targets):
        return tf.reduce_mean(tf.square(outputs), axis=-1)

    @tf.function
    def step(x):
        with fprop_context.training(step=tf.constant(0, tf.int64)):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, x)
        for var, grad in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            var.assign_sub(0.01 * grad)
        return loss
    return step


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


x = tf.random.normal([256, 1024])
steps = {{config: build(*config) for config in {configs}}}
for step in steps.values():
    for _ in range(3):
        step(x).numpy()
print(json.dumps({{'onednn': runtime_defaults.onednn_enabled()}}), flush=True)
for line in sys.stdin:
    step = steps[tuple(json.loads(line))]
    used, start = cpu_seconds(), time.perf_counter()
    step(x).numpy()
    print(json.dumps([1000 * (time.perf_counter() - start), 1000 * (cpu_seconds() - used)]),
          flush=True)
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--configs', default='2x1,2x4,2x8,4x8', help='KxM, comma-separated')
    ap.add_argument('--rounds', type=int, default=20)
    ap.add_argument('--settings', default=','.join(SETTINGS),
                    help=f'which of {list(SETTINGS)}')
    ap.add_argument('--baseline', default='', help='another checkout of tfpipe (e.g. '
                    'a `git archive` of main): adds its `default` as `baseline`, in turn '
                    'with the others, and prints this tree\'s default over it')
    return ap.parse_args(argv)


def start_child(setting: str, configs: list[tuple[int, int]], repo: str) -> subprocess.Popen:
    """One process with this kernel setting, running `repo`'s tfpipe, its steps built
    and warmed up."""
    env = {k: v for k, v in os.environ.items()
           if k not in ('TF_ENABLE_ONEDNN_OPTS', 'TF_CPU_ALLOCATOR_USE_BFC')}
    env.update(SETTINGS.get(setting, {}), TF_CPP_MIN_LOG_LEVEL='3',
               PYTHONPATH=repo + os.pathsep + os.environ.get('PYTHONPATH', ''))
    first = 'import tensorflow' if setting == 'tf_first' else ''
    code = CHILD.format(first=first, configs=configs)
    return subprocess.Popen([sys.executable, '-c', code], env=env, cwd=repo, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def read_line(child: subprocess.Popen, setting: str):
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f'the {setting} process exited with status {child.wait()}')
    return json.loads(line)


def main(argv=None) -> None:
    args = parse_args(argv)
    configs = [tuple(int(v) for v in c.split('x')) for c in args.configs.split(',')]
    settings = args.settings.split(',')
    print(f'load: {os.getloadavg()[0]:.1f}; {args.rounds} lock-step rounds, settings in a '
          'random order each round; median wall ms / CPU ms (oneDNN on?)')
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    children = {name: start_child(name, configs, repo) for name in settings}
    if args.baseline:
        children['baseline'] = start_child('baseline', configs, os.path.abspath(args.baseline))
        settings.append('baseline')
    try:
        onednn = {name: read_line(child, name)['onednn'] for name, child in children.items()}
        for config in configs:
            seen = {name: [] for name in settings}
            for _ in range(args.rounds):
                for name in random.sample(settings, len(settings)):
                    children[name].stdin.write(json.dumps(config) + '\n')
                    children[name].stdin.flush()
                    seen[name].append(read_line(children[name], name))
            report(config, seen, onednn)
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=60)
    print(f'load after: {os.getloadavg()[0]:.1f}')


def report(config, seen: dict, onednn: dict) -> None:
    """One line per config: each setting's medians, then default over the fastest kernel
    setting (by median wall time), as the median of the per-round ratios."""
    median = {name: [statistics.median(s[i] for s in v) for i in (0, 1)]
              for name, v in seen.items()}
    row = ', '.join(f'{name} {w:.0f}/{c:.0f} ({"on" if onednn[name] else "off"})'
                    for name, (w, c) in median.items())
    line = f'K={config[0]} M={config[1]}: {row}'
    if {'default', 'onednn=1', 'onednn=0'} <= seen.keys():
        fastest = min(('onednn=1', 'onednn=0'), key=lambda name: median[name][0])
        ratios = [[d[i] / f[i] for i in (0, 1)] for d, f in zip(seen['default'], seen[fastest])]
        line += (f'; default / {fastest} (the fastest), median per round: wall '
                 f'{statistics.median(r[0] for r in ratios):.2f}, CPU '
                 f'{statistics.median(r[1] for r in ratios):.2f}')
    if {'default', 'baseline'} <= seen.keys():
        ratios = [[d[i] / b[i] for i in (0, 1)] for d, b in zip(seen['default'], seen['baseline'])]
        line += (f'; default / baseline: wall {statistics.median(r[0] for r in ratios):.2f}, '
                 f'CPU {statistics.median(r[1] for r in ratios):.2f}')
    print(line, flush=True)


if __name__ == '__main__':
    main()
