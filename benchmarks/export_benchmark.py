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

For each language model: the same size and readiness, and the latency of greedy
generation (a prompt of 16 tokens, 32 new ones, batch 1 and 8): the exported
`generate` (cached steps in one tf.while_loop) vs the decoder's
`Generator.generate` (one traced cached step per token), tokens checked equal.

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

from tfpipe import checkpoints, fprop_context, lm_inputs  # noqa: E402
from trainer import experiment  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES = (1, 32)
LM_BATCHES = (1, 8)
LM_PROMPT, LM_NEW_TOKENS = 16, 32


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


def trained_export(model: str, steps: int, data_dir: str, work: str) -> tuple[str, str, list]:
    """(logdir, SavedModel, checkpoint files) after `steps` trainer steps and an export."""
    logdir = os.path.join(work, model)
    trainer(model, logdir, data_dir, '--job=trainer', f'--max_steps={steps}',
            f'--gin_bindings=trainer.save_interval_steps={steps}')
    trainer(model, logdir, data_dir, '--mode=export')
    checkpoint = checkpoints.latest(os.path.join(logdir, 'train'))
    saved_model = os.path.join(logdir, 'export', str(checkpoints.step_of(checkpoint)))
    return logdir, saved_model, tf.io.gfile.glob(checkpoint + '.*')


def print_size(saved_model: str, ckpt_files: list) -> None:
    print(f'  size on disk      SavedModel {du([saved_model]) / 2**20:7.2f} MiB   checkpoint '
          f'{du(ckpt_files) / 2**20:7.2f} MiB   ratio {du([saved_model]) / du(ckpt_files):.2f}')


def bench_lm(model: str, steps: int, rounds: int, data_dir: str, work: str) -> None:
    logdir, saved_model, ckpt_files = trained_export(model, steps, data_dir, work)
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(2, 200, size=[b, LM_PROMPT]).astype(np.int32) for b in LM_BATCHES}
    start = time.perf_counter()
    generate = tf.saved_model.load(saved_model).signatures['generate']
    exported_load = time.perf_counter() - start
    new = tf.constant(LM_NEW_TOKENS)

    def exported(b):
        return generate(prompt=tf.constant(prompts[b]), num_new_tokens=new)['ids'].numpy()
    exported_first = timed(exported, 1)
    start = time.perf_counter()
    params = experiment.saved_train_params(os.path.join(logdir, 'train'),
                                           experiment.load_params(model))
    task = params.task.Instantiate()
    checkpoints.restore(checkpoints.make(task.VariablesByPath()),
                        checkpoints.latest(os.path.join(logdir, 'train')), partial=True)
    decoder_build = time.perf_counter() - start
    starts = {b: np.concatenate([np.full([b, 1], lm_inputs.EOD_ID, np.int32), prompts[b]], 1)
              for b in LM_BATCHES}

    def decoder(b):
        return task.generator.generate(task.theta['pipe'], starts[b], LM_NEW_TOKENS)[0].numpy()
    decoder_first = timed(decoder, 1)
    for b in LM_BATCHES:
        np.testing.assert_array_equal(exported(b), decoder(b))
    print(f'\n{model}: {os.path.basename(ckpt_files[0]).split(".")[0]}, generate '
          f'{LM_NEW_TOKENS} tokens after {LM_PROMPT}')
    print_size(saved_model, ckpt_files)
    compare(exported, decoder, 'decoder generate', LM_BATCHES, rounds,
            (exported_load, exported_first, decoder_build, decoder_first))


def compare(exported, reference, name: str, batches, rounds: int, ready: tuple) -> None:
    """Prints readiness, then medians of `rounds` interleaved calls of exported(b) and
    reference(b) per batch size b. ready: (load, first call, build + restore, first call)."""
    print(f'  ready             load {ready[0]:6.2f} s + first call {ready[1]:6.2f} s'
          f'   vs build + restore {ready[2]:6.2f} s + first call (traces) {ready[3]:6.2f} s')
    times = {(kind, b): [] for kind in ('exported', name) for b in batches}
    for _ in range(rounds):
        for b in batches:
            times['exported', b].append(timed(exported, b))
            times[name, b].append(timed(reference, b))
    for b in batches:
        e = statistics.median(times['exported', b]) * 1e3
        r = statistics.median(times[name, b]) * 1e3
        print(f'  batch {b:3d}         exported {e:8.2f} ms   {name} {r:8.2f} ms   '
              f'ratio {e / r:.2f}  (medians of {rounds})')


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bench(model: str, steps: int, rounds: int, data_dir: str, work: str) -> None:
    logdir, saved_model, ckpt_files = trained_export(model, steps, data_dir, work)
    checkpoint = checkpoints.latest(os.path.join(logdir, 'train'))
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
    pipe = experiment.saved_train_params(os.path.join(logdir, 'train'),
                                         experiment.load_params(model)).task.pipeline
    print(f'\n{model}: {os.path.basename(checkpoint)}, the evaler at the trained '
          f'K={len(pipe.balance or [None] * pipe.num_cells)}, M={pipe.num_micro_batches}')
    print_size(saved_model, ckpt_files)
    compare(lambda b: serve(image=images[b])['probabilities'].numpy(),
            lambda b: forward(images[b]).numpy(), 'evaler FProp', BATCHES, rounds,
            (exported_load, exported_first, evaler_build, evaler_first))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', default='image.shapes.AmoebaNetPipe,image.shapes.SmallConvPipe')
    parser.add_argument('--lm_models', default='lm.pystdlib.TinyTransformerLM')
    parser.add_argument('--steps', type=int, default=2, help='training steps before export')
    parser.add_argument('--rounds', type=int, default=30)
    parser.add_argument('--data_dir', default=None, help='tfds data dir (default: a temporary '
                        'one; the datasets are generated)')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        data_dir = args.data_dir or os.path.join(work, 'tfds')
        for model in filter(None, args.models.split(',')):
            bench(model, args.steps, args.rounds, data_dir, work)
        for model in filter(None, args.lm_models.split(',')):
            bench_lm(model, args.steps, args.rounds, data_dir, work)
    print(f'\nload average: {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
    main()
