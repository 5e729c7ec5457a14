"""fprop_dtype=bfloat16 vs float32: step time and bytes sent between cells.

The default trainer model's pipeline (AmoebaNet-style body on 16x16x3 images,
batch 32, K=4, M=4, recompute on), one ForwardBackward + SGD step per call.
Both variants are built once, warmed up and timed in interleaved rounds; the
ratio is computed per round (paired). Bytes between cells count, per step,
every activation a cell sends forward plus the gradient it gets back, summed
over the K-1 cell boundaries and the M micro-batches.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/bfloat16_benchmark.py [--rounds=7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import tfpipe

tfpipe.configure_logical_cpus(8)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpipe import fprop_context  # noqa: E402
from tfpipe.bodies import amoebanet_body  # noqa: E402
from tfpipe.pipeline import microbatch  # noqa: E402
from tfpipe.pipeline.pipelining_layer import PipeliningLayer  # noqa: E402

BATCH, SIZE, K, M = 32, 16, 4, 4


def build(fprop_dtype):
    pipe = PipeliningLayer.Params().Set(
        name='pipe', body=amoebanet_body(4), num_cells=K, partition_by='flops',
        input_shape=[BATCH, SIZE, SIZE, 3], num_micro_batches=M, recompute='always',
        fprop_dtype=fprop_dtype).Instantiate()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.uniform(size=[BATCH, SIZE, SIZE, 3]), tf.float32)
    y = tf.constant(rng.integers(0, 4, [BATCH]), tf.int32)
    step = tf.Variable(0, dtype=tf.int64)

    def loss_fn(logits, labels):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    @tf.function
    def train_step():
        with fprop_context.training(step=step):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, y)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(0.01 * g)
        step.assign_add(1)
        return loss
    return pipe, x, train_step


def bytes_between_cells(pipe, x) -> int:
    """Forward activations plus their gradients crossing each cell boundary, per step."""
    total = 0
    with fprop_context.evaluation():
        for mb in microbatch.split(x, M):
            for cell in pipe.cells[:-1]:
                mb = cell.forward(cell.read_theta(pipe.theta), mb)
                total += 2 * sum(t.shape.num_elements() * t.dtype.size
                                 for t in tf.nest.flatten(mb))
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--calls', type=int, default=5)
    args = parser.parse_args()
    variants = {'float32': build(None), 'bfloat16': build(tf.bfloat16)}
    for _, _, train_step in variants.values():
        for _ in range(2):
            train_step()
    times = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants)[::1 if r % 2 == 0 else -1]
        for name in order:
            train_step = variants[name][2]
            start = time.perf_counter()
            for _ in range(args.calls):
                train_step()
            times[name].append((time.perf_counter() - start) / args.calls)
    ratios = [b / f for f, b in zip(times['float32'], times['bfloat16'])]
    print(f'AmoebaNet body, batch {BATCH}, K={K}, M={M}, recompute always; '
          f'{args.rounds} interleaved rounds x {args.calls} steps')
    for name, (pipe, x, _) in variants.items():
        print(f'{name:9s} step {statistics.median(times[name]) * 1e3:7.1f} ms   '
              f'between cells {bytes_between_cells(pipe, x) / 1024:8.1f} KiB/step')
    print(f'bfloat16 / float32 step time: median {statistics.median(ratios):.2f}x '
          f'(per-round min {min(ratios):.2f}, max {max(ratios):.2f})')


if __name__ == '__main__':
    main()
