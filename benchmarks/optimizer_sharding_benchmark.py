"""Optimizer states sharded across replicas (task.train.shard_optimizer_states): memory and time.

A weight-dominated stack (Dense layers, a small batch) trained with Adam by the
trainer's step (ForwardBackward + trainer.guarded_update), R=2 and R=4
replicas x K=2 cells, unsharded against sharded. Prints side by side:
  - per device, from the variables placed on it: weights and Adam slots in bytes per
    parameter of that device, plus the gradient sums (4 bytes per parameter: the
    gradient has the weights' shape) = the state. Goal: 16 unsharded, 12 at R=2, 10 at R=4;
  - the global peak of the BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=true; all logical CPUs
    share it, so it is one number for all devices) counted from before the model is
    built, and how much sharding saved against what the slots predict;
  - step time sharded / unsharded, the two built in one process and timed in
    alternating rounds;
  - with --clients: the same across R trainer client processes on loopback (one
    replica each, tfpipe/clients.py), R=2 and 4: each client's weights and slots in
    bytes per parameter, counted from the variables it holds, and the step time
    sharded / unsharded, both built in the same client processes and timed in
    alternating rounds.

Memory probes run one configuration per subprocess so one allocator's history cannot
colour another's peak.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/optimizer_sharding_benchmark.py            # ~2 minutes
    PYTHONPATH=. python benchmarks/optimizer_sharding_benchmark.py --quick    # ~40 s
    PYTHONPATH=. python benchmarks/optimizer_sharding_benchmark.py --clients  # ~3 minutes
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

NUM_CELLS = 2
MIB = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--layers', type=int, default=8)
    ap.add_argument('--width', type=int, default=None, help='default 1024 (quick: 512)')
    ap.add_argument('--batch_per_replica', type=int, default=8)
    ap.add_argument('--num_micro_batches', type=int, default=2)
    ap.add_argument('--rounds', type=int, default=None, help='default 15 (quick: 5)')
    ap.add_argument('--clients', action='store_true',
                    help='measure R trainer client processes instead of one process')
    ap.add_argument('--probe', default=None, help=argparse.SUPPRESS)  # 'memory:R:sharded'
    args = ap.parse_args(argv)
    args.width = args.width or (512 if args.quick else 1024)
    args.rounds = args.rounds or (5 if args.quick else 15)
    return args


def dense_pipeline(args, name: str, num_replicas: int):
    """The benchmark's model: args.layers x Dense(args.width) as K=NUM_CELLS cells."""
    import tfpipe
    from tfpipe import layers
    from tfpipe.pipeline import partition
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=args.width,
                                      output_dim=args.width, activation='relu')
            for i in range(args.layers)]
    return tfpipe.PipeliningLayer.Params().Set(
        name=name, body=body, balance=partition.even_balance(len(body), NUM_CELLS),
        num_micro_batches=args.num_micro_batches, num_replicas=num_replicas).Instantiate()


def dense_data(args, batch: int):
    """A fixed random batch (inputs, targets) for the benchmark's model."""
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=[batch, args.width]), tf.float32),
            tf.constant(rng.normal(size=[batch, args.width]), tf.float32))


def loss_fn(outputs, targets):
    """Mean squared error per example."""
    import tensorflow as tf
    return tf.reduce_mean(tf.square(outputs - targets), axis=-1)


def build(args, num_replicas: int, sharded: bool, peers=None):
    """The pipeline, its Adam optimizer(s) and the trainer's step; returns (step, state).

    With `peers` this process is one trainer client holding one replica of
    `peers.count` (num_replicas must be 1).
    """
    import tensorflow as tf

    from tfpipe import fprop_context, optimizers
    from tfpipe.base_layer import flatten_by_path
    from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
    from trainer.guarded_update import guarded_update

    pipe = dense_pipeline(args, f'pipe_{num_replicas}_{int(sharded)}', num_replicas)
    if peers is not None:
        pipe.JoinClients(peers)
    replica_variables = pipe.ReplicaVariablesByPath()
    adam = optimizers.Adam.Params()
    if sharded:
        optimizer = ShardedOptimizer(adam, replica_variables, peers)
        slot_vars = [part for path in replica_variables[0] for name in ('m', 'v')
                     for part in optimizer.SlotParts(path, name)]
    else:
        optimizer = [adam.Instantiate() for _ in replica_variables]
        for opt, variables in zip(optimizer, replica_variables):
            opt.CreateSlots(variables)
        slot_vars = [v for opt in optimizer for v in opt.slot_variables]
    batch = args.batch_per_replica * num_replicas * (peers.count if peers else 1)
    x, y = dense_data(args, batch)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False)

    @tf.function
    def step():
        with fprop_context.training(step=global_step):
            if peers is None:
                loss, grads = pipe.ForwardBackward(pipe.ReplicaThetas(), x, loss_fn, y)
            else:  # as the trainer: one theta, gradients summed across the clients
                loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, y)
                grads = [grads]
        guarded_update(loss, [flatten_by_path(g, pipe.path) for g in grads], None, optimizer,
                       replica_variables, tf.constant(1e-4), global_step)
        return loss

    state = {}  # device -> [parameters, weight bytes, slot bytes]
    for variables in replica_variables:
        for var in variables.values():
            entry = state.setdefault(var.device, [0, 0, 0])
            entry[0] += var.shape.num_elements()
            entry[1] += var.shape.num_elements() * var.dtype.size
    for var in slot_vars:
        state[var.device][2] += var.shape.num_elements() * var.dtype.size
    return step, state


def probe_memory(args, num_replicas: int, sharded: bool) -> dict:
    """In a process with the BFC allocator: per-device state and the step's global peak."""
    import tensorflow as tf

    import tfpipe
    tfpipe.configure_logical_cpus(num_replicas * NUM_CELLS)
    base = tf.config.experimental.get_memory_info('CPU:0')['current']
    step, state = build(args, num_replicas, sharded)
    for _ in range(2):
        float(step())
    return {'state': state, 'peak': tf.config.experimental.get_memory_info('CPU:0')['peak']
            - base}


def run_probe(args, probe: str, bfc: bool) -> dict:
    """Runs `--probe=<probe>` in its own process (a fresh allocator and device count)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    if bfc:
        env['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'
    cmd = [sys.executable, os.path.abspath(__file__), f'--layers={args.layers}',
           f'--width={args.width}', f'--batch_per_replica={args.batch_per_replica}',
           f'--num_micro_batches={args.num_micro_batches}', f'--rounds={args.rounds}',
           f'--probe={probe}']
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def time_steps(args, num_replicas: int) -> dict[str, float]:
    """Median sharded / unsharded step-time ratio over alternating rounds, one process."""
    import tfpipe
    tfpipe.configure_logical_cpus(num_replicas * NUM_CELLS)
    steps = {name: build(args, num_replicas, name == 'sharded')[0]
             for name in ('unsharded', 'sharded')}
    for fn in steps.values():
        for _ in range(2):
            float(fn())  # trace and warm up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.rounds):
        for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            start = time.perf_counter()
            float(steps[name]())
            times[name].append(time.perf_counter() - start)
    return {'unsharded': statistics.median(times['unsharded']),
            'sharded': statistics.median(times['sharded']),
            'ratio': statistics.median(b / a for a, b in zip(times['unsharded'],
                                                            times['sharded']))}


def probe_client(args, num_clients: int, task: int, addresses: list[str]) -> dict:
    """Trainer client `task` of `num_clients`: its state per variant and the paired
    sharded / unsharded step-time ratio (both variants in this process)."""
    import tfpipe
    from tfpipe import clients
    tfpipe.configure_logical_cpus(NUM_CELLS)
    peers = clients.start(clients.ClientCluster(tuple(addresses), task), 120)
    built = {name: build(args, 1, name == 'sharded', peers) for name in ('unsharded',
                                                                        'sharded')}
    for step, _ in built.values():
        for _ in range(2):
            float(step())  # trace and warm up, in the same order on every client
    times: dict[str, list[float]] = {name: [] for name in built}
    for i in range(args.rounds):
        for name in (list(built) if i % 2 == 0 else list(built)[::-1]):
            start = time.perf_counter()
            float(built[name][0]())
            times[name].append(time.perf_counter() - start)
    return {'state': {name: state for name, (_, state) in built.items()},
            'unsharded': statistics.median(times['unsharded']),
            'sharded': statistics.median(times['sharded']),
            'ratio': statistics.median(b / a for a, b in zip(times['unsharded'],
                                                            times['sharded']))}


def run_clients(args, num_clients: int) -> list[dict]:
    """Starts `num_clients` client probes on loopback ports; returns their reports."""
    ports = []
    for _ in range(num_clients):
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            ports.append(s.getsockname()[1])
    addresses = ','.join(f'127.0.0.1:{p}' for p in ports)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), f'--layers={args.layers}',
         f'--width={args.width}', f'--batch_per_replica={args.batch_per_replica}',
         f'--num_micro_batches={args.num_micro_batches}', f'--rounds={args.rounds}',
         f'--probe=client:{num_clients}:{task}:{addresses}'],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for task in range(num_clients)]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(err[-3000:])
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return reports


def main_clients(args) -> int:
    print(f'{args.layers} x Dense({args.width}), K={NUM_CELLS} per client, '
          f'M={args.num_micro_batches}, batch {args.batch_per_replica} per client, Adam; '
          f'R trainer clients on loopback, {NUM_CELLS} logical CPUs each; {args.rounds} '
          'timing rounds')
    print('  R  sharded  weights B/param  slots B/param  state B/param (goal)  '
          'step ms (median over clients)')
    for r in (2, 4):
        reports = run_clients(args, r)
        for name in ('unsharded', 'sharded'):
            per_client = [_per_param(rep['state'][name]) for rep in reports]
            weights, slots, total = (max(c[i] for c in per_client) for i in range(3))
            goal = 16 if name == 'unsharded' else 8 + 8 / r
            ms = 1e3 * statistics.median(rep[name] for rep in reports)
            print(f'  {r}  {"yes" if name == "sharded" else "no ":3}      {weights:6.2f}'
                  f'           {slots:6.2f}         {total:6.2f} ({goal:g})'
                  f'            {ms:8.1f}')
        ratios = [rep['ratio'] for rep in reports]
        print(f'     step sharded / unsharded: {statistics.median(ratios):.2f}x (paired '
              f'median per client: {", ".join(f"{x:.2f}" for x in ratios)})')
    return 0


def _per_param(state: dict) -> tuple[float, float, float]:
    """Max over devices of (weights, slots, state incl. gradient sums) bytes per parameter."""
    rows = [(w / n, s / n, (w + s) / n + 4) for n, w, s in state.values()]
    return tuple(max(r[i] for r in rows) for i in range(3))


def main(args) -> int:
    if args.probe and args.probe.startswith('client:'):
        _, r, task, addresses = args.probe.split(':', 3)
        print(json.dumps(probe_client(args, int(r), int(task), addresses.split(','))))
        return 0
    if args.probe:
        kind, r, sharded = args.probe.split(':')
        print(json.dumps(probe_memory(args, int(r), sharded == '1') if kind == 'memory'
                         else time_steps(args, int(r))))
        return 0
    print(f'{args.layers} x Dense({args.width}), K={NUM_CELLS}, M={args.num_micro_batches}, '
          f'batch {args.batch_per_replica} per replica, Adam, BFC allocator; '
          f'{args.rounds} timing rounds')
    print('  R  sharded  weights B/param  slots B/param  state B/param (goal)  '
          'global peak MiB')
    for r in (2, 4):
        reports = {s: run_probe(args, f'memory:{r}:{int(s)}', bfc=True) for s in (False, True)}
        for sharded, report in reports.items():
            weights, slots, total = _per_param(report['state'])
            goal = 16 if not sharded else 8 + 8 / r
            print(f'  {r}  {"yes" if sharded else "no ":3}      {weights:6.2f}'
                  f'           {slots:6.2f}         {total:6.2f} ({goal:g}, '
                  f'{100 * (total / goal - 1):+.1f}%)      {report["peak"] / MIB:8.1f}')
        params = sum(n for n, _, _ in reports[False]['state'].values())
        predicted = params * 8 * (1 - 1 / r)
        saved = reports[False]['peak'] - reports[True]['peak']
        print(f'     peak saved by sharding: {saved / MIB:.1f} MiB; the slots predict '
              f'{predicted / MIB:.1f} MiB ({saved / predicted:.2f}x)')
    for r in (2, 4):
        t = run_probe(args, f'time:{r}:-', bfc=False)
        print(f'  R={r}: step {1e3 * t["unsharded"]:.1f} ms unsharded, {1e3 * t["sharded"]:.1f}'
              f' ms sharded: sharded / unsharded {t["ratio"]:.2f}x (paired median)')
    return 0


if __name__ == '__main__':
    _args = parse_args()
    sys.exit(main_clients(_args) if _args.clients and not _args.probe else main(_args))
