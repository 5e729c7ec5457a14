"""PipeliningLayer: GPipe micro-batch pipeline parallelism as a layer.

The body (a sequence of layer params) is cut into K cells; cell k's variables
are created on device k and all of its work (forward, recompute, backward) runs
there. A mini-batch of N examples is split into M micro-batches which flow
through the cells on an explicit schedule (`schedule.fill_drain` by default),
and the weight gradients of the micro-batches are summed per cell, so one step
is mathematically the same as the unpartitioned body's step.

Two entry points give the gradients:
- `FProp(theta, x)` under any `tf.GradientTape`: the whole pipeline is one
  custom-gradient op whose backward runs the schedule's backward tasks;
- `ForwardBackward(theta, x, loss_fn, targets)`: the trainer's step; the loss
  of each micro-batch is computed on the last cell as soon as its forward is
  done, and no tape over the whole model is needed (this also allows the
  1F1B schedule).
In eval mode (`fprop_context.evaluation()`) FProp runs the forward tasks only,
without tapes or recompute, and BatchNorm uses its moving statistics.

With `num_replicas=R` there are R copies of the K cells (data parallel x
pipeline, see `replicas`): the mini-batch is cut into R*M micro-batches and
replica r runs the r-th group of M. Every entry point accepts one theta, which
all replicas read (weights shipped to each replica, gradients summed back:
simple, and what FProp under a tape needs); `ForwardBackward` also accepts a
list of R thetas, one per replica (`ReplicaThetas()`), and then returns R
gradient dicts, all-reduced so that every replica can apply the same update to
its own copy: the trainer's step.

With several trainer clients (`JoinClients`, tfpipe/clients.py) this layer is
one client's replica of R: it runs its own group of the R*M micro-batches, and
`across_clients` sums the gradients, loss and BatchNorm statistics over the clients.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.base_layer import BaseLayer, body_meta
from tfpipe.pipeline import (across_clients, aux_losses, costs, expert_parallel, microbatch,
                             partition, pipeline_params, recorder, replicas, schedule,
                             sharded_weights, tensor_parallel, ties)
from tfpipe.pipeline.cell import RECOMPUTE_POLICIES, Cell, cell_dtypes, recompute_flags
from tfpipe.pipeline.cell_functions import FunctionalPipelineRun
from tfpipe.pipeline.executor import PipelineRun, float_leaves, is_differentiable



LossFn = Callable[[Any, Any], tf.Tensor]


class PipeliningLayer(BaseLayer):
    """Runs `body` as K cells on K devices with M micro-batches (GPipe)."""

    NESTED_ACTIVATIONS = True
    APPLIES_CHILD_DTYPES = True  # the cells run the body through apply_layer

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('body', [], 'Layer params of the body, in order; names must be unique.')
        p.Define('balance', None, 'Layers per cell, e.g. [2, 2, 2, 2] (K*v cells with '
                 'virtual_stages=v); None: balance automatically by partition_by.')
        p.Define('num_cells', None, 'Number of cells K when balance is None (one per device; '
                 'with virtual_stages=v the body is cut into K*v cells).')
        p.Define('virtual_stages', 1, "v: cells per device for schedule='interleaved_1f1b'; "
                 'cell j runs on device j mod K.')
        p.Define('partition_by', 'params', f'Cost used by automatic balance: {costs.PARTITION_BY}.')
        p.Define('input_shape', None, "Mini-batch input shape (batch first), needed by "
                 "partition_by='flops', 'memory' or 'time'.")
        p.Define('input_dtype', tf.float32, "Input dtype for partition_by='time'.")
        p.Define('devices', None, 'One device per cell and replica (replica r, cell k: entry '
                 'r*K+k); None: GPUs if there are enough, else logical CPUs.')
        p.Define('num_replicas', 1, 'R: data-parallel copies of the K cells on R*K devices; '
                 'each cell\'s gradients are all-reduced over its R copies.')
        p.Define('tensor_parallel', 1, 'T: devices per cell (Megatron-style tensor '
                 'parallelism): the body\'s tensor-parallel layers split their weights over '
                 'them, other layers run on the first; R*K*T devices, replica r, cell k, shard '
                 't on slot (r*K+k)*T+t. See tensor_parallel.py.')
        p.Define('expert_parallel', 1, 'P: replicas that share the experts of each MoE layer '
                 '(P divides num_replicas; each holds E/P experts, tokens travel by all-to-'
                 'all). See expert_parallel.py.')
        p.Define('num_micro_batches', 1, 'M: micro-batches per mini-batch (uneven sizes are '
                 'allowed; a batch smaller than M gives one example per micro-batch).')
        p.Define('recompute', 'always', 'Re-materialisation: ' + ' | '.join(RECOMPUTE_POLICIES))
        p.Define('tied_weights', None, "Shared weights, {user: owner} by variable path in the "
                 "body, e.g. {'logits/w': 'embedding/emb'}: the user layer reads the owner's "
                 'variable (one variable, on the owner\'s device, checkpointed once); its '
                 'gradient is the sum of both uses. See tfpipe.pipeline.ties.')
        p.Define('schedule', 'fill_drain', f'Schedule: {sorted(schedule.SCHEDULES)} (zb_*: '
                 'backward split into input and weight parts). FProp in training mode (under '
                 'an outer tape) runs only schedules whose forwards come first (fill_drain); '
                 'the others need ForwardBackward.')
        p.Define('cell_functions', True, 'Trace each cell\'s forward and backward once as '
                 'functions called per micro-batch (cell_functions.py) instead of unrolling '
                 'every task into the step\'s graph. On by default because the first step '
                 '(trace, grappler, placement) no longer grows with K*M ops (16 x Dense(256), '
                 'K=8, M=64: 5.2 s against 18.4 s unrolled) while the steady step is the same '
                 '(1.02x [0.94-1.21] on a Dense stack, 0.96x [0.80-1.18] on the AmoebaNet body, '
                 'K=4). A cell that keeps its activations trains as unrolled ops (the gradient '
                 'of a call was 1.35-1.44x slower) unless jit_compile. False: the unrolled '
                 'executor, every task\'s ops in the step\'s graph. Split backward (zb_*) falls '
                 'back to it.')
        p.Define('jit_compile', False, 'With cell_functions: compile each cell function with '
                 'XLA (jit_compile=True).')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        pipeline_params.check(p, self.path)
        v = p.virtual_stages
        # The inherited fprop_dtype is the body's default compute dtype (the activations
        # sent between cells use it); a body layer's own wins. Variables, gradient sums
        # and the pipeline's outputs stay float32.
        flags = None
        try:
            self.balance = tuple(costs.balance_of(p))
            if len(self.balance) % v:
                raise ValueError(f'balance {list(self.balance)} has {len(self.balance)} cells, '
                                 f'not a multiple of virtual_stages={v}: give K*{v} entries')
            num_devices = len(self.balance) // v
            flags = recompute_flags(p.recompute, len(self.balance))
            groups = tensor_parallel.resolve_layout(p.devices, p.num_replicas, num_devices,
                                                    p.tensor_parallel)
        except ValueError as e:
            raise ValueError(f'{self.path}: {e}') from None
        # [replica][device slot] -> the slot's T devices, home device first.
        self.replica_groups = groups
        self.replica_devices = [tuple(g[0] for g in replica) for replica in groups]
        self.devices = self.replica_devices[0]
        # Per replica: a slot's build scope (its tensor-parallel and expert groups).
        expert_groups = expert_parallel.layout(self.replica_devices, p.expert_parallel)
        expert_parallel.check_jit_compile(expert_groups, p.jit_compile, self.path)
        building = [expert_parallel.building_with(g, homes, tensor_parallel.building_on)
                    for g, homes in zip(expert_groups, self.replica_devices)]
        layers = []
        for k, (start, stop) in enumerate(partition.cell_ranges(self.balance)):
            with tf.device(self.devices[k % num_devices]), \
                    building[0](groups[0][k % num_devices]):
                layers.append(self.CreateChildren(p.body[start:stop]))
        try:
            self.ties = ties.resolve(p.tied_weights, layers)
        except ValueError as e:
            raise ValueError(f'{self.path}: {e}') from None
        ties.tie(self.ties, layers)
        self.cells = [Cell(k, self.devices[k % num_devices], layers[k], flags[k],
                           *cell_dtypes(k, len(self.balance), p), ties=self.ties,
                           shard_devices=groups[0][k % num_devices])
                      for k in range(len(self.balance))]
        self.replica_cells = [self.cells] + [
            replicas.mirror_cells(self, p, self.balance, slots, flags, self.ties, scope)
            for slots, scope in zip(groups[1:], building[1:])]
        # Checkpoints save each expert weight whole (replica 0's variables: whole_view).
        self._whole_experts = expert_parallel.WholeExperts(self.ReplicaVariablesByPath(),
                                                           p.expert_parallel)
        self._recorder: recorder.Recorder | None = None
        self._peers: across_clients.Peers | None = None
        self._global_batch: int | None = None  # a client fed only its share (JoinClients)
        self._defer_gradient_sum = False  # DeferGradientSum
        self.weight_shards: sharded_weights.WeightShards | None = None  # ShardWeights

    # -- Replicas ------------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return len(self.replica_cells)

    def ReplicaThetas(self) -> list[dict]:
        """One theta per replica (replica 0's is `theta`), for the mirrored ForwardBackward."""
        return [self.theta] + [replicas.theta_of(cells) for cells in self.replica_cells[1:]]

    def ReplicaVariablesByPath(self) -> list[dict[str, tf.Variable]]:
        """Every replica's variables keyed by layer path; replica 0's are the checkpointed ones."""
        return [self.VariablesByPath()] + [replicas.variables_of(cells)
                                            for cells in self.replica_cells[1:]]

    def SyncReplicas(self) -> None:
        """Copies replica 0's variables into the mirrors (an expert weight: group 0's member
        holding the same experts): call after restoring a checkpoint."""
        p, shards = self.params.expert_parallel, self.weight_shards
        replicas.sync([{path: v for path, v in copy.items()  # stage 3's parts restore whole
                        if shards is None or not shards.is_part(v)}
                       for copy in self.ReplicaVariablesByPath()],
                      lambda r, var: expert_parallel.source_replica(r, var, p))

    def JoinClients(self, peers: across_clients.Peers,
                    global_batch_size: int | None = None) -> None:
        """Makes this layer client `peers.index`'s replica of `peers.count` (one per process).

        Only the trainer's ForwardBackward runs across clients; the layer's own
        num_replicas must then be 1 (each client holds one replica). With
        `global_batch_size` ForwardBackward takes only this client's share of each
        global batch (`replicas.examples_of_group`, what its input reads); without,
        the whole global batch, of which it keeps its share.
        """
        if self.num_replicas != 1:
            raise ValueError(f'{self.path}: num_replicas={self.num_replicas} in a client of '
                             f'{peers.count}: each trainer client holds one replica')
        self._peers = peers
        self._global_batch = global_batch_size

    def DeferGradientSum(self) -> None:
        """The trainer's ForwardBackward returns each replica's (or client's) own gradient
        sums over its micro-batches, not summed over replicas: ZeRO stage 2's optimizer
        reduce-scatters them instead (tfpipe/pipeline/sharded_optimizer.py). Tied weights'
        gradients are still folded, per replica (a sum, so before or after is the same)."""
        self._defer_gradient_sum = True

    def ShardWeights(self, per_micro_batch: bool = False) -> None:
        """ZeRO stage 3: each replica keeps 1/R of every weight between steps, gathered once
        a step (sharded_weights.py), or with `per_micro_batch` by every forward and
        backward task of a recomputing cell; the gradients are left for the
        reduce-scatter."""
        self.weight_shards = sharded_weights.WeightShards(self, self._peers, per_micro_batch)
        self._whole_experts = None  # the parts save the experts whole: free the old copies
        self.DeferGradientSum()

    @contextlib.contextmanager
    def RecordTimeline(self) -> Iterator[recorder.Recorder]:
        """Stamps every task of the steps built inside (within a tf.function).

        Return `recorder.stamps()` from the function and read the result with
        `tfpipe.tuning.timeline.Timeline.from_stamps`. The stamps only add control
        dependencies, so the step computes the same values.
        """
        if self._recorder is not None:
            raise ValueError(f'{self.path}: RecordTimeline() is already active; do not nest it')
        self._recorder = recorder.Recorder()
        try:
            yield self._recorder
        finally:
            self._recorder = None

    # -- Forward -------------------------------------------------------------------------

    def _Split(self, inputs: Any, device: str) -> tuple[list, list[int], list[range]]:
        """R*M micro-batches, their offsets in the mini-batch, and each replica's share."""
        p = self.params
        num_groups = self.num_replicas * (self._peers.count if self._peers else 1)
        with tf.device(device), tf.name_scope('split'):
            inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
            batch = self._global_batch or microbatch.batch_size(inputs)
            groups = replicas.micro_batch_groups(batch, p.num_micro_batches, num_groups,
                                                 self.path)
            micro = self._SplitBatch(inputs)
        sizes = microbatch.micro_batch_sizes(batch, p.num_micro_batches * num_groups)
        expert_parallel.check_even(sizes, p.expert_parallel, self.path)
        if self._peers is not None:  # this client's group only, at its global offsets
            groups = groups[self._peers.index:self._peers.index + 1]
        return micro, microbatch.offsets(sizes), groups

    def _SplitBatch(self, batch: Any) -> list:
        """The R*M micro-batches of a mini-batch (inputs or targets).

        A client fed only its share (`JoinClients(global_batch_size=N)`) holds its
        own group's micro-batches, cut from the share exactly as from the whole
        batch (sizes differ by at most 1, larger first), and None for the others'.
        """
        count = self.params.num_micro_batches * self.num_replicas * (
            self._peers.count if self._peers else 1)
        if self._global_batch is None:
            return microbatch.split(batch, count)
        share = replicas.examples_of_group(self._global_batch, self.params.num_micro_batches,
                                           self._peers.count, self._peers.index, self.path)
        got = microbatch.batch_size(batch)
        if got != len(share):
            raise ValueError(f'{self.path}: client {self._peers.index} of {self._peers.count} '
                             f'got {got} examples; its share of a global batch of '
                             f'{self._global_batch} is {len(share)} (examples {share.start}..'
                             f'{share.stop - 1}): feed it the input read with that share')
        group = replicas.micro_batch_groups(self._global_batch, self.params.num_micro_batches,
                                            self._peers.count, self.path)[self._peers.index]
        micro: list = [None] * len(microbatch.micro_batch_sizes(self._global_batch, count))
        micro[group.start:group.stop] = microbatch.split(batch, len(group))
        return micro

    def _Runs(self, thetas: list[list[dict]], micro: list, offsets: list[int],
              groups: list[range], ctx, **kwargs) -> list[PipelineRun]:
        """One PipelineRun per replica over its group of micro-batches."""
        return [self._NewRun(cells, cell_thetas, [micro[m] for m in group],
                             [offsets[m] for m in group], ctx, **kwargs)
                for cells, cell_thetas, group in zip(self.replica_cells, thetas, groups)]

    def _NewRun(self, *args, split_backward: bool = False, **kwargs) -> PipelineRun:
        """A run over one replica's micro-batches: cell functions when asked for and
        supported (see cell_functions.py for what falls back), else unrolled tasks."""
        p = self.params
        if p.cell_functions and not split_backward:
            return FunctionalPipelineRun(*args, jit_compile=p.jit_compile,
                                         recorder=self._recorder, **kwargs)
        return PipelineRun(*args, split_backward=split_backward, recorder=self._recorder,
                           **kwargs)

    def _ReplicaThetas(self, theta: dict | list) -> list[dict]:
        """Each replica's theta. One theta is read by every replica; a list gives each
        replica its own. With expert parallelism replicas hold different experts, so
        one theta (replica 0's) gives the others their own weights (equal to replica 0's
        outside the experts)."""
        per_replica = theta if isinstance(theta, list) else [theta] * self.num_replicas
        if self.params.expert_parallel > 1 and not isinstance(theta, list):
            per_replica = [theta] + self.ReplicaThetas()[1:]
        return per_replica

    def _ReadThetas(self, theta: dict | list, per_task: bool = False) -> list[list[dict]]:
        """Each replica's per-cell thetas, read on the replica's devices; at stage 3 the
        whole weights, gathered once a step (with `per_task`, the training step, under
        regather_per_micro_batch a recomputing cell's stay parts: its tasks regather)."""
        per_replica = self._ReplicaThetas(theta)
        if self.weight_shards is not None:
            per_replica = self.weight_shards.gathered(per_replica,
                                                      self.cells if per_task else None)
        return [[cell.read_theta(t) for cell in cells]
                for cells, t in zip(self.replica_cells, per_replica)]

    @tf.autograph.experimental.do_not_convert  # see PipelineRun.run: no tensor branches
    def FProp(self, theta: dict, inputs: Any) -> Any:
        """Pipelined forward; differentiable with any outer tf.GradientTape."""
        if self._peers is not None:
            raise ValueError(f'{self.path}: a trainer client trains with ForwardBackward only; '
                             'evaluate in an evaler job (one process)')
        if isinstance(theta, list):
            raise ValueError(f'{self.path}: FProp takes one theta (every replica reads it); a '
                             'list of per-replica thetas is for ForwardBackward')
        with tf.name_scope(self.params.name) as scope:
            return self._FProp(theta, inputs, scope)

    def _FProp(self, theta: dict, inputs: Any, scope: str) -> Any:
        ctx = fprop_context.current()
        if not ctx.training:
            micro, offsets, groups = self._Split(inputs, self.devices[0])
            runs = self._Runs(self._ReadThetas(theta), micro, offsets, groups, ctx,
                              global_batch=microbatch.batch_size(inputs))
            for run, group in zip(runs, groups):
                run.run(t for tick in self._Ticks('fill_drain', len(group)) for t in tick
                        if t.phase == schedule.FORWARD)
            aux_losses.record_into(ctx.aux_losses, self._AuxReport(runs))
            return self._Merge([y for run in runs for y in run.outputs])
        return self._TrainingFProp([cell.read_theta(theta) for cell in self.cells], inputs, ctx,
                                   scope)

    def _Ticks(self, name: str, num_micro_batches: int) -> schedule.Schedule:
        if name == 'fill_drain':  # also the forward order of FProp: one tick per cell
            return schedule.fill_drain(len(self.cells), num_micro_batches)
        try:
            return schedule.SCHEDULES[name].build(len(self.devices), num_micro_batches,
                                         self.params.virtual_stages)
        except ValueError as e:
            raise ValueError(f'{self.path}: {e}') from None

    def _Merge(self, micro_outputs: list) -> Any:
        with tf.device(self.devices[-1]), tf.name_scope('merge'):
            return microbatch.merge(micro_outputs)

    def _ApplyBatchStats(self, runs: list[PipelineRun], groups: list[range],
                         num_micro_batches: int) -> None:
        if self._peers is not None:
            across_clients.apply_batch_stats(self._peers, self.cells, runs[0].sinks, groups[0],
                                             num_micro_batches)
        elif len(runs) == 1:
            runs[0].apply_batch_stats()
        else:
            replicas.apply_batch_stats(self.replica_cells, [run.sinks for run in runs])

    def _AuxReport(self, runs: list[PipelineRun]) -> dict:
        """The auxiliary losses of all replicas' micro-batches, summed (aux_losses.py)."""
        return aux_losses.merge([run.aux_report() for run in runs], self.devices[-1])

    def _TrainingFProp(self, thetas: list[dict], inputs: Any, ctx, scope: str) -> Any:
        """The whole pipeline as one custom-gradient op of (inputs, replica 0's theta)
        whose outputs are the body's and the summed auxiliary losses, recorded into the
        caller's sink: their gradients there weigh the losses in each cell's backward."""
        if isinstance(ctx.step, tf.Variable):
            # Read here: the custom gradient refuses variables that it does not get as
            # inputs, and Dropout (or a cell function's step argument) reads the step.
            ctx = dataclasses.replace(ctx, step=tf.convert_to_tensor(ctx.step))
        if self.params.expert_parallel > 1:
            raise ValueError(f'{self.path}: expert_parallel > 1: replicas hold different '
                             'experts; train with ForwardBackward(ReplicaThetas(), ...)')
        inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
        flat_inputs = tf.nest.flatten(inputs)
        flat_thetas = [tf.nest.flatten(t) for t in thetas]
        name = self.params.schedule
        if not schedule.SCHEDULES[name].forwards_first:
            raise ValueError(
                f"{self.path}: schedule={name!r} interleaves backward and forward tasks, which "
                'FProp under an outer GradientTape cannot do (the tape issues every backward '
                'after all forwards); train with ForwardBackward(theta, inputs, loss_fn, '
                "targets), or set schedule='fill_drain'")
        out_structure, aux_report = [], {}
        batch = microbatch.batch_size(inputs)

        @tf.custom_gradient
        def pipelined(*args):
            with tf.device(self.devices[0]), tf.name_scope('inputs'):
                x = tf.nest.pack_sequence_as(
                    inputs, [tf.stop_gradient(a) for a in args[:len(flat_inputs)]])
            cell_args, pos = [], len(flat_inputs)
            for flat in flat_thetas:
                cell_args.append(args[pos:pos + len(flat)])
                pos += len(flat)
            local_thetas = []  # per replica, per cell: the weights read on that cell's device
            for cells in self.replica_cells:
                local = []
                for cell, own, th, leaves in zip(cells, self.cells, thetas, cell_args):
                    with tf.device(cell.device), tf.name_scope(f'cell_{cell.index}/theta'):
                        local.append(tf.nest.pack_sequence_as(th, [
                            tensor_parallel.local_copy(a, own.shard_devices, cell.shard_devices)
                            for a in leaves]))
                local_thetas.append(local)
            micro, offsets, groups = self._Split(x, self.devices[0])
            runs = self._Runs(local_thetas, micro, offsets, groups, ctx, need_input_grads=True,
                              global_batch=batch)
            for run, group in zip(runs, groups):
                run.run(t for tick in self._Ticks(self.params.schedule, len(group)) for t in tick
                        if t.phase == schedule.FORWARD)
            self._ApplyBatchStats(runs, groups, len(micro))
            y = self._Merge([out for run in runs for out in run.outputs])
            out_structure.append(y)
            aux_report.update(self._AuxReport(runs))
            num_outputs = len(tf.nest.flatten(y))

            def grad(*dys):
                upstream = {key: d for key, d in zip(aux_report, dys[num_outputs:])
                            if d is not None}
                dys = dys[:num_outputs]
                # Re-enter the forward's name scope, so that backward ops are found
                # beside the forward ones ('pipe/cell_k/backward_m').
                with tf.name_scope(scope or self.params.name):
                    with tf.device(self.devices[-1]), tf.name_scope('output_grads'):
                        dy = tf.nest.pack_sequence_as(y, [
                            tf.zeros_like(v) if d is None else d
                            for v, d in zip(tf.nest.flatten(y), dys)])
                        micro_dy = microbatch.split(dy, len(micro))
                    for run, group in zip(runs, groups):
                        run.set_output_grads([float_leaves(micro_dy[m]) for m in group])
                        run.aux_upstream = upstream
                        run.run(t for tick in self._Ticks(self.params.schedule, len(group))
                                for t in tick if t.phase == schedule.BACKWARD)
                    return self._InputGrads(x, runs) + [
                        g for cell_grads in self._SumOverReplicas(runs) for g in cell_grads]

            return tf.nest.flatten(y) + [value for value, _ in aux_report.values()], grad

        flat_out = pipelined(*flat_inputs, *[v for f in flat_thetas for v in f])
        num_outputs = len(tf.nest.flatten(out_structure[0]))
        aux_losses.record_into(ctx.aux_losses, {
            key: (value, weight) for (key, (_, weight)), value in
            zip(aux_report.items(), flat_out[num_outputs:])})
        return tf.nest.pack_sequence_as(out_structure[0], flat_out[:num_outputs])

    def _SumOverReplicas(self, runs: list[PipelineRun]) -> list[list[tf.Tensor]]:
        """Each cell's flat weight gradients summed over replicas on replica 0's device."""
        return [replicas.sum_to([run.theta_grads[k] for run in runs], cell.device)
                for k, cell in enumerate(self.cells)]

    def _InputGrads(self, x: Any, runs: list[PipelineRun]) -> list:
        """Gradients of the flat inputs: merged over micro-batches, None for ints."""
        leaves = tf.nest.flatten(x)
        float_positions = [i for i, t in enumerate(leaves) if is_differentiable(t)]
        input_grads = [g for run in runs for g in run.input_grads]
        out: list = [None] * len(leaves)
        with tf.device(self.devices[0]), tf.name_scope('input_grads'):
            for j, i in enumerate(float_positions):
                parts = [g[j] for g in input_grads]
                out[i] = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
        return out

    # -- The trainer's step --------------------------------------------------------------

    @tf.autograph.experimental.do_not_convert  # see PipelineRun.run: no tensor branches
    def ForwardBackward(self, theta: dict | list[dict], inputs: Any, loss_fn: LossFn,
                        targets: Any) -> tuple[tf.Tensor, dict | list[dict]]:
        """Mean loss over the mini-batch and its gradients w.r.t. theta.

        `loss_fn(outputs, targets)` gets one micro-batch's outputs and targets and
        returns one loss per example (shape [b]); `loss` is the mean over all N
        examples, exact for uneven micro-batches. `grads`, of `loss` plus the body's
        weighted auxiliary losses (aux_losses.py; their sums go to the context's
        AuxLossSink, if any), has the structure of `theta`; each cell's gradients are
        summed over micro-batches on its device.
        With R > 1 replicas `theta` may be one theta (read by every replica; the
        gradients are summed onto its devices) or the list `ReplicaThetas()`: then
        `grads` is a list of R dicts, each cell's gradients all-reduced over its R
        copies, for replica r to apply to `ReplicaVariablesByPath()[r]`.
        """
        if isinstance(theta, list) and len(theta) != self.num_replicas:
            raise ValueError(f'{self.path}: got {len(theta)} thetas for num_replicas='
                             f'{self.num_replicas}: pass one theta, or ReplicaThetas()')
        if self.params.expert_parallel > 1 and not isinstance(theta, list):
            raise ValueError(f'{self.path}: expert_parallel={self.params.expert_parallel}: '
                             'pass ReplicaThetas() (replicas hold different experts)')
        with tf.name_scope(self.params.name):
            return self._ForwardBackward(theta, inputs, loss_fn, targets)

    def _ForwardBackward(self, theta: dict | list[dict], inputs: Any, loss_fn: LossFn,
                         targets: Any) -> tuple[tf.Tensor, dict | list[dict]]:
        ctx = fprop_context.current()
        if not ctx.training:
            raise ValueError(
                f'{self.path}: ForwardBackward computes training gradients but runs under '
                'fprop_context.evaluation(); call it under fprop_context.training(step=...), '
                'or use FProp (pipe(x)) to evaluate')
        n_inputs = microbatch.batch_size(inputs)
        n_targets = microbatch.batch_size(targets)
        n = self._global_batch or n_inputs  # the loss is the mean over the global batch
        if n_targets != n_inputs:
            raise ValueError(f'{self.path}: inputs have batch size {n_inputs} but targets have '
                             f'{n_targets}; give one target per input example')
        thetas = self._ReadThetas(theta, per_task=True)
        regathers = [None] * self.num_replicas  # per replica: the per-task gather, if any
        if self.weight_shards is not None:
            regathers = self.weight_shards.regatherers(self.replica_cells,
                                                       self._ReplicaThetas(theta))
        micro, offsets, groups = self._Split(inputs, self.devices[0])
        with tf.device(self.devices[-1]), tf.name_scope('split_targets'):
            micro_targets = self._SplitBatch(
                tf.nest.map_structure(tf.convert_to_tensor, targets))
        losses = []

        def on_output_of(group: range):
            def on_output(m: int, y: Any) -> list:
                leaves = float_leaves(y)
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    tape.watch(leaves)
                    per_example = loss_fn(y, micro_targets[group[m]])
                    b = tf.nest.flatten(y)[0].shape[0]
                    if per_example.shape.rank != 1 or per_example.shape[0] != b:
                        raise ValueError(
                            f'{self.path}: loss_fn returned shape {per_example.shape} for a '
                            f'micro-batch of {b} examples: return one loss per example, shape '
                            f'[{b}] (do not reduce; the pipeline averages over the mini-batch)')
                    total = tf.reduce_sum(per_example) / tf.cast(n, per_example.dtype)
                losses.append(total)
                return tape.gradient(total, leaves,
                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return on_output

        ticks = [self._Ticks(self.params.schedule, len(group)) for group in groups]
        runs = [self._NewRun(cells, cell_thetas, [micro[m] for m in group],
                             [offsets[m] for m in group], ctx, on_output=on_output_of(group),
                             global_batch=n, regather=regather,
                             split_backward=schedule.phases_of(t) != (schedule.FORWARD,
                                                                      schedule.BACKWARD))
                for cells, cell_thetas, group, t, regather in zip(
                    self.replica_cells, thetas, groups, ticks, regathers)]
        for run, run_ticks in zip(runs, ticks):
            run.run(t for tick in run_ticks for t in tick)
        self._ApplyBatchStats(runs, groups, len(micro))
        with tf.device(self.devices[-1]), tf.name_scope('loss'):
            loss = tf.add_n(losses)
        report = self._AuxReport(runs)
        if self._peers is not None:
            loss, *aux = across_clients.all_reduce_sum(
                self._peers, [loss] + [value for value, _ in report.values()], self.devices[-1])
            report = {key: (value, weight) for (key, (_, weight)), value in
                      zip(report.items(), aux)}
        aux_losses.record_into(ctx.aux_losses, report)
        if not isinstance(theta, list):
            grads: dict = {}
            for k, cell_grads in enumerate(self._SumOverReplicas(runs)):
                if self._peers is not None and not self._defer_gradient_sum:
                    cell_grads = expert_parallel.all_reduce_across_clients(
                        self._peers, cell_grads, self.cells[k].device,
                        expert_parallel.expert_leaves(self.cells[k], theta))
                grads.update(tf.nest.pack_sequence_as(runs[0].thetas[k], cell_grads))
            ties.fold(grads, self.ties, [cell.shard_devices for cell in self.cells])
            return loss, {name: grads[name] for name in theta}
        per_replica: list[dict] = [{} for _ in runs]
        for k, cell in enumerate(self.cells):
            if not self._defer_gradient_sum:
                reduced = expert_parallel.all_reduce_grads(
                    [run.theta_grads[k] for run in runs],
                    [cells[k].device for cells in self.replica_cells],
                    expert_parallel.expert_leaves(cell, theta[0]), self.params.expert_parallel)
                for r, run in enumerate(runs):
                    run.theta_grads[k] = reduced[r]
            for r, run in enumerate(runs):
                per_replica[r].update(run.theta_grads_of(k))
        for r, replica_grads in enumerate(per_replica):
            ties.fold(replica_grads, self.ties,
                      [cell.shard_devices for cell in self.replica_cells[r]])
        grads = [{name: g[name] for name in t} for g, t in zip(per_replica, theta)]
        return loss, (grads if self.num_replicas > 1 else grads[0])

    # -- Static cost ---------------------------------------------------------------------

    @classmethod
    def FPropMeta(cls, p, shapes):
        return body_meta(p.body, shapes)

    @classmethod
    def NumParams(cls, p):
        return sum(lp.cls.NumParams(lp) for lp in p.body)

