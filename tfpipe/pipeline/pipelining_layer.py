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
"""
from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tfpipe import devices as devices_lib
from tfpipe import fprop_context
from tfpipe.base_layer import BaseLayer, body_meta
from tfpipe.pipeline import costs, microbatch, partition, schedule
from tfpipe.pipeline.cell import RECOMPUTE_POLICIES, Cell, recompute_flags
from tfpipe.pipeline.executor import PipelineRun, float_leaves, is_differentiable

SCHEDULES = {'fill_drain': schedule.fill_drain, '1f1b': schedule.one_f_one_b}
LossFn = Callable[[Any, Any], tf.Tensor]


class PipeliningLayer(BaseLayer):
    """Runs `body` as K cells on K devices with M micro-batches (GPipe)."""

    NESTED_ACTIVATIONS = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('body', [], 'Layer params of the body, in order; names must be unique.')
        p.Define('balance', None, 'Layers per cell, e.g. [2, 2, 2, 2]; None: balance '
                 'automatically into num_cells cells by partition_by.')
        p.Define('num_cells', None, 'Number of cells K when balance is None.')
        p.Define('partition_by', 'params', f'Cost used by automatic balance: {costs.PARTITION_BY}.')
        p.Define('input_shape', None, "Mini-batch input shape (batch first), needed by "
                 "partition_by='flops', 'memory' or 'time'.")
        p.Define('input_dtype', tf.float32, "Input dtype for partition_by='time'.")
        p.Define('devices', None, 'One device per cell; None: GPUs if there are enough, '
                 'else logical CPUs.')
        p.Define('num_micro_batches', 1, 'M: micro-batches per mini-batch (uneven sizes are '
                 'allowed; a batch smaller than M gives one example per micro-batch).')
        p.Define('recompute', 'always', 'Re-materialisation: ' + ' | '.join(RECOMPUTE_POLICIES))
        p.Define('schedule', 'fill_drain', f'Schedule of ForwardBackward: {sorted(SCHEDULES)}. '
                 'FProp under a tape always uses fill_drain.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if not p.body:
            raise ValueError(f'{self.path}: body is empty; give p.body at least one layer params')
        if not isinstance(p.num_micro_batches, int) or p.num_micro_batches < 1:
            raise ValueError(f'{self.path}: num_micro_batches={p.num_micro_batches!r} must be an '
                             'int >= 1 (1 means no micro-batching)')
        if p.schedule not in SCHEDULES:
            raise ValueError(f'{self.path}: unknown schedule {p.schedule!r}; use one of '
                             f'{sorted(SCHEDULES)}')
        flags = None
        try:
            self.balance = tuple(self._Balance())
            flags = recompute_flags(p.recompute, len(self.balance))
            self.devices = tuple(devices_lib.resolve(p.devices, len(self.balance)))
        except ValueError as e:
            raise ValueError(f'{self.path}: {e}') from None
        layers = []
        for k, (start, stop) in enumerate(partition.cell_ranges(self.balance)):
            with tf.device(self.devices[k]):
                layers.append(self.CreateChildren(p.body[start:stop]))
        self.cells = [Cell(k, self.devices[k], layers[k], flags[k])
                      for k in range(len(self.balance))]

    def _Balance(self) -> list[int]:
        p = self.params
        if p.balance is not None:
            if p.num_cells is not None and p.num_cells != len(p.balance):
                raise ValueError(f'num_cells={p.num_cells} disagrees with balance {p.balance}; '
                                 'set only one of them')
            return partition.validate_balance(p.balance, len(p.body))
        if p.num_cells is None:
            raise ValueError('balance is None and num_cells is None: give balance=[...] '
                             'or num_cells=K for automatic balance')
        if p.partition_by not in costs.PARTITION_BY:
            raise ValueError(f'unknown partition_by {p.partition_by!r}; use one of '
                             f'{list(costs.PARTITION_BY)}')
        if p.partition_by == 'params':
            layer_costs = costs.by_params(p.body)
        elif p.input_shape is None:
            raise ValueError(f"partition_by={p.partition_by!r} needs p.input_shape (the "
                             "mini-batch shape, batch first), or use partition_by='params'")
        elif p.partition_by == 'flops':
            layer_costs = costs.by_flops(p.body, tf.TensorShape(p.input_shape))
        elif p.partition_by == 'memory':
            layer_costs = costs.by_memory(p.body, tf.TensorShape(p.input_shape))
        else:
            first = devices_lib.resolve(p.devices, 1)[0]
            layer_costs = costs.by_time(p.body, costs.sample_input(p.input_shape, p.input_dtype),
                                        first)
        return partition.solve_balance(layer_costs, p.num_cells)

    # -- Forward -------------------------------------------------------------------------

    def _Split(self, inputs: Any, device: str) -> tuple[list, list[int]]:
        with tf.device(device), tf.name_scope('split'):
            inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
            micro = microbatch.split(inputs, self.params.num_micro_batches)
        sizes = [tf.nest.flatten(mb)[0].shape[0] for mb in micro]
        return micro, microbatch.offsets(sizes)

    def _ReadThetas(self, theta: dict) -> list[dict]:
        return [cell.read_theta(theta) for cell in self.cells]

    def FProp(self, theta: dict, inputs: Any) -> Any:
        """Pipelined forward; differentiable with any outer tf.GradientTape."""
        with tf.name_scope(self.params.name) as scope:
            return self._FProp(theta, inputs, scope)

    def _FProp(self, theta: dict, inputs: Any, scope: str) -> Any:
        ctx = fprop_context.current()
        thetas = self._ReadThetas(theta)
        if not ctx.training:
            micro, offsets = self._Split(inputs, self.devices[0])
            run = PipelineRun(self.cells, thetas, micro, offsets, ctx)
            run.run(t for tick in self._Ticks('fill_drain', len(micro)) for t in tick
                    if t.phase == schedule.FORWARD)
            return self._Merge(run.outputs)
        return self._TrainingFProp(thetas, inputs, ctx, scope)

    def _Ticks(self, name: str, num_micro_batches: int) -> schedule.Schedule:
        return SCHEDULES[name](len(self.cells), num_micro_batches)

    def _Merge(self, micro_outputs: list) -> Any:
        with tf.device(self.devices[-1]), tf.name_scope('merge'):
            return microbatch.merge(micro_outputs)

    def _TrainingFProp(self, thetas: list[dict], inputs: Any, ctx, scope: str) -> Any:
        inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
        flat_inputs = tf.nest.flatten(inputs)
        flat_thetas = [tf.nest.flatten(t) for t in thetas]
        sizes = [len(f) for f in flat_thetas]
        num_micro = len(microbatch.micro_batch_sizes(microbatch.batch_size(inputs),
                                                     self.params.num_micro_batches))
        ticks = self._Ticks('fill_drain', num_micro)
        out_structure = []

        @tf.custom_gradient
        def pipelined(*args):
            with tf.device(self.devices[0]), tf.name_scope('inputs'):
                x = tf.nest.pack_sequence_as(
                    inputs, [tf.stop_gradient(a) for a in args[:len(flat_inputs)]])
            local_thetas, pos = [], len(flat_inputs)
            for cell, size, th in zip(self.cells, sizes, thetas):
                with tf.device(cell.device), tf.name_scope(f'cell_{cell.index}/theta'):
                    leaves = [tf.stop_gradient(a) for a in args[pos:pos + size]]
                local_thetas.append(tf.nest.pack_sequence_as(th, leaves))
                pos += size
            micro, offsets = self._Split(x, self.devices[0])
            run = PipelineRun(self.cells, local_thetas, micro, offsets, ctx,
                              need_input_grads=True)
            run.run(t for tick in ticks for t in tick if t.phase == schedule.FORWARD)
            run.apply_batch_stats()
            y = self._Merge(run.outputs)
            out_structure.append(y)

            def grad(*dys):
                # Re-enter the forward's name scope, so that backward ops are found
                # beside the forward ones ('pipe/cell_k/backward_m').
                with tf.name_scope(scope or self.params.name):
                    with tf.device(self.devices[-1]), tf.name_scope('output_grads'):
                        dy = tf.nest.pack_sequence_as(y, [
                            tf.zeros_like(v) if d is None else d
                            for v, d in zip(tf.nest.flatten(y), dys)])
                        run.set_output_grads([float_leaves(d) for d in
                                              microbatch.split(dy, len(micro))])
                    run.run(t for tick in ticks for t in tick if t.phase == schedule.BACKWARD)
                    return self._InputGrads(x, run) + [g for k in range(len(self.cells))
                                                       for g in run.theta_grads[k]]

            return tf.nest.flatten(y), grad

        flat_y = pipelined(*flat_inputs, *[v for f in flat_thetas for v in f])
        return tf.nest.pack_sequence_as(out_structure[0], flat_y)

    def _InputGrads(self, x: Any, run: PipelineRun) -> list:
        """Gradients of the flat inputs: merged over micro-batches, None for ints."""
        leaves = tf.nest.flatten(x)
        float_positions = [i for i, t in enumerate(leaves) if is_differentiable(t)]
        out: list = [None] * len(leaves)
        with tf.device(self.devices[0]), tf.name_scope('input_grads'):
            for j, i in enumerate(float_positions):
                parts = [g[j] for g in run.input_grads]
                out[i] = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
        return out

    # -- The trainer's step --------------------------------------------------------------

    def ForwardBackward(self, theta: dict, inputs: Any, loss_fn: LossFn,
                        targets: Any) -> tuple[tf.Tensor, dict]:
        """Mean loss over the mini-batch and its gradients w.r.t. theta.

        `loss_fn(outputs, targets)` gets one micro-batch's outputs and targets and
        returns one loss per example (shape [b]); `loss` is the mean over all N
        examples, exact for uneven micro-batches. `grads` has the structure of
        `theta`; each cell's gradients are summed over micro-batches on its device.
        """
        with tf.name_scope(self.params.name):
            return self._ForwardBackward(theta, inputs, loss_fn, targets)

    def _ForwardBackward(self, theta: dict, inputs: Any, loss_fn: LossFn,
                         targets: Any) -> tuple[tf.Tensor, dict]:
        ctx = fprop_context.current()
        if not ctx.training:
            ctx = fprop_context.FPropContext(training=True, step=ctx.step)
        n = microbatch.batch_size(inputs)
        n_targets = microbatch.batch_size(targets)
        if n_targets != n:
            raise ValueError(f'{self.path}: inputs have batch size {n} but targets have '
                             f'{n_targets}; give one target per input example')
        thetas = self._ReadThetas(theta)
        micro, offsets = self._Split(inputs, self.devices[0])
        with tf.device(self.devices[-1]), tf.name_scope('split_targets'):
            micro_targets = microbatch.split(
                tf.nest.map_structure(tf.convert_to_tensor, targets), len(micro))
        losses = []

        def on_output(m: int, y: Any) -> list:
            leaves = float_leaves(y)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(leaves)
                per_example = loss_fn(y, micro_targets[m])
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

        run = PipelineRun(self.cells, thetas, micro, offsets, ctx, on_output=on_output)
        run.run(t for tick in self._Ticks(self.params.schedule, len(micro)) for t in tick)
        run.apply_batch_stats()
        with tf.device(self.devices[-1]), tf.name_scope('loss'):
            loss = tf.add_n(losses)
        grads: dict = {}
        for k in range(len(self.cells)):
            grads.update(run.theta_grads_of(k))
        return loss, {name: grads[name] for name in theta}

    # -- Static cost ---------------------------------------------------------------------

    @classmethod
    def FPropMeta(cls, p, shapes):
        return body_meta(p.body, shapes)

    @classmethod
    def NumParams(cls, p):
        return sum(lp.cls.NumParams(lp) for lp in p.body)
