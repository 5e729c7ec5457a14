"""tfpipe across processes: the same pipeline's step with its cells in one process vs on workers.

Starts worker servers on loopback (subprocesses, stopped by PID at exit), connects this
process to them, and builds each variant of ROWS once:
  - local:   the cells on this process's logical CPUs (explicit device list);
  - cluster: devices=None, i.e. spread over the workers' devices (task first).
Then times the variants' training steps (ForwardBackward + optimizer update, the
trainer's step without input) in interleaved rounds, the order rotating every round,
and prints medians and the per-round ratio cluster / local (goal <= 1.3x).

Both variants of a row share the same params (same K, M, batch), and their input
batch is made once on this process, so the cluster variant pays for sending the
batch to the first worker, as the trainer does.

Run (from the repository root):
    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/cluster_benchmark.py            # ~2 min
    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/cluster_benchmark.py --quick    # ~1 min

A row's slot count is num_replicas x K: local variants get that many local CPUs,
cluster variants that many worker devices (one replica per worker for R=2 on 2
workers). The data-parallel rows compare R=2 x K=2 with R=1 x K=2 at the same
per-replica batch (examples/s), and time the R=2 step's all-reduce alone (one
packed collective per cell, on the same devices) to give its share of the step.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 'image.shapes.AmoebaNetPipe'
GOAL = 1.3


@dataclasses.dataclass
class Row:
    name: str
    overrides: dict  # params overrides applied to MODEL's params (dotted keys)


ROWS = [Row('AmoebaNetPipe K=4 M=4', {}),
        Row('R=1 x K=2, batch 32', {'task.pipeline.num_cells': 2}),
        Row('R=2 x K=2, batch 2x32', {'task.pipeline.num_replicas': 2,
                                      'task.pipeline.num_cells': 2,
                                      'input.train.batch_size': 64})]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true', help='fewer rounds')
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--worker_cpus', type=int, default=4, help='logical CPUs per worker')
    ap.add_argument('--local_cpus', type=int, default=8, help='logical CPUs of this process')
    ap.add_argument('--rounds', type=int, default=None, help='default 15 (quick: 5)')
    ap.add_argument('--steps', type=int, default=3, help='timed steps per variant per round')
    ap.add_argument('--pin_threads', action='store_true',
                    help='TF_NUM_INTRAOP_THREADS=1, TF_NUM_INTEROP_THREADS=2 in every process')
    args = ap.parse_args()
    args.rounds = args.rounds or (5 if args.quick else 15)
    return args


ARGS = parse_args()
if ARGS.pin_threads:
    os.environ.update(TF_NUM_INTRAOP_THREADS='1', TF_NUM_INTEROP_THREADS='2')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, REPO)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def start_workers(count: int, cpus: int) -> str:
    """Starts `count` worker processes; returns the cluster spec. Stopped at exit by PID."""
    spec = 'worker=' + ','.join(f'127.0.0.1:{free_port()}' for _ in range(count))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
    for task in range(count):
        proc = subprocess.Popen(
            [sys.executable, '-m', 'trainer', '--job=worker', f'--task={task}',
             f'--cluster_spec={spec}', '--run_locally=cpu', f'--num_logical_cpus={cpus}'],
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(lambda p=proc: (p.kill(), p.wait()))
    return spec


SPEC = start_workers(ARGS.workers, ARGS.worker_cpus)

import tensorflow as tf  # noqa: E402  (after the environment is set)

import model_registry  # noqa: E402
import tfpipe  # noqa: E402
from tfpipe import cluster, datasets, fprop_context  # noqa: E402
from tfpipe.base_layer import flatten_by_path  # noqa: E402
from tfpipe.pipeline import replicas  # noqa: E402
from trainer import experiment  # noqa: E402

tf.get_logger().setLevel('ERROR')
tfpipe.configure_logical_cpus(ARGS.local_cpus)
CLUSTER = cluster.Cluster(cluster.parse_spec(SPEC))
cluster.connect(CLUSTER, 120)


def build_step(overrides: dict, local: bool, data_dir: str) -> tuple[Callable, list[str]]:
    """The trainer's step (no input) for MODEL with `overrides`; returns it and its devices."""
    params = model_registry.get_params(MODEL)
    experiment.apply_overrides(params, [(k, repr(v)) for k, v in overrides.items()], 'row')
    pipeline = params.task.pipeline
    slots = (pipeline.num_cells or len(pipeline.balance)) * overrides.get(
        'task.pipeline.num_replicas', 1)
    if local:
        pipeline.devices = [f'/job:localhost/replica:0/task:0/device:CPU:{i}'
                            for i in range(slots)]
    params.input.train.data_dir = data_dir
    task = params.task.Instantiate()
    replica_variables = [{p: v for p, v in copy.items() if v.trainable}
                         for copy in task.pipe.ReplicaVariablesByPath()]
    optimizers = [params.task.train.optimizer.Instantiate() for _ in replica_variables]
    for optimizer, variables in zip(optimizers, replica_variables):
        optimizer.CreateSlots(variables)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
    batch = next(iter(params.input.train.Instantiate().Dataset()))
    lr = params.task.train.learning_rate

    @tf.function
    def step():
        with fprop_context.training(step=global_step):
            loss, grads = task.ForwardBackward(task.theta, batch)
        for g, optimizer, variables in zip(grads if isinstance(grads, list) else [grads],
                                           optimizers, replica_variables):
            optimizer.Apply(lr, flatten_by_path(g, task.path), variables)
        global_step.assign_add(1)
        return loss

    return step, task.pipe, params.input.train.batch_size


def all_reduce_step(pipe) -> Callable:
    """The replicated step's collectives alone: one packed all-reduce per cell."""
    shapes = [[v.shape for v in tf.nest.flatten(cell.read_theta(pipe.theta))]
              for cell in pipe.cells]

    @tf.function
    def step():
        outs = []
        for k, cell_shapes in enumerate(shapes):
            devices = [cells[k].device for cells in pipe.replica_cells]
            per_replica = []
            for device in devices:
                with tf.device(device):
                    per_replica.append([tf.ones(s) for s in cell_shapes])
            outs += [t[0][0] for t in replicas.all_reduce_sum(per_replica, devices)]
        return tf.add_n(outs)

    return step


def time_steps(step: Callable, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        loss = step()
    float(loss)  # wait for the last step
    return (time.perf_counter() - start) / count


def main() -> None:
    import tensorflow_datasets as tfds
    tfds.disable_progress_bar()
    data_dir = tempfile.mkdtemp(prefix='tfpipe_bench_tfds_')
    datasets.prepare('tfpipe_shapes', data_dir)
    variants, batches = {}, {}
    for row in ROWS:
        for where in ('local', 'cluster'):
            step, pipe, batches[row.name] = build_step(row.overrides, where == 'local', data_dir)
            variants[(row.name, where)] = step
            if pipe.num_replicas > 1:
                variants[(row.name + ' all-reduce', where)] = all_reduce_step(pipe)
            print(f'{row.name} {where}: cells on '
                  f'{[c.device for cells in pipe.replica_cells for c in cells]}', flush=True)
    for step in variants.values():
        for _ in range(2):
            step()  # trace and warm up
    times = {key: [] for key in variants}
    keys = list(variants)
    for r in range(ARGS.rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for key in order:
            times[key].append(time_steps(variants[key], ARGS.steps))
    print(f'\n{MODEL}: {ARGS.workers} workers x {ARGS.worker_cpus} logical CPUs on loopback vs '
          f'{ARGS.local_cpus} logical CPUs in one process; {platform.node()}, '
          f'{os.cpu_count()} cores, {ARGS.rounds} rounds x {ARGS.steps} steps, threads '
          f'{"pinned intra=1 inter=2" if ARGS.pin_threads else "TF defaults"}')
    print(f'{"row":28s} {"local ms":>9s} {"cluster ms":>11s} {"ratio":>7s} {"(min-max)":>13s}'
          f' {"examples/s local, cluster":>26s}')
    for row in ROWS:
        local, remote = times[(row.name, 'local')], times[(row.name, 'cluster')]
        ratios = [c / l for c, l in zip(remote, local)]
        n = batches[row.name]
        print(f'{row.name:28s} {1e3 * statistics.median(local):9.1f} '
              f'{1e3 * statistics.median(remote):11.1f} {statistics.median(ratios):6.2f}x '
              f'({min(ratios):.2f}-{max(ratios):.2f}) {n / statistics.median(local):12.0f} '
              f'{n / statistics.median(remote):12.0f}' +
              (f'  goal <= {GOAL}x' if row is ROWS[0] else ''))
    for row in ROWS:
        key = row.name + ' all-reduce'
        if (key, 'local') in times:
            shares = {where: statistics.median(times[(key, where)]) /
                      statistics.median(times[(row.name, where)]) for where in ('local', 'cluster')}
            print(f'{row.name}: its all-reduce alone takes {shares["local"]:.0%} of the step '
                  f'in one process, {shares["cluster"]:.0%} across processes')

if __name__ == '__main__':
    main()
