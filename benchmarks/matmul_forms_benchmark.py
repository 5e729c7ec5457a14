"""tfpipe matmul forms benchmark: what each form of Dense's input gradient costs, per
kernel setting.

Dense's input gradient dy @ w^T (tfpipe/layers/dense.py, `input_gradient`) can be
written several ways that compute the same products and sums; on the few rows of a
micro-batch their costs differ by up to 9x, and which is cheapest depends on the
kernels (TF_ENABLE_ONEDNN_OPTS, read once per process). One child process per
setting times, for each [rows, in, out] shape, one thread per op and one op at a
time (a chain of 8 calls inside a tf.function, 3 warm-ups, median of 11), the CPU
time per call (getrusage) of:

- `tf`: MatMul(dy, w, transpose_b=True), TensorFlow's gradient;
- `eigen_form`: (w @ dy^T)^T, Dense's form (with oneDNN on fewer rows);
- `bmm`: BatchMatMulV2(dy, w, adj_y=True), oneDNN's fastest, which Dense does not
  use: its dx, as fast as `dw`, raised the step's peak (tfpipe/layers/dense.py);
- `dw`: x^T @ dy, the weight gradient, for scale.

It prints the CPU ms of each form and its ratio to `tf`.

Run (from the repository root; about 1 minute per setting on 2 quiet cores):
    PYTHONPATH=. python benchmarks/matmul_forms_benchmark.py
    PYTHONPATH=. python benchmarks/matmul_forms_benchmark.py --shapes=64,1024,1024 --settings=1
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

SHAPES = '32,1024,1024;64,1024,1024;256,1024,1024;1024,1024,1024;64,256,1024;64,1024,256'
CHAIN = 8


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--settings', default='0,1', help='TF_ENABLE_ONEDNN_OPTS values')
    ap.add_argument('--shapes', default=SHAPES, help='rows,in,out;...')
    ap.add_argument('--child', action='store_true', help='internal: measure in this process')
    return ap.parse_args(argv)


def forms():
    import tensorflow as tf
    return {
        'tf': lambda x, dy, w: tf.matmul(dy, w, transpose_b=True),
        'eigen_form': lambda x, dy, w: tf.transpose(tf.matmul(w, dy, transpose_b=True)),
        'bmm': lambda x, dy, w: tf.raw_ops.BatchMatMulV2(x=dy, y=w, adj_x=False, adj_y=True),
        'dw': lambda x, dy, w: tf.matmul(x, dy, transpose_a=True),
    }


def cpu_ms_per_call(fn, x, dy, w) -> float:
    """Median CPU ms of one call, over a chain of calls that run one after another."""
    import tensorflow as tf

    @tf.function
    def chain(xs, dys):
        out = []
        for i in range(CHAIN):
            with tf.control_dependencies(out[-1:]):
                out.append(fn(tf.identity(xs[i]), tf.identity(dys[i]), w))
        return out

    xs, dys = [x] * CHAIN, [dy] * CHAIN
    for _ in range(3):
        chain(xs, dys)
    times = []
    for _ in range(11):
        used = _cpu_seconds()
        chain(xs, dys)
        times.append(1000 * (_cpu_seconds() - used) / CHAIN)
    return statistics.median(times)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(args) -> None:
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tfpipe import runtime_defaults
    rows = []
    for shape in args.shapes.split(';'):
        r, fan_in, fan_out = (int(v) for v in shape.split(','))
        x = tf.random.stateless_normal([r, fan_in], [1, 2])
        dy = tf.random.stateless_normal([r, fan_out], [3, 4])
        w = tf.random.stateless_normal([fan_in, fan_out], [5, 6])
        rows.append([shape, {name: cpu_ms_per_call(fn, x, dy, w)
                             for name, fn in forms().items()}])
    print(json.dumps({'onednn': runtime_defaults.onednn_enabled(), 'rows': rows}))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f'load: {os.getloadavg()[0]:.1f}; CPU ms per call, one thread (ratio to tf)')
    for setting in args.settings.split(','):
        env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=setting, TF_CPP_MIN_LOG_LEVEL='3',
                   PYTHONPATH=repo + os.pathsep + os.environ.get('PYTHONPATH', ''))
        done = subprocess.run([sys.executable, os.path.abspath(__file__), '--child',
                               f'--shapes={args.shapes}'], env=env, cwd=repo,
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        print(f'TF_ENABLE_ONEDNN_OPTS={setting} (oneDNN {"on" if seen["onednn"] else "off"})')
        for shape, ms in seen['rows']:
            row = ' '.join(f'{name} {v:.3f} ({v / ms["tf"]:.2f})' for name, v in ms.items())
            print(f'  [{shape}]: {row}')
    print(f'load after: {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
    main()
