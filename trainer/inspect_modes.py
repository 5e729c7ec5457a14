"""The trainer's inspection modes inspect_model and check_pipeline, and the profile and
memory prediction inspect_pipeline (trainer/plan_mode.py) prints too.

They read the model's params and one batch of its input and never touch the
training logdir.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Optional

import numpy as np
import tensorflow as tf

from tfpipe.hyperparams import Params
from tfpipe import memory_stats
from tfpipe.pipeline import sharding
from tfpipe.tuning import (expert_parallel_memory, memory_model, planner, profile,
                           sharding_plan, tensor_parallel_memory, working_memory)
from tfpipe.pipeline.partition import cell_ranges
from trainer import guarded_update

CHECK_TOLERANCE = 1e-5
NOISE_FLOOR = 1e-3  # of the largest gradient: below it a gradient is rounding noise
WEIGHT_FLOOR = 1e-2  # of the largest weight: the least scale a weight is compared at


def mib(num_bytes: float) -> str:
    return f'{num_bytes / 2**20:.4g} MiB'


def sample_inputs(params: Params, task) -> tuple[object, int]:
    """One training batch of the model's real input, as the pipeline's input."""
    batch = next(iter(params.input.train.Instantiate().Dataset()))
    inputs = task.PipelineInputs(batch)
    return inputs, int(tf.nest.flatten(inputs)[0].shape[0])


def profile_model(params: Params, task, max_micro_batches: int,
                  timed: bool = True, member: bool = True) -> list[profile.LayerProfile]:
    """Every body layer of the model profiled on its first cell's device, on a real batch
    (bytes alone unless `timed`: profile.profile_body); with expert parallelism and
    `member`, its weights and slots cut to what one member holds (else P=1's, which the
    planner cuts to each P it tries)."""
    sample, batch_size = sample_inputs(params, task)
    sizes = profile.profiling_batch_sizes(batch_size, max_micro_batches)
    profiles = profile.profile_body(params.task.pipeline.body, sample, task.pipe.devices[0],
                                    sizes, params.task.train.optimizer, timed=timed)
    if not member:
        return profiles
    return expert_parallel_memory.member_profiles(task.pipe, profiles,
                                                  params.task.train.optimizer,
                                                  sharded_slots=slot_shards(params) > 1)


def inspect_model(params: Params) -> None:
    """Partition, devices, variables, and per cell: parameter, slot and activation bytes."""
    task = params.task.Instantiate()
    pipe = task.pipe
    # First, while no other tf.data iterator of this process is being torn down.
    input_measurement = host_input_measurement(params, task)
    m = pipe.params.num_micro_batches
    print(f'balance {list(pipe.balance)}  micro-batches {m}  recompute {pipe.params.recompute}'
          f'  replicas {pipe.num_replicas}  tensor_parallel {pipe.params.tensor_parallel}'
          f'  expert_parallel {expert_parallel_memory.degree(pipe.params)}')
    print_placement(pipe)
    profiles = profile_model(params, task, m, timed=False)  # bytes: nothing here reads time
    batch = params.input.train.batch_size // pipe.num_replicas  # each replica's share
    shards = slot_shards(params)
    for r, cells in enumerate(pipe.replica_cells):
        replica = f'replica {r} ' if pipe.num_replicas > 1 else ''
        for cell, (start, stop) in zip(cells, cell_ranges(pipe.balance)):
            count = sum(v.shape.num_elements() for layer in cell.layers
                        for v in tf.nest.flatten(layer.theta))
            layers = profiles[start:stop]
            activations = (batch / m) * sum(p.output_bytes_per_example for p in layers)
            slots = sum(p.slot_bytes for p in layers)
            sharded = f' (1/{shards} of {mib(slots)}: sharded)' if shards > 1 else ''
            tied = ''.join(f', reads {"/".join(t.owner)} of cell {t.owner_cell} as '
                           f'{"/".join(t.user)}' for t in cell.ties)
            print(f'{replica}cell {cell.index} on {cell.device}: {cell.names} ({count} params'
                  f'{tied})\n'
                  f'  parameters {mib(sum(p.param_bytes for p in layers))}  optimizer slots '
                  f'{mib(slots / shards)}{sharded}  activations per micro-batch '
                  f'{mib(activations)} (profiled layer outputs at batch {batch}/{m})')
    print_memory_prediction(params, task, profiles, input_measurement)
    for path, var in task.VariablesByPath().items():
        print(f'{path} {var.shape.as_list()} {var.dtype.name} {var.device}')


def host_input_measurement(params: Params, task) -> Optional[working_memory.InputMeasurement]:
    """The training input's measured bytes when the pipeline's cells are logical CPUs
    of this host (they share its allocator with the input), else None."""
    devices = [cell.device for cells in task.pipe.replica_cells for cell in cells]
    if memory_stats.allocator_devices(devices) != ['CPU:0']:
        return None
    return working_memory.measure_input_pipeline(params.input.train)


def slot_shards(params) -> int:
    """Over how many replicas each optimizer slot is split (task.train.sharding
    'optimizer_states', 'gradients' or 'weights', or shard_optimizer_states). Stage 2's
    gradient sums are predicted whole: a cell accumulates its micro-batches' gradients
    whole until its last backward, so its peak holds them whole; so are stage 3's weights,
    gathered whole for the step, beside their 1/R parts (`weight_parts`;
    docs/optimizer_sharding.md)."""
    train = params.task.train
    if train.shard_optimizer_states or train.sharding != 'none':
        return params.task.pipeline.num_replicas
    return 1


def working_sets(params: Params, task) -> tuple[Optional[list[float]], Optional[list[float]],
                                                 Optional[list[float]], Optional[list[float]],
                                                 list[float]]:
    """Each cell's measured backward working set, input bytes, bytes a micro-batch keeps
    for its backward where the cell does not recompute, and the last cell's loss gradient
    (working_memory.py; the four None when the allocator keeps no statistics), and each
    cell's all-to-all bytes per micro-batch (in the working sets), on one batch of the
    model's real input."""
    pipe = task.pipe
    m = pipe.params.num_micro_batches
    batch = params.input.train.batch_size // pipe.num_replicas  # each replica's share
    sample, _ = sample_inputs(params, task)
    replica = tf.nest.map_structure(lambda t: t[:batch], sample)
    # A member of an expert group cannot run alone (its all-to-all waits for the others):
    # its working sets are a P=1 twin's plus the exchange (expert_parallel_memory).
    p = expert_parallel_memory.degree(pipe.params)
    alone = (pipe if p == 1 else
             expert_parallel_memory.twin(pipe.params, pipe.balance))
    measured_cells = working_memory.measure_cells(alone.replica_cells[0], alone.theta, replica,
                                                  m, measure_saved=True)
    exchange = expert_parallel_memory.all_to_all_bytes(
        pipe.params, pipe.balance,
        tf.nest.map_structure(lambda t: tf.TensorShape([batch // m, *t.shape[1:]]), sample))
    if measured_cells is None:
        return None, None, None, None, exchange
    return ([c.working + a for c, a in zip(measured_cells, exchange)],
            [c.input_bytes for c in measured_cells], [c.saved for c in measured_cells],
            [c.loss_gradients for c in measured_cells], exchange)


def print_memory_prediction(params: Params, task, profiles: list[profile.LayerProfile],
                            input_measurement: Optional[working_memory.InputMeasurement] = None
                            ) -> None:
    """Predicted bytes per device of one training step of the configured pipeline
    (memory_model.py): the model's state, held micro-batches and each cell's working
    set, measured (working_memory.py) when the allocator keeps statistics. When the
    cells are logical CPUs of this host they share one allocator, whose measured peak
    the trainer's progress line prints: the host line predicts that figure, with the
    input pipeline's buffers (`input_measurement`, measured here if not given)."""
    pipe = task.pipe
    m = pipe.params.num_micro_batches
    batch = params.input.train.batch_size // pipe.num_replicas  # each replica's share
    shards = slot_shards(params)
    working, inputs, saved, loss_gradients, exchange = working_sets(params, task)
    p = expert_parallel_memory.degree(pipe.params)
    layouts = [memory_model.CellLayout(cell.device, start, stop, cell.recompute)
               for cell, (start, stop) in zip(pipe.replica_cells[0], cell_ranges(pipe.balance))]
    replicas = [[dataclasses.replace(c, device=cell.device) for c, cell in zip(layouts, cells)]
                for cells in pipe.replica_cells]
    prediction = tensor_parallel_memory.predict(pipe, profiles, replicas, batch / m, shards,
                                                working, inputs, params.task.train.optimizer,
                                                saved, loss_gradients)
    scales = whole_weight_scales(task, profiles)
    between = prediction.devices
    parts = weight_parts(params, between, scales)
    devices = [[dataclasses.replace(d, weights=d.weights + parts[d.device]) for d in r]
               for r in between]
    shard_devices = [d for r in devices for d in r[len(layouts):]]
    profiles = prediction.home_profiles  # each shard device's state is in shard_devices
    if working is not None:
        measured = 'backward working sets measured'
    elif not memory_stats.allocator_devices([pipe.replica_cells[0][0].device]):
        measured = ('backward working sets estimated from layer outputs: the cells run in '
                    'other processes, whose allocators this one cannot read')
    else:
        measured = ('backward working sets estimated from layer outputs: the allocator keeps '
                    'no statistics (TF_CPU_ALLOCATOR_USE_BFC=true on CPUs)')
    sharded = f', optimizer slots sharded over {shards}' if shards > 1 else ''
    if configured_stage(params) == sharding.WEIGHTS:
        sharded += ', weights gathered whole beside their 1/R parts'
    if p > 1:
        print(f'expert parallel {p}: each replica holds 1/{p} of every MoE layer\'s experts '
              '(weights, gradient sums and slots below); all-to-all buffers per micro-batch, '
              f'in the working sets: '
              f'{", ".join(f"cell {k} {mib(a)}" for k, a in enumerate(exchange))}')
    print(f'predicted memory per device (one training step of the configured pipeline, '
          f'model state and activations{sharded}; {measured}):')
    for replica_devices in devices:
        for device in replica_devices:
            print(f'  {device.describe()}')
    print(f'  all devices {mib(sum(d.total for r in devices for d in r))}')
    print_between_steps(params, between, shards, scales, parts)
    if input_measurement is None:
        input_measurement = host_input_measurement(params, task)
    if input_measurement is None:
        return
    cells = [mem for cells in replicas
             for mem in memory_model.cell_memory(profiles, cells, batch / m, shards, working,
                                                 inputs, saved, loss_gradients)]
    cells = [dataclasses.replace(c, static=c.static + parts[c.device]) for c in cells]
    held = [memory_model.in_flight(pipe.params.schedule, len(layouts), k % len(layouts), m)
            * mem.stash for k, mem in enumerate(cells)]
    if shard_devices:  # the shard devices' state shares the allocator
        cells += [memory_model.CellMemory(d.device, d.weights + d.gradient_sums + d.slots, 0.0,
                                          d.working) for d in shard_devices]
        held += [d.held for d in shard_devices]
    # Backwards at once: no more than the cores run, nor than micro-batches (cell k's
    # backward on a micro-batch waits for cell k+1's on the same one).
    parallelism = min(m, planner.local_parallelism(
        tf.config.threading.get_intra_op_parallelism_threads()))
    host = memory_model.host_peak(cells, held, parallelism, input_measurement.resident,
                                  input_measurement.peak)
    # The update runs once every gradient is summed, its temporaries beside the state only:
    # with Adam on wide weights they, not a backward, set the peak (issue 40).
    variables = {path: v for path, v in pipe.ReplicaVariablesByPath()[0].items() if v.trainable}
    update = working_memory.measure_update(params.task.train.optimizer, variables,
                                           params.task.train.clip_gradient_norm_to_value or None,
                                           guarded_update.guarded_update,
                                           threads=inter_op_threads())
    host = dataclasses.replace(host, update=update or 0.0)
    phase = max((host.training, 'a step'), (host.filling, 'the input filling its buffers'),
                (host.updating, 'the optimizer\'s update'))[1]
    print(f'  host allocator (every logical CPU, and the input pipeline\'s '
          f'{mib(input_measurement.resident)} of buffers, {mib(input_measurement.peak)} '
          f'while it fills them; {parallelism:g} backward tasks at once): peak '
          f'{mib(host.peak)} (at {phase}: model state {mib(host.state)}, activations '
          f'{mib(host.activations)}, update temporaries {mib(host.update)})')
    print(f'  host allocator if the input refills its buffers while a step runs (its next '
          f'epoch, a long document later in the stream): up to {mib(host.refill_bound)}')
    state = checkpointed_bytes(params, task)
    print(f'  host allocator with trainer.async_checkpoints=True while a save is written '
          f'beside the steps: up to {mib(host.peak + state)} (the snapshot, one more copy '
          f'of the {mib(state)} checkpointed)')


def checkpointed_bytes(params: Params, task) -> float:
    """Bytes of the values a checkpoint saves: every variable of the model and the
    optimizer's slots of the trainable ones, whole (sharded slots are gathered for a
    save); the step and input position are a few bytes. An asynchronous save
    (tfpipe/checkpoint_writer.py) copies them on their devices, here the host, for as
    long as its write runs beside the steps."""
    variables = list(task.VariablesByPath().values())
    weights = sum(v.shape.num_elements() * v.dtype.size for v in variables)
    return float(weights) + profile.slot_bytes_of(params.task.train.optimizer,
                                                  [v for v in variables if v.trainable])


def inter_op_threads() -> int:
    """How many ops of this process run at once: its inter-op threads (TensorFlow's
    default, 0, is one per core)."""
    return tf.config.threading.get_inter_op_parallelism_threads() or os.cpu_count() or 1


def configured_stage(params: Params) -> str:
    """The ZeRO stage the trainer builds (shard_optimizer_states is stage 1)."""
    train = params.task.train
    return sharding.OPTIMIZER_STATES if train.shard_optimizer_states else train.sharding


def whole_weight_scales(task, profiles: list[profile.LayerProfile]) -> dict[str, float]:
    """Per device, its cell's weight bytes at P=1 over a member's (1 without expert
    parallelism), `profiles` being a member's (`profile_model`): stage 3 cuts a member's
    experts over the R/P replicas holding them, so its parts are 1/R of P=1's."""
    scales = expert_parallel_memory.whole_weight_scales(task.pipe, profiles)
    return {device: scales[k] for cells in task.pipe.replica_cells
            for k, cell in enumerate(cells) for device in cell.shard_devices}


def weight_parts(params: Params, devices: list[list[memory_model.DeviceMemory]],
                 scales: dict[str, float]) -> dict[str, float]:
    """Per device, the bytes of the weight parts it keeps beside the gathered cell at
    stage 3 ('weights'; 0 at the other stages)."""
    return {d.device: sharding_plan.weight_parts(configured_stage(params),
                                                 params.task.pipeline.num_replicas, d.weights,
                                                 d.weights * scales[d.device])
            for r in devices for d in r}


def print_between_steps(params: Params, devices: list[list[memory_model.DeviceMemory]],
                        shards: int, scales: dict[str, float],
                        parts: dict[str, float]) -> None:
    """Each device's model state between steps at the configured ZeRO stage, beside the
    step's peak printed above (`devices` without stage 3's `parts`, `scales` as
    `whole_weight_scales`): at stage 3 ('weights') only the weights' 1/R parts are kept
    there, while the step gathers the cell whole beside them (docs/optimizer_sharding.md);
    the gradient sums are freed after the update at every stage (stages 2 and 3 reduce
    them to 1/R for it)."""
    replicas, stage = params.task.pipeline.num_replicas, configured_stage(params)
    print(f'model state between steps (sharding={stage!r} over {replicas} '
          'replicas; gradient sums freed after the update):')
    for replica_devices in devices:
        for d in replica_devices:
            weights, slots = sharding_plan.between_steps(stage, replicas, d.weights,
                                                         d.slots * shards,
                                                         d.weights * scales[d.device])
            print(f'  {d.device}: weights {mib(weights)}  gradient sums {mib(0)}  slots '
                  f'{mib(slots)}  total {mib(weights + slots)} (the step\'s peak above: '
                  f'{mib(d.total + parts[d.device])})')


def _relative_difference(a: np.ndarray, b: np.ndarray, floor: float = 0.0) -> float:
    """max |a - b| over max |b|: relative to the tensor's scale, so tiny entries do not
    explode; a scale below `floor` counts as `floor`."""
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / max(scale, floor, 1e-30) if a.size else 0.0


def _largest(arrays) -> float:
    return max((float(np.max(np.abs(a))) for a in arrays if a.size), default=0.0)


def _one_step(params: Params, batch) -> tuple[tuple[float, dict, dict], list[int]]:
    """Loss, gradients and updated weights (by path) of one training step of `params`, and
    the balance that ran (the automatic one when `params` set none).

    The trainer's own task, optimizer, clipping and learning-rate schedule, in
    one tf.function that also returns the gradients (one trace per model:
    tracing dominates the check's time).
    """
    from tfpipe import fprop_context
    from tfpipe.base_layer import flatten_by_path
    from trainer import runtime_options, train_job

    with tempfile.TemporaryDirectory() as train_dir:
        trainer = train_job.Trainer(params, train_dir, runtime_options.RuntimeOptions())
        task, step = trainer.task, trainer.global_step

        @tf.function(autograph=False)  # as the trainer's step (train_job.Trainer._step)
        def train_step(batch):
            with fprop_context.training(step=step):
                loss, grads = task.ForwardBackward(task.theta, batch)
            replica_grads = [flatten_by_path(g, task.path)
                             for g in (grads if isinstance(grads, list) else [grads])]
            lr = trainer.learning_rate * trainer.schedule.Value(step + 1)
            guarded_update.guarded_update(loss, replica_grads, trainer.clip_norm,
                                          trainer.optimizers, trainer.replica_variables, lr,
                                          step, task.pipe.params.expert_parallel)
            return loss, replica_grads[0]  # all-reduced: every replica's are the same

        loss, grads = train_step(batch)
        weights = {p: v.numpy() for p, v in task.VariablesByPath().items()}
        balance = list(task.pipe.balance)
    return (float(loss), {p: g.numpy() for p, g in grads.items()}, weights), balance


def check_pipeline(params: Params) -> tuple[int, str]:
    """One step as configured vs K=1 (R=1, fill-drain) with the same micro-batches and no
    recompute, on one batch.

    Returns (exit code, report). The reference keeps M so BatchNorm's
    micro-batch statistics match, and does not recompute, so a layer whose
    recomputed forward differs from its forward (stateful randomness, hidden
    counters) shows up as well as a wrong partition or schedule.
    """
    batch = next(iter(params.input.train.Instantiate().Dataset()))
    reference = params.Copy()
    pipe = reference.task.pipeline
    # One cell, one replica running the R*M micro-batches the R replicas run, under the
    # plain schedule: the step every configuration must equal.
    pipe.Set(balance=[len(pipe.body)], num_cells=None, recompute='never', devices=None,
             num_micro_batches=pipe.num_micro_batches * pipe.num_replicas, num_replicas=1,
             schedule='fill_drain', virtual_stages=1)
    step, balance = _one_step(params, batch)
    code, lines = compare_steps(step, _one_step(reference, batch)[0])
    return code, (f'check_pipeline: balance {balance} vs K=1 '
                  f'(same M, no recompute), float32 tolerance {CHECK_TOLERANCE:g} relative\n'
                  + lines)


def compare_steps(step: tuple[float, dict, dict], reference: tuple[float, dict, dict]
                  ) -> tuple[int, str]:
    """(exit code, report lines) comparing one step's (loss, gradients, weights) by path
    with the reference step's: 0 when every difference is within CHECK_TOLERANCE."""
    loss, grads, weights = step
    ref_loss, ref_grads, ref_weights = reference
    # A gradient that is zero in exact arithmetic (a key bias under softmax) is rounding
    # noise whose size depends on the order of float32 sums, which another partition
    # changes: gradients are measured against at least NOISE_FLOOR of the model's largest,
    # and the weights such noise updates (Adam scales any gradient to the learning rate)
    # are left to their gradient's comparison. Likewise a weight that is still about one
    # update from zero (a zero-initialised bias) carries Adam's normalisation of its
    # gradient's small elements, which turns their rounding into a relative difference of
    # the learning rate: weights are measured against at least WEIGHT_FLOOR of the model's
    # largest, where a wrong update (of the learning rate's size) still shows.
    floor = NOISE_FLOOR * _largest(ref_grads.values())
    noise = {p for p, g in ref_grads.items() if _largest([g]) < floor}
    weight_floor = WEIGHT_FLOOR * _largest(ref_weights.values())
    rows = [('loss', 'loss', _relative_difference(np.array(loss), np.array(ref_loss)))]
    rows += [('gradient', p, _relative_difference(g, ref_grads[p], floor))
             for p, g in grads.items()]
    rows += [('weight', p, _relative_difference(w, ref_weights[p], weight_floor))
             for p, w in weights.items() if p not in noise]
    kind, worst, value = max(rows, key=lambda r: r[2])
    summary = {k: max(r[2] for r in rows if r[0] == k) for k in ('loss', 'gradient', 'weight')}
    ok = value <= CHECK_TOLERANCE
    report = ('\n'.join(f'  largest {k} difference {v:.3g}' for k, v in summary.items())
              + (f'\n  {len(noise)} weight(s) with a rounding-noise gradient (below '
                 f'{NOISE_FLOOR:g} of the largest) checked by their gradient only'
                 if noise else '')
              + f'\n{"PASS" if ok else "FAIL"}: worst {kind} {worst} ({value:.3g})')
    return (0 if ok else 1), report


def print_placement(pipe) -> None:
    """Each replica's cells and their devices: the home device first, then with
    tensor_parallel=T > 1 the other T-1 that the cell's split layers use."""
    for r, cells in enumerate(pipe.replica_cells):
        for cell in cells:
            shards = (f' + tensor-parallel shards on {", ".join(cell.shard_devices[1:])}'
                      if len(cell.shard_devices) > 1 else '')
            print(f'placement: replica {r} cell {cell.index} {cell.names} on '
                  f'{cell.device}{shards}')
