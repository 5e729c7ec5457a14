"""Data parallel x pipeline: R=2 x K=2 against R=1 x K=2 at the same per-replica batch.

Prints, side by side from interleaved rounds in one run:
  - step time and examples/s of R=1 and R=2 (R=2 does twice the examples per step);
  - the all-reduce's share of the R=2 step: the same collectives alone, on tensors of
    the gradients' shapes and devices, timed in the same rounds.

On this 2-core machine every logical CPU shares two cores, so R=2 cannot process more
examples per second than R=1: the figures say what replication costs here (the
all-reduce and the larger graph), not what it gains on real devices.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/replicas_benchmark.py            # about a minute
    PYTHONPATH=. python benchmarks/replicas_benchmark.py --quick    # about 20 s
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
ap.add_argument('--quick', action='store_true')
ap.add_argument('--layers', type=int, default=8)
ap.add_argument('--width', type=int, default=None, help='default 1024 (quick: 512)')
ap.add_argument('--batch_per_replica', type=int, default=None, help='default 256 (quick: 128)')
ap.add_argument('--num_cells', type=int, default=2)
ap.add_argument('--num_micro_batches', type=int, default=4)
ap.add_argument('--rounds', type=int, default=None, help='default 15 (quick: 5)')
ARGS = ap.parse_args()
ARGS.width = ARGS.width or (512 if ARGS.quick else 1024)
ARGS.batch_per_replica = ARGS.batch_per_replica or (128 if ARGS.quick else 256)
ARGS.rounds = ARGS.rounds or (5 if ARGS.quick else 15)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpipe  # noqa: E402
from tfpipe import fprop_context, layers  # noqa: E402
from tfpipe.pipeline import partition, replicas  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)  # as pipeline_benchmark.py: lets
tf.config.threading.set_inter_op_parallelism_threads(2)  # two logical CPUs overlap
tfpipe.configure_logical_cpus(2 * ARGS.num_cells)


def loss_fn(outputs, targets):
    return tf.reduce_mean(tf.square(outputs - targets), axis=-1)


def build(num_replicas: int):
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=ARGS.width,
                                      output_dim=ARGS.width, activation='relu')
            for i in range(ARGS.layers)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(len(body), ARGS.num_cells),
        num_micro_batches=ARGS.num_micro_batches, num_replicas=num_replicas).Instantiate()
    batch = ARGS.batch_per_replica * num_replicas
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=[batch, ARGS.width]), tf.float32)
    y = tf.constant(rng.normal(size=[batch, ARGS.width]), tf.float32)

    @tf.function
    def step():
        """The trainer's form: all-reduced gradients applied by every replica to its copy."""
        with fprop_context.training(step=0):
            loss, grads = pipe.ForwardBackward(pipe.ReplicaThetas(), x, loss_fn, y)
        grads = grads if isinstance(grads, list) else [grads]
        for theta, replica_grads in zip(pipe.ReplicaThetas(), grads):
            for v, g in zip(tf.nest.flatten(theta), tf.nest.flatten(replica_grads)):
                v.assign_sub(1e-6 * g)
        return loss

    return pipe, step, batch


def all_reduce_only(pipe):
    """The R=2 step's collectives alone: one packed all-reduce per cell, same devices."""
    shapes = [[v.shape for v in tf.nest.flatten(cell.read_theta(pipe.theta))]
              for cell in pipe.cells]

    @tf.function
    def run():
        outs = []
        for k, cell_shapes in enumerate(shapes):
            devices = [d[k] for d in pipe.replica_devices]
            per_replica = []
            for device in devices:
                with tf.device(device):
                    per_replica.append([tf.ones(s) for s in cell_shapes])
            outs += [t[0] for t in replicas.all_reduce_sum(per_replica, devices)]
        return outs

    return run


def timed(fn) -> float:
    start = time.perf_counter()
    out = fn()
    tf.nest.map_structure(lambda t: t.numpy(), out)
    return time.perf_counter() - start


def main() -> None:
    variants = {}
    for r in (1, 2):
        pipe, step, batch = build(r)
        variants[f'R={r}'] = (step, batch)
        if r == 2:
            variants['all-reduce'] = (all_reduce_only(pipe), 0)
    for fn, _ in variants.values():
        for _ in range(2):
            timed(fn)  # trace and warm up
    times = {name: [] for name in variants}
    names = list(variants)
    for i in range(ARGS.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(timed(variants[name][0]))
    med = {name: statistics.median(t) for name, t in times.items()}
    ratios = [b / a for a, b in zip(times['R=1'], times['R=2'])]
    share = [c / b for b, c in zip(times['R=2'], times['all-reduce'])]
    print(f'{ARGS.layers} x Dense({ARGS.width}), K={ARGS.num_cells}, M={ARGS.num_micro_batches}'
          f' per replica, batch {ARGS.batch_per_replica} per replica, {ARGS.rounds} rounds')
    for name in ('R=1', 'R=2'):
        step, batch = variants[name]
        print(f'  {name} x K={ARGS.num_cells}: {1e3 * med[name]:7.1f} ms/step  '
              f'{batch / med[name]:8.1f} examples/s')
    print(f'  step time R=2 / R=1 (paired median): {statistics.median(ratios):.2f}x; '
          f'examples/s R=2 / R=1: {2 / statistics.median(ratios):.2f}x')
    print(f'  all-reduce alone: {1e3 * med["all-reduce"]:.1f} ms, '
          f'{100 * statistics.median(share):.0f}% of the R=2 step')


if __name__ == '__main__':
    main()
