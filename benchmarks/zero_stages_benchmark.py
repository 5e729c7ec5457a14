"""ZeRO stages side by side (task.train.sharding): model state per device and step time.

A weight-dominated stack (Dense layers, a small batch) trained with Adam by the
trainer's step (ForwardBackward + trainer.guarded_update), K=2 cells.
Prints, in one run:
  - per device, at R = 1, 2, 4 for each stage ('none', 'optimizer_states',
    'gradients', 'weights'): weights and Adam slots in bytes per parameter of that
    device (parameters of the whole weights its cells hold or hold parts of), counted
    from the variables placed there, and the gradient sums a device holds for the
    update, counted from the reduced tensors themselves (the all-reduced sums, or the
    reduce-scattered parts of stages 2 and 3, with their devices in the traced graph).
    Formulas: 16 unsharded; 4 + 4 + 8/R stage 1; 4 + 4/R + 8/R stage 2; 16/R stage 3
    (its weights are the padded parts held between steps). Stage 2's and 3's gradient
    figure is what a device holds from the reduction to the update: a cell still
    accumulates its micro-batches' gradients whole until its last backward, and stage 3
    holds its cell's gathered weights whole during the step (docs/optimizer_sharding.md),
    so neither transient is in these figures;
  - the step time of each stage relative to unsharded at R=2, all three built in one
    process (R*K logical CPUs sharing this host's cores) and timed in alternating rounds;
    beside it, the time of the stage's exchanges alone and their share of the step.
    "Exchanges alone" is a tf.function that runs only the collectives the stage's step
    runs, on tensors of the step's shapes, dtypes and devices (the weights stand in for
    the gradient sums), with the step's packing: 'none' the pipeline's all-reduce of each
    cell's gradients (replicas.all_reduce_sum); 'optimizer_states' that all-reduce and
    ShardedOptimizer's all-gather of the updated parts; 'gradients' its reduce-scatter,
    the scalar sum of the clipping norm and the all-gather; 'weights' the all-gather of
    each cell's weights before the forward (the gathered weights then stand in for the
    gradient sums), the reduce-scatter and the norm's sum. The all-gather runs through
    ShardedOptimizer.Apply with plain SGD at learning rate 0, which adds one elementwise
    op per element of a replica's 1/R part and leaves the weights as they are. Alone,
    nothing overlaps the exchanges, so the share is an upper bound of what they cost the
    step; on logical CPUs of one process they are copies in one host's memory, not a
    network's traffic.

Run (from the repository root):
    PYTHONPATH=. python benchmarks/zero_stages_benchmark.py            # a few minutes
    PYTHONPATH=. python benchmarks/zero_stages_benchmark.py --quick
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

# The same flags as the stage-1 benchmark (--clients excepted): --quick, --layers, --width,
# --batch_per_replica, --num_micro_batches, --rounds.
from benchmarks.optimizer_sharding_benchmark import (  # noqa: E402
    NUM_CELLS, dense_data, dense_pipeline, loss_fn, parse_args)

STAGES = ('none', 'optimizer_states', 'gradients', 'weights')
KINDS = ('step', 'exchanges')  # what time_stages times of each stage


def build(args, num_replicas: int, stage: str, regather: bool = False):
    """(step, exchanges, reduced, state): the trainer's step; the step's exchanges alone
    (`exchanges_of`); a function running the step's forward, backward and reduction that
    returns (device, bytes) of each gradient tensor a replica holds for its update, read
    from the traced graph's placement; and per device [params, weight bytes, slot bytes,
    0]. `regather`: stage 3 with regather_per_micro_batch (benchmarks/regather_benchmark.py)."""
    import tensorflow as tf

    from tfpipe import fprop_context, optimizers
    from tfpipe.base_layer import flatten_by_path
    from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
    from trainer.guarded_update import guarded_update

    pipe = dense_pipeline(args, f'pipe_{num_replicas}_{stage}{"_regather" * regather}',
                          num_replicas)
    whole_shapes = {p: v.shape for p, v in pipe.ReplicaVariablesByPath()[0].items()}
    if stage == 'weights':
        pipe.ShardWeights(per_micro_batch=regather)  # the layers now hold each replica's parts
    replica_variables = pipe.ReplicaVariablesByPath()
    adam = optimizers.Adam.Params()
    if stage == 'none':
        optimizer = [adam.Instantiate() for _ in replica_variables]
        for opt, variables in zip(optimizer, replica_variables):
            opt.CreateSlots(variables)
        slot_vars = [v for opt in optimizer for v in opt.slot_variables]
    else:
        if stage == 'gradients':
            pipe.DeferGradientSum()
        optimizer = ShardedOptimizer(adam, replica_variables,
                                     shard_gradients=stage == 'gradients',
                                     weight_shapes=whole_shapes if stage == 'weights' else None)
        slot_vars = [part for path in replica_variables[0] for name in ('m', 'v')
                     for part in optimizer.SlotParts(path, name)]
    batch = args.batch_per_replica * num_replicas
    x, y = dense_data(args, batch)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False)

    def forward_backward():
        with fprop_context.training(step=global_step):
            loss, grads = pipe.ForwardBackward(pipe.ReplicaThetas(), x, loss_fn, y)
        grads = grads if isinstance(grads, list) else [grads]
        return loss, [flatten_by_path(g, pipe.path) for g in grads]

    @tf.function
    def step():
        loss, grads = forward_backward()
        guarded_update(loss, grads, 1.0, optimizer, replica_variables, tf.constant(1e-4),
                       global_step)
        return loss

    held = []  # (device, bytes) of each reduced gradient tensor, as placed in the graph

    @tf.function
    def reduced():
        _, grads = forward_backward()
        if stage in ('gradients', 'weights'):
            grads = optimizer.ReduceScatter(grads)
        held.extend((g.device, g.shape.num_elements() * g.dtype.size)
                    for replica_grads in grads for g in replica_grads.values())
        return [tf.add_n([tf.reduce_sum(g) for g in r.values()]) for r in grads]

    state = {}
    for variables in replica_variables:
        for path, var in variables.items():
            entry = state.setdefault(replicas_device(var.device), [0, 0, 0, 0])
            entry[0] += whole_shapes[path].num_elements()
            entry[1] += var.shape.num_elements() * var.dtype.size
    for var in slot_vars:
        state[replicas_device(var.device)][2] += var.shape.num_elements() * var.dtype.size
    return step, exchanges_of(pipe, replica_variables, stage), lambda: (reduced(), held)[1], \
        state


def exchanges_of(pipe, replica_variables, stage: str):
    """A tf.function running only the collectives of `stage`'s step (module docstring)."""
    import tensorflow as tf

    from tfpipe import optimizers
    from tfpipe.base_layer import flatten_by_path
    from tfpipe.pipeline import replicas
    from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer

    paths = sorted(replica_variables[0])
    devices = [variables[paths[0]].device for variables in replica_variables]
    # Plain SGD at learning rate 0: Apply's all-gather, the weights left as they are.
    shards = pipe.weight_shards
    gather = None if stage == 'none' else ShardedOptimizer(
        optimizers.SGD.Params(), replica_variables, shard_gradients=stage == 'gradients',
        weight_shapes=shards.shapes if shards else None)
    still = tf.constant(0.0)

    @tf.function
    def exchanges():
        if shards is not None:  # gathered once per step; the wholes stand in for the sums
            grads = [flatten_by_path(t, pipe.path)
                     for t in shards.gathered(pipe.ReplicaThetas())]
            return gather.ClipParts(gather.ReduceScatter(grads), 1.0)[1]
        grads = []  # stand-ins of the gradient sums, each on its cell's device
        for variables in replica_variables:
            grads.append({})
            for p in paths:
                with tf.device(variables[p].device):
                    grads[-1][p] = variables[p].read_value()
        if stage == 'gradients':
            parts, norm = gather.ClipParts(gather.ReduceScatter(grads), 1.0)
            gather.Apply(still, parts, replica_variables)
            return norm
        summed = replicas.all_reduce_sum([[g[p] for p in paths] for g in grads], devices)
        if gather is not None:
            gather.Apply(still, [dict(zip(paths, s)) for s in summed], replica_variables)
        return tf.add_n([tf.reduce_sum(s[0]) for s in summed])

    return exchanges


def replicas_device(name: str) -> str:
    """'CPU:3' of a full device name, so variables and tensors compare."""
    import tensorflow as tf
    spec = tf.DeviceSpec.from_string(name)
    return f'{spec.device_type}:{spec.device_index}'


def probe_state(args, num_replicas: int) -> dict:
    """Bytes per parameter per device for each stage (the max over devices)."""
    import tfpipe
    tfpipe.configure_logical_cpus(num_replicas * NUM_CELLS)
    out = {}
    for stage in STAGES if num_replicas > 1 else ('none',):
        step, _, reduced, state = build(args, num_replicas, stage)
        for device, size in reduced():
            state[replicas_device(device)][3] += size
        float(step())  # the step runs: the figures are of a working configuration
        rows = [(w / n, s / n, g / n) for n, w, s, g in state.values()]
        out[stage] = [max(r[i] for r in rows) for i in range(3)]
    return out


def time_stages(args, num_replicas: int) -> dict:
    """Per stage, in one process: [median step time, paired ratio to unsharded, median
    time of the exchanges alone, paired median of exchanges / step]."""
    import tfpipe
    tfpipe.configure_logical_cpus(num_replicas * NUM_CELLS)
    built = {stage: build(args, num_replicas, stage)[:2] for stage in STAGES}
    runs = {(stage, kind): fn for stage, fns in built.items() for kind, fn in zip(KINDS, fns)}
    for fn in runs.values():
        for _ in range(2):
            float(fn())  # trace and warm up
    times: dict = {key: [] for key in runs}
    for i in range(args.rounds):
        for key in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            float(runs[key]())
            times[key].append(time.perf_counter() - start)

    def paired(a, b):
        return statistics.median(y / x for x, y in zip(times[a], times[b]))

    return {stage: [statistics.median(times[(stage, 'step')]),
                    paired(('none', 'step'), (stage, 'step')),
                    statistics.median(times[(stage, 'exchanges')]),
                    paired((stage, 'step'), (stage, 'exchanges'))]
            for stage in STAGES}


def run_probe(args, probe: str) -> dict:
    """Runs `--probe=<probe>` in its own process (its own logical CPU count)."""
    cmd = [sys.executable, os.path.abspath(__file__), f'--layers={args.layers}',
           f'--width={args.width}', f'--batch_per_replica={args.batch_per_replica}',
           f'--num_micro_batches={args.num_micro_batches}', f'--rounds={args.rounds}',
           f'--probe={probe}']
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(args) -> int:
    if args.clients:
        raise SystemExit('--clients: not measured by this benchmark yet (one process only)')
    if args.probe:
        kind, r = args.probe.split(':')
        print(json.dumps(probe_state(args, int(r)) if kind == 'state'
                         else time_stages(args, int(r))))
        return 0
    print(f'{args.layers} x Dense({args.width}), K={NUM_CELLS}, M={args.num_micro_batches}, '
          f'batch {args.batch_per_replica} per replica, Adam; {args.rounds} timing rounds')
    print('  R  stage             weights  grads  slots  state B/param (formula)')
    for r in (1, 2, 4):
        for stage, (weights, slots, grads) in run_probe(args, f'state:{r}').items():
            formula = {'none': 16, 'optimizer_states': 8 + 8 / r,
                       'gradients': 4 + 12 / r, 'weights': 16 / r}[stage]
            print(f'  {r}  {stage:16}  {weights:6.2f}  {grads:5.2f}  {slots:5.2f}  '
                  f'{weights + grads + slots:6.2f} ({formula:g})')
    print('  R=2 stage             step ms  x unsharded  exchanges alone ms  share of step'
          '  (paired medians)')
    for stage, (step, ratio, exchanges, share) in run_probe(args, 'time:2').items():
        print(f'      {stage:16}  {1e3 * step:7.1f}  {ratio:11.2f}  {1e3 * exchanges:18.1f}  '
              f'{100 * share:12.0f}%')
    return 0


if __name__ == '__main__':
    sys.exit(main(parse_args()))
