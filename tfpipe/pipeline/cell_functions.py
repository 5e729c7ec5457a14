"""Each cell's forward and backward traced once, as functions called per micro-batch.

The unrolled executor (executor.PipelineRun) builds the ops of every (cell,
micro-batch, phase) task into the step's graph, so Python tracing, grappler and
placement all grow with K*M. `FunctionalPipelineRun` instead traces, per cell,
one `tf.function` for the forward and one for the recomputing backward; every
task is a call of that function, placed on the cell's device and chained by the
same control dependencies as before, so the schedule's per-device order holds.

What changes per micro-batch is passed as tensors, so one trace serves them all:
the example offset (Dropout's mask depends on the global example index) and the
step. BatchNorm's micro-batch statistics cannot escape a function through the
context's sink, so the forward function returns them and they are recorded into
the run's sink outside; so are the auxiliary losses' values (aux_losses.py), and
the backward function takes their output gradients as arguments. A recomputing cell
keeps only its input and its backward function recomputes the forward under a tape of its own (statistics discarded),
then differentiates. A cell that keeps its activations (does not recompute)
runs its training tasks as the unrolled executor's ops: TensorFlow's gradient of
a function call, which would have to keep the call's intermediates, measured
1.35-1.44x slower per step (AmoebaNetPipe, K=1 M=1 and K=4 M=4, recompute
'never'), so only recomputing cells and inference are calls, unless XLA is asked
for (`jit_compile`), which compiles every cell's call. Every op inside a
function is placed on the cell's device explicitly.

`no_inline=True` (the default) keeps the calls as calls: the step's graph then
has one node per task, and grappler and the placer see each cell's function
once instead of K*M copies. Inlined calls would save only the Python tracing.
`jit_compile=True` compiles each cell function with XLA (never inlined).

A recomputing cell's backward function also adds its weight gradients into the
cell's running sums, which keeps those adds out of the step's graph. Each sum lies
on a per-step stack (zeros pushed before the cell's first backward): the call pops
it, adds in place and pushes it back, so a cell holds one running sum, never the
old and the new one across a call (see `_add_into`). The cell's last backward runs
as the unrolled executor's ops on the popped sums, so the final sums are free to go
one by one as they exist, not all when a call ends. With XLA (which compiles no
stack) the sums are passed in and returned, and every backward is a call. The
exception is a weight the cell only gathers from (an embedding table, found in the
forward function's graph): its gradient is an IndexedSlices, which the function
returns as it is, and which is summed outside by accumulate.py, sparse while that
is smaller, as the unrolled executor does. docs/memory.md has the measured peaks.

With a timeline recorder (`PipeliningLayer.RecordTimeline`) the executor stamps
each call's start and end outside the call, as it stamps an unrolled task. The
end of a recompute lies inside the backward call, so a recomputing cell's
backward function is traced with a `tf.timestamp` taken once the recomputed
outputs exist, which the differentiation waits for, and returns it as an extra
output: the recompute/backward split is measured inside the executed graph.

Not supported here, so the layer falls back to the unrolled executor for it:
split backward (zb_* schedules), where the weight part differentiates the tape
that the input part recorded, and a tape cannot outlive a function call.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Optional, Sequence

import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.pipeline import accumulate, aux_losses
from tfpipe.pipeline.cell import Cell
from tfpipe.pipeline.executor import PipelineRun, float_leaves, on_device_of
from tfpipe.pipeline.schedule import BACKWARD


class CellFunctions:
    """The traced forward and recomputing backward of one cell."""

    def __init__(self, cell: Cell, training: bool, boundary: Callable[[Any, Any], tuple],
                 no_inline: bool = True, jit_compile: bool = False,
                 stamp_recompute: bool = False, weight_devices: Sequence[str] = ()):
        """boundary(x, y): the leaves to differentiate (PipelineRun._boundary of the cell).
        stamp_recompute: the backward also returns when its recompute ended (timeline).
        weight_devices: per flat weight, the device its gradient sum lives on when that
        is not the cell's (a weight shard under tensor parallelism), else ''."""
        self.cell = cell
        self.weight_devices = tuple(weight_devices)
        self.training = training
        self.boundary = boundary
        self.stamp_recompute = stamp_recompute
        self._layers: dict[str, Any] = {}  # path -> a layer that recorded statistics
        # The auxiliary losses' (key, weight) the forward returns values of, in order.
        self.aux_keys: list[tuple[aux_losses.Key, float]] = []
        # Per flat theta leaf: only gathered from, so summed sparsely outside (learnt while
        # tracing the forward, which always runs before the cell's first backward).
        self.gathered: Optional[tuple[bool, ...]] = None
        attributes = {'_noinline': True} if no_inline and not jit_compile else None
        options = dict(autograph=False, jit_compile=jit_compile or None,
                       experimental_attributes=attributes)
        self.forward = tf.function(self._forward, **options)
        self.backward = tf.function(self._backward, **options)

    def _context(self, offset: tf.Tensor, step: Any, sink: fprop_context.BatchStatsSink,
                 aux: fprop_context.AuxLossSink):
        return fprop_context.scope(training=self.training, step=step, example_offset=offset,
                                   batch_stats=sink, aux_losses=aux)

    def _forward(self, theta: dict, x: Any, offset: tf.Tensor,
                 step: Any) -> tuple[Any, dict, list]:
        """(the cell's output, {layer path: [(count, mean, variance), ...]}, the values
        of the auxiliary losses, in the order of `aux_keys`)."""
        sink, aux = fprop_context.BatchStatsSink(), fprop_context.AuxLossSink()
        with tf.device(self.cell.device), self._context(offset, step, sink, aux):
            y = self.cell.forward(theta, x)
        # Layers may be nested (a BatchNorm inside a composite): learnt while tracing.
        self._layers.update((layer.path, layer) for layer, _ in sink.records.values())
        self.gathered = tuple(_only_gathered(t) for t in tf.nest.flatten(theta))
        records = aux_losses.records_of(aux)
        self.aux_keys = [(key, weight) for key, _, weight in records]
        return y, {layer.path: stats for layer, stats in sink.records.values()}, [
            value for _, value, _ in records]

    def _backward(self, theta: dict, x: Any, dy: list, offset: tf.Tensor, step: Any,
                  acc: list, aux_grads: list) -> tuple:
        """Recomputes the forward from `x`, differentiates, and returns (the gradients of
        the boundary's input leaves, per flat weight the running sum `acc` plus its
        gradient): summing here keeps those adds out of the step's graph. Where `acc`
        has a stack, the sum stays on it and a token of the push is returned; where it
        has None (a gathered weight), the weight's own gradient, IndexedSlices or not.
        aux_grads: per auxiliary loss (`aux_keys`), its output gradient, or None to
        leave it out.
        With stamp_recompute, also a tf.timestamp taken once the recomputed outputs exist,
        which the differentiation waits for: the end of the recompute."""
        with tf.device(self.cell.device):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(float_leaves(x) + tf.nest.flatten(theta))
                sink = fprop_context.BatchStatsSink(discard=True)
                aux = fprop_context.AuxLossSink()
                with self._context(offset, step, sink, aux):
                    y = self.cell.forward(theta, x)
            x_leaves, y_leaves, _, _ = self.boundary(x, y)
            values, coefficients = aux_losses.select(aux_losses.records_of(aux), aux_grads)
            recomputed = contextlib.nullcontext()
            if self.stamp_recompute:
                with tf.control_dependencies(tf.nest.flatten(y)):
                    stamp = tf.timestamp(name='recompute_end')
                recomputed = tf.control_dependencies([stamp])
            with recomputed:
                grads = tape.gradient(y_leaves + values, x_leaves + tf.nest.flatten(theta),
                                      output_gradients=list(dy) + coefficients,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
            dx, dtheta = grads[:len(x_leaves)], grads[len(x_leaves):]
            sums = []
            for i, (a, g) in enumerate(zip(acc, dtheta)):
                device = self.weight_devices[i] if i < len(self.weight_devices) else ''
                with tf.device(device) if device else contextlib.nullcontext():
                    sums.append(g if a is None else _add_into(a, tf.convert_to_tensor(g)))
            acc = sums
            return (dx, acc, stamp) if self.stamp_recompute else (dx, acc)

    def record(self, stats: dict, sink: fprop_context.BatchStatsSink) -> None:
        """Puts the statistics a forward call returned into the run's sink."""
        for path, entries in stats.items():
            for count, mean, variance in entries:
                sink.record(self._layers[path], count, mean, variance)

    def aux_records(self, values: list) -> list[aux_losses.Record]:
        """The auxiliary losses of a forward call from the values it returned."""
        return [(key, value, weight) for (key, weight), value in zip(self.aux_keys, values)]


class FunctionalPipelineRun(PipelineRun):
    """A PipelineRun whose tasks call each cell's traced functions."""

    def __init__(self, cells: Sequence[Cell], thetas: Sequence[dict], micro_inputs: Sequence,
                 offsets: Sequence[int], context: fprop_context.FPropContext,
                 jit_compile: bool = False, **kwargs):
        if kwargs.get('split_backward'):
            raise ValueError('cell functions do not support a split backward: use '
                             'PipelineRun for it')
        super().__init__(cells, thetas, micro_inputs, offsets, context, **kwargs)
        self.functions = [CellFunctions(cell, context.training,
                                        functools.partial(self._boundary, k),
                                        jit_compile=jit_compile,
                                        stamp_recompute=self.recorder is not None,
                                        weight_devices=[_device_of(t) for t in
                                                        tf.nest.flatten(self.thetas[k])])
                          for k, cell in enumerate(self.cells)]
        self.jit_compile = jit_compile
        self._offset_tensors: dict[tuple[str, int], tf.Tensor] = {}
        self._stacks: dict[tuple[int, int], tf.Tensor] = {}  # (cell, flat weight) -> sum's
        self._step: Optional[tf.Tensor] = None

    def _arguments(self, k: int, m: int) -> tuple[tf.Tensor, Optional[tf.Tensor]]:
        """Micro-batch m's example offset and the step, as tensors on cell k's device."""
        key = (self.cells[k].device, m)
        if key not in self._offset_tensors:
            self._offset_tensors[key] = _opaque(tf.constant(self.offsets[m], tf.int64))
        step = self.context.step
        if step is not None and not isinstance(step, tf.Tensor):
            if self._step is None:
                self._step = _opaque(tf.convert_to_tensor(step))
            step = self._step
        return self._offset_tensors[key], step

    def _compute_forward(self, k: int, m: int, x: Any) -> Any:
        cell, functions = self.cells[k], self.functions[k]
        keeps = self.context.training and not cell.recompute
        if keeps and not self.jit_compile:
            return super()._compute_forward(k, m, x)  # kept activations: unrolled ops
        theta = self._task_theta(k)
        offset, step = self._arguments(k, m)
        if keeps:  # XLA asked for: the compiled call under the run's tape
            tape = tf.GradientTape(watch_accessed_variables=False)
            with tape:
                tape.watch(float_leaves(x) + tf.nest.flatten(theta))
                y, stats, aux = functions.forward(theta, x, offset, step)
            self.tapes[(k, m)] = (tape, x, [y], functions.aux_records(aux), theta)
        else:
            y, stats, aux = functions.forward(theta, x, offset, step)
        _unchained(y)
        functions.record(stats, self.sinks[k])
        self.aux_forward[(k, m)] = functions.aux_records(aux)
        return y

    def _gradients(self, k: int, m: int, dy: list) -> tuple[list, list, list, dict]:
        if not self._calls_backward(k):
            return super()._gradients(k, m, dy)
        x = self.inputs.pop((k, m))
        theta = self._task_theta(k)
        offset, step = self._arguments(k, m)
        functions, sums = self.functions[k], self.theta_grads[k]
        if sums is None:  # zeros, not None: one trace serves the first micro-batch too
            sums = [None if gathered else self._first_sum(k, i, t)
                    for i, (t, gathered) in enumerate(zip(tf.nest.flatten(self.thetas[k]),
                                                          functions.gathered))]
        acc = [None if gathered else self._stacks.get((k, i), a)
               for i, (a, gathered) in enumerate(zip(sums, functions.gathered))]
        aux_grads = [None if g is None else _opaque(g) for g in aux_losses.coefficients(
            self.aux_forward[(k, m)], self.aux_upstream, self.fractions[m])]
        dx, out, *stamp = functions.backward(theta, x, list(dy), offset, step, acc, aux_grads)
        _unchained(out)
        if stamp:  # the recompute ended inside the call: the timeline's split
            self.recorder.split(k, m, BACKWARD, stamp=stamp[0])
        acc = [accumulate.add(s, _static_shape(g, t)) if gathered else g
               for s, g, t, gathered in zip(sums, out, tf.nest.flatten(self.thetas[k]),
                                            functions.gathered)]
        _, _, x_parts, x_received = self._boundary(k, x, x)  # the input's parts only
        return dx, acc, x_parts, x_received

    def _calls_backward(self, k: int) -> bool:
        """Does cell k's next backward task call its backward function? Only a recomputing
        cell's, and without XLA not its last: that one runs as unrolled ops, so each final
        sum is free to go as soon as it exists (a call returns all of them at its end)."""
        last = self._backwards_done[k] == len(self.outputs) - 1
        return self.cells[k].recompute and (self.jit_compile or not last)

    def _first_sum(self, k: int, i: int, weight: tf.Tensor) -> tf.Tensor:
        """The running sum of cell k's flat weight i before its first micro-batch: zeros
        pushed on a stack of their own (see `_add_into`), or with XLA, which compiles
        no stack, zeros passed in. Returns what stands for the sum until it is popped."""
        with on_device_of(weight):  # a weight shard's sum lies on the shard's device
            return self._new_sum(k, i, weight)

    def _new_sum(self, k: int, i: int, weight: tf.Tensor) -> tf.Tensor:
        if self.jit_compile:
            return tf.zeros_like(weight)
        stack = tf.raw_ops.StackV2(max_size=-1, elem_type=weight.dtype,
                                   stack_name=f'grad_sum_{k}_{i}')
        # Empty is stateful, so never folded into a constant that would stay allocated.
        zeros = tf.raw_ops.Empty(shape=weight.shape.as_list(), dtype=weight.dtype, init=True)
        _run_independently([stack, zeros])  # the push below orders both
        pushed = tf.raw_ops.StackPushV2(handle=stack, elem=zeros)
        with tf.control_dependencies([pushed]):  # every call finds the zeros there
            self._stacks[(k, i)] = tf.identity(stack)
        return pushed

    def _accumulate(self, k: int, dtheta: list) -> None:
        if self._calls_backward(k):  # the backward function returned the new running sum
            self._store_sum(k, dtheta)
            return
        sums = self.theta_grads[k]
        if sums is not None:  # the sums the calls left on stacks come off them, dense
            sums = [self._pop(k, i, s) for i, s in enumerate(sums)]
            self.theta_grads[k] = sums
        super()._accumulate(k, dtheta)

    def _pop(self, k: int, i: int, token: Any) -> Any:
        """Cell k's running sum of flat weight i taken off its stack (which is closed),
        once the call that pushed it (`token`) is done; `token` itself if not stacked."""
        stack = self._stacks.pop((k, i), None)
        if stack is None:
            return token
        weight = tf.nest.flatten(self.thetas[k])[i]
        with on_device_of(weight), tf.control_dependencies([token]):
            total = tf.raw_ops.StackPopV2(handle=stack, elem_type=token.dtype)
            total.set_shape(weight.shape)  # a stack keeps none
            with tf.control_dependencies([total]):
                tf.raw_ops.StackCloseV2(handle=stack)
        return total


def _unchained(call_outputs: Any) -> None:
    """Frees the call of a cell function that returned `call_outputs` from the step's one
    program-order chain, when it is in it.

    tf.function's automatic control dependencies chain every stateful op that takes no
    resource in the order it was built, one chain for the whole step. A function whose
    body runs collectives (a tensor-parallel cell's) is stateful, so its calls were in
    that chain, in the order the replicas' pipelines are built: replica 0's tasks, then
    replica 1's. With ZeRO stage 3's per-task regather (sharded_weights.regatherers)
    that deadlocked: replica 0's second task waits for its weights' all-gather, whose
    replica-1 member runs after replica 1's first task, which the chain put after replica
    0's second. The executor orders each device's tasks itself (`_scope`), and a call's
    collectives have keys of their own, so the chain adds only waits: without it the
    calls of a tensor-parallel cell run as a T=1 cell's (a stateless call, never
    chained) do. A call that takes a resource (a gradient sum's stack) stays ordered
    by it."""
    _run_independently(  # lazily: eagerly a tensor has no op
        t for t in tf.nest.flatten(call_outputs) if isinstance(t, tf.Tensor)
        and t.op.type == 'StatefulPartitionedCall' and all(i.dtype != tf.resource
                                                           for i in t.op.inputs))


def _run_independently(tensors: Iterable[tf.Tensor]) -> None:
    """Leaves the ops of `tensors` (stateful, taking no resource) out of the step's one
    program-order chain (see `_unchained`): their inputs and the executor's control
    dependencies order them. Besides the calls, the gradient sums' StackV2 and Empty need
    it; chained, two steps deadlocked. Expert parallelism: replica 1's last cell's sums
    waited for replica 0's first cell's, which wait for replica 0's last-cell backward
    call, whose all-to-all waits for replica 1's first backward call, which takes those
    sums. ZeRO stage 3 regathering per task with two cells on a device
    (interleaved_1f1b): replica 0's first sum of cell 0 came after its forward of
    micro-batch 1 and before replica 1's first backward, which preceded that replica's
    member of the gather replica 0 waited in."""
    manager = getattr(tf.compat.v1.get_default_graph(), 'experimental_acd_manager', None)
    if manager is None:  # eagerly, or outside tf.function's control dependencies
        return
    for op in dict.fromkeys(t.op for t in tensors):  # each once, in build order
        manager.run_independently(op)


# Ops whose gradient passes an IndexedSlices through, and ops that make one.
_PASS_SLICES = frozenset({'Identity', 'Cast'})
_GATHERS = frozenset({'GatherV2', 'ResourceGather'})


def _only_gathered(t: tf.Tensor) -> bool:
    """Is `t` used only as the params of gathers (through identities and casts)? Then
    its gradient is an IndexedSlices. A wrong guess costs memory, never values: the
    returned gradient is summed by accumulate.add whatever its type."""
    consumers = t.consumers()
    for op in consumers:
        if op.type in _PASS_SLICES:
            if not all(_only_gathered(out) for out in op.outputs):
                return False
        elif op.type not in _GATHERS or op.inputs[0] is not t:
            return False
    return bool(consumers)


def _static_shape(g: Any, weight: tf.Tensor) -> Any:
    """A gradient returned by a call, IndexedSlices with the weight's static dense shape
    (a call's outputs have none), which accumulate.py needs to size the sparse sum."""
    if not isinstance(g, tf.IndexedSlices):
        return g
    return tf.IndexedSlices(g.values, g.indices,
                            tf.constant(weight.shape.as_list(), g.dense_shape.dtype))


def _device_of(t: tf.Tensor) -> str:
    """A graph tensor's device ('' eagerly: the cell's device scope applies)."""
    return '' if tf.executing_eagerly() else t.device


def _opaque(value: tf.Tensor) -> tf.Tensor:
    """`value`, hidden from grappler's constant propagation.

    Grappler's function optimizer specialises a function call per distinct constant
    input: constant offsets would give every (cell, micro-batch) its own copy of the
    cell's function, and optimising and placing those copies costs more than the
    unrolled graph. A PlaceholderWithDefault is never treated as a constant.
    """
    with tf.control_dependencies(None):
        return tf.raw_ops.PlaceholderWithDefault(input=value, shape=value.shape)


def _add_into(acc: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """acc + g, where acc is the running sum or (a resource) the stack it lies on.

    A function call's caller holds its inputs until the call returns, so `acc + g`
    inside the call could never write into acc's buffer: the call would hold the old
    and the new running sum of its cell at once (measured: 1.47 gradient sets beyond
    M=1 instead of 1). Popped off a stack inside the call, the sum is held by nothing
    else, the add reuses its buffer, and the new sum goes back on the stack. Returns
    the sum, or for a stack a token of the push."""
    if acc.dtype != tf.resource:
        return acc + g
    total = tf.raw_ops.StackPopV2(handle=acc, elem_type=g.dtype) + g
    with tf.control_dependencies([tf.raw_ops.StackPushV2(handle=acc, elem=total)]):
        return tf.zeros([0], g.dtype)  # a token: returning the sum would hold its buffer
