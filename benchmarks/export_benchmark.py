"""An exported SavedModel beside the evaler's FProp: size on disk, time to get ready, latency.

For each image model: train a few steps (the trainer binary, in a temporary
logdir), export the newest checkpoint (`--mode=export`, one_device), then in this
process, side by side:
- size: the SavedModel directory vs the checkpoint's files (ckpt-N.*: weights
  plus optimizer slots, step and input position);
- ready: `tf.saved_model.load` + first call vs building the task, restoring the
  checkpoint and the first call of the evaler's FProp (its trace);
- latency per batch of 1 and 32: the exported `serving_default` vs the evaler's
  FProp (`task.ComputePredictions` in evaluation mode, the trained K and M, softmax),
  medians of interleaved rounds, and their ratio.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/export_benchmark.py [--rounds=30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import tfpipe

tfpipe.configure_logical_cpus(8)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpipe import checkpoints, fprop_context  # noqa: E402
from trainer import experiment  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES = (1, 32)


def trainer(model: str, logdir: str, data_dir: str, *flags: str) -> None:
    env = {**os.environ, 'PYTHONPATH': REPO, 'TF_CPP_MIN_LOG_LEVEL': '2'}
    result = subprocess.run([sys.executable, '-m', 'trainer', f'--model={model}',
                             f'--logdir={logdir}', f'--tfds_data_dir={data_dir}', *flags],
                            env=env, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])


def du(paths: list[str]) -> int:
    total = 0
    for path in paths:
        if os.path.isfile(path):
            total += os.path.getsize(path)
        for root, _, files in os.walk(path):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def evaler_forward(logdir: str, model: str, checkpoint: str):
    """The evaler's forward, built and restored as an evaler builds it."""
    train_dir = os.path.join(logdir, 'train')
    params = experiment.saved_train_params(train_dir, experiment.load_params(model))
    task = params.task.Instantiate()
    checkpoints.restore(checkpoints.make(task.VariablesByPath()), checkpoint, partial=True)

    @tf.function
    def forward(image):
        with fprop_context.evaluation():
            return tf.nn.softmax(task.ComputePredictions(task.theta, {'image': image}))
    return forward


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bench(model: str, steps: int, rounds: int, data_dir: str, work: str) -> None:
    logdir = os.path.join(work, model)
    trainer(model, logdir, data_dir, '--job=trainer', f'--max_steps={steps}',
            f'--gin_bindings=trainer.save_interval_steps={steps}')
    trainer(model, logdir, data_dir, '--mode=export')
    checkpoint = checkpoints.latest(os.path.join(logdir, 'train'))
    saved_model = os.path.join(logdir, 'export', str(checkpoints.step_of(checkpoint)))
    ckpt_files = tf.io.gfile.glob(checkpoint + '.*')
    shape = tf.saved_model.load(saved_model).signatures['serving_default'] \
        .structured_input_signature[1]['image'].shape[1:]
    rng = np.random.default_rng(0)
    images = {b: tf.constant(rng.uniform(size=[b, *shape]), tf.float32) for b in BATCHES}

    def load_exported():
        return tf.saved_model.load(saved_model).signatures['serving_default']

    start = time.perf_counter()
    serve = load_exported()
    exported_load = time.perf_counter() - start
    exported_first = timed(lambda: serve(image=images[1])['probabilities'].numpy())
    start = time.perf_counter()
    forward = evaler_forward(logdir, model, checkpoint)
    evaler_build = time.perf_counter() - start
    evaler_first = timed(lambda: forward(images[1]).numpy())
    for b in BATCHES:  # warm up: every shape traced and run once
        forward(images[b]).numpy()
        serve(image=images[b])['probabilities'].numpy()
        np.testing.assert_allclose(serve(image=images[b])['probabilities'].numpy(),
                                   forward(images[b]).numpy(), rtol=1e-5, atol=1e-5)
    times = {(kind, b): [] for kind in ('exported', 'evaler') for b in BATCHES}
    for _ in range(rounds):
        for b in BATCHES:
            times['exported', b].append(timed(
                lambda: serve(image=images[b])['probabilities'].numpy()))
            times['evaler', b].append(timed(lambda: forward(images[b]).numpy()))
    pipe = experiment.saved_train_params(os.path.join(logdir, 'train'),
                                         experiment.load_params(model)).task.pipeline
    print(f'\n{model}: {os.path.basename(checkpoint)}, the evaler at the trained '
          f'K={len(pipe.balance or [None] * pipe.num_cells)}, M={pipe.num_micro_batches}')
    print(f'  size on disk      SavedModel {du([saved_model]) / 2**20:7.2f} MiB   checkpoint '
          f'{du(ckpt_files) / 2**20:7.2f} MiB   ratio {du([saved_model]) / du(ckpt_files):.2f}')
    print(f'  ready             load {exported_load:6.2f} s + first call {exported_first:6.2f} s'
          f'   vs build + restore {evaler_build:6.2f} s + first call (trace) '
          f'{evaler_first:6.2f} s')
    for b in BATCHES:
        e = statistics.median(times['exported', b]) * 1e3
        f = statistics.median(times['evaler', b]) * 1e3
        print(f'  batch {b:3d}         exported {e:8.2f} ms   evaler FProp {f:8.2f} ms   '
              f'ratio {e / f:.2f}  (medians of {rounds})')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', default='image.shapes.AmoebaNetPipe,image.shapes.SmallConvPipe')
    parser.add_argument('--steps', type=int, default=2, help='training steps before export')
    parser.add_argument('--rounds', type=int, default=30)
    parser.add_argument('--data_dir', default=None, help='tfds data dir (default: a temporary '
                        'one; the datasets are generated)')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        data_dir = args.data_dir or os.path.join(work, 'tfds')
        for model in args.models.split(','):
            bench(model, args.steps, args.rounds, data_dir, work)
    print(f'\nload average: {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
    main()
