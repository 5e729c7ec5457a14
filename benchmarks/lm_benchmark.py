"""The language model: generation with and without the KV cache, step time by K and dtype.

1. Generation, tokens/s, cached vs uncached (a forward over the whole context
   window per token), 64 and 256 new tokens after a 16-token prompt, batch 1,
   on lm.pystdlib.TransformerLM's sizes and K=2 with a context of 320
   positions; random weights (speed does not depend on them).
2. Training step time of lm.pystdlib.TransformerLM's pipeline (its batch, rows
   and M, recompute) at K=1, 2 and 4 on logical CPUs, and at K=2 with every
   layer in bfloat16; ratios to K=1 float32 per round (paired, interleaved).
3. --default_run: trains lm.pystdlib.TransformerLM with its default params in a
   subprocess (trainer + evaler_dev) and prints its dev perplexity, the unigram
   perplexity of the same dev rows and the wall time.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/lm_benchmark.py [--rounds=5]
        [--sections=1,2,3]
"""
from __future__ import annotations

import argparse
import math
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

import model_registry  # noqa: E402
from tfpipe import bodies, fprop_context, inputs, lm_inputs  # noqa: E402
from tfpipe.pipeline import partition  # noqa: E402

MODEL = 'lm.pystdlib.TransformerLM'
PROMPT, CONTEXT = 16, 320


def lm_task(num_cells: int, fprop_dtype=None, context: int | None = None):
    """The registered model's task at K=num_cells (optionally another context length)."""
    p = model_registry.get_params(MODEL).task
    if context is not None:
        model_dim, hidden_dim, heads, blocks = model_registry.get_class(MODEL).SIZES
        p.pipeline.body = bodies.transformer_lm_body(inputs.BYTE_VOCAB_SIZE, context,
                                                     model_dim, hidden_dim, heads, blocks)
    for layer in p.pipeline.body:
        layer.fprop_dtype = fprop_dtype
    p.pipeline.balance = partition.even_balance(len(p.pipeline.body), num_cells)
    return p.Instantiate()


def generation_speed(rounds: int) -> None:
    task = lm_task(2, context=CONTEXT)
    rng = np.random.default_rng(0)
    prompt = tf.constant(rng.integers(2, 258, [1, PROMPT]), tf.int32)
    print(f'1. generation, batch 1, prompt {PROMPT}, {MODEL} sizes, K=2: tokens/s (median of '
          f'{rounds})')
    for cached in (True, False):
        task.generator.generate(task.theta['pipe'], prompt, 4, cached=cached)  # trace
    for new in (64, 256):
        times = {True: [], False: []}
        for r in range(rounds):  # interleaved, alternating which goes first
            for cached in ((True, False) if r % 2 == 0 else (False, True)):
                start = time.perf_counter()
                task.generator.generate(task.theta['pipe'], prompt, new, cached=cached)
                times[cached].append(time.perf_counter() - start)
        ratios = [u / c for c, u in zip(times[True], times[False])]
        print(f'   {new:3d} new tokens: cached {new / statistics.median(times[True]):7.1f}  '
              f'uncached {new / statistics.median(times[False]):7.1f}  ratio '
              f'{statistics.median(ratios):4.1f}x [{min(ratios):.1f}-{max(ratios):.1f}]')


def step_times(rounds: int) -> None:
    params = model_registry.get_params(MODEL)
    batch = next(iter(params.input.train.Instantiate().Dataset()))
    variants = {'K=1': (1, None), 'K=2': (2, None), 'K=4': (4, None),
                'K=2 bfloat16': (2, tf.bfloat16)}
    steps = {}
    for name, (k, dtype) in variants.items():
        task = lm_task(k, dtype)

        @tf.function
        def step(task=task):
            with fprop_context.training(step=1):
                loss, grads = task.ForwardBackward(task.theta, batch)
            for v, g in zip(tf.nest.flatten(task.theta), tf.nest.flatten(grads)):
                v.assign_sub(1e-4 * tf.convert_to_tensor(g))
            return loss
        step()
        steps[name] = step
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            start = time.perf_counter()
            steps[name]().numpy()
            times[name].append(time.perf_counter() - start)
    shape = batch['inputs'].shape.as_list()
    print(f'2. training step of {MODEL} (batch {shape}, M={params.task.pipeline.num_micro_batches}'
          f'), median of {rounds} paired rounds')
    for name in steps:
        ratios = [t / base for t, base in zip(times[name], times['K=1'])]
        print(f'   {name:13s} {1000 * statistics.median(times[name]):7.1f} ms   '
              f'x{statistics.median(ratios):.2f} of K=1 [{min(ratios):.2f}-{max(ratios):.2f}]')


def default_run() -> None:
    params = model_registry.get_params(MODEL)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, TF_CPP_MIN_LOG_LEVEL='2')
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run([sys.executable, '-m', 'trainer', f'--model={MODEL}',
                        f'--logdir={tmp}/run', '--job=trainer,evaler_dev'], env=env, cwd=repo,
                       check=True, capture_output=True)
        seconds = time.perf_counter() - start
        steps = params.task.train.max_steps
        with open(f'{tmp}/run/eval_dev/score-{steps}.txt') as f:
            score = dict(line.strip().split(': ') for line in f)
    num_rows = params.task.eval.samples_per_summary
    unigram = lm_inputs.unigram_log_perplexity(
        params.input.dev.Instantiate().EvalDataset(num_rows), inputs.BYTE_VOCAB_SIZE)
    print(f'3. {MODEL}, default run ({steps} steps, trainer + evaler_dev): {seconds:.0f} s')
    print(f'   dev perplexity {float(score["perplexity"]):.2f} (log {float(score["log_pplx"]):.3f}'
          f', next-byte accuracy {float(score["accuracy"]):.3f}) on {score["num_examples"]} '
          f'rows; unigram perplexity of the same rows {math.exp(unigram):.2f} '
          f'(log {unigram:.3f})')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--sections', default='1,2,3')
    args = parser.parse_args()
    sections = set(args.sections.split(','))
    print(f'load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} cores, 8 logical CPUs')
    if '1' in sections:
        generation_speed(args.rounds)
    if '2' in sections:
        step_times(args.rounds)
    if '3' in sections:
        default_run()


if __name__ == '__main__':
    main()
