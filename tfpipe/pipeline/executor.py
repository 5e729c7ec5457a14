"""Runs a pipeline schedule: builds each task's ops on its cell's device, in order.

Every task of the schedule becomes ops placed under `tf.device(cell.device)`.
TensorFlow's executor would otherwise run ready ops as early as it can, which
defeats both re-materialisation and bounded gradient accumulation (see
shared notes: recompute started early costs as much memory as no recompute;
M backward passes started at once hold M sets of gradients). So the executor
adds control dependencies that make each device run its tasks in schedule
order, and makes a recompute wait for its incoming gradient.

Forward task F(k, m): cell k on micro-batch m. A recomputing cell keeps only
its input; a non-recomputing cell records a tape to differentiate later.
Backward task B(k, m): recompute (if the cell does) under the cell's device,
differentiate with the incoming gradient, add the weight gradients into the
cell's running sum (one set of accumulators per cell, never M sets alive;
embedding gradients stay sparse while that is smaller, see accumulate.py), pass
the input gradient to cell k-1.

Zero-bubble schedules split B in two. The input part computes the gradients of
the cell's input and of every layer's output (recomputing first, if the cell
recomputes) and passes the input gradient on at once; the weight part, later,
takes each layer's weight gradients from that layer's output gradient alone,
so it repeats no backward work of the input part. Between the two the cell
keeps its tape (the recomputed activations): that memory is what W's freedom
costs.

Ordering is per device, not per cell: with virtual stages several cells share
a device and their tasks run in the schedule's order for that device.

Skip connections that span cells (layers.Stash ... layers.Pop) travel through
portals (see portals.py): from the stashing cell's forward straight to the
popping cell's, and their gradients straight back.

Auxiliary losses a layer records (a mixture of experts' load-balancing loss) are
collected per (cell, micro-batch) and differentiated in the same backward as the
cell's outputs, weighted b_m / N (aux_losses.py); the forward's values are reported.

A task's computation (`_compute_forward`, `_gradients`) is separate from its
scheduling (device, control dependencies, portals, recorder): cell_functions.py
replaces the computation by calls of each cell's traced functions.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional, Sequence

import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.pipeline import accumulate, aux_losses, microbatch, portals
from tfpipe.pipeline.cell import Cell
from tfpipe.pipeline.recorder import Recorder
from tfpipe.pipeline.schedule import BACKWARD, BACKWARD_INPUT, FORWARD, RECOMPUTE, Task

OnOutput = Callable[[int, Any], Optional[list]]


def is_differentiable(t: tf.Tensor) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


def on_device_of(t: Any):
    """A device scope on `t`'s device where a graph tensor has one set (a weight shard
    read on its own device under tensor parallelism), else no change."""
    device = '' if tf.executing_eagerly() else getattr(t, 'device', '')
    return tf.device(device) if device else contextlib.nullcontext()


def float_leaves(struct: Any) -> list[tf.Tensor]:
    """The differentiable leaves of a nested activation, in tf.nest order."""
    return [t for t in tf.nest.flatten(struct) if is_differentiable(t)]


class PipelineRun:
    """The ops of one mini-batch through the pipeline, built task by task."""

    def __init__(self, cells: Sequence[Cell], thetas: Sequence[dict], micro_inputs: Sequence,
                 offsets: Sequence[int], context: fprop_context.FPropContext,
                 need_input_grads: bool = False, on_output: Optional[OnOutput] = None,
                 split_backward: bool = False, recorder: Optional[Recorder] = None,
                 global_batch: Optional[int] = None,
                 regather: Optional[Callable[[int], dict]] = None):
        """global_batch: the examples of the whole (global) mini-batch, which weigh each
        micro-batch's auxiliary losses (aux_losses.py); None: this run's.
        regather: cell k's whole weights gathered anew (ZeRO stage 3's
        regather_per_micro_batch, sharded_weights.py), called in each forward and
        backward task of a recomputing cell, whose `thetas[k]` then holds the
        latest gather (its shapes and devices size the gradient sums)."""
        self.cells = list(cells)
        self.recorder = recorder  # stamps every task's start and end when given
        self.thetas = list(thetas)
        self.offsets = list(offsets)
        self.context = context
        self.need_input_grads = need_input_grads
        self.on_output = on_output
        self.split_backward = split_backward
        self.regather = regather
        num_cells = len(self.cells)
        self.inputs: dict[tuple[int, int], Any] = {(0, m): x for m, x in enumerate(micro_inputs)}
        self.tapes: dict[tuple[int, int], tuple[tf.GradientTape, Any]] = {}
        self.output_grads: dict[tuple[int, int], list] = {}
        self.outputs: list = [None] * len(micro_inputs)
        self.input_grads: list = [None] * len(micro_inputs)
        self.theta_grads: list[Optional[list]] = [None] * num_cells
        self.sinks = [fprop_context.BatchStatsSink() for _ in range(num_cells)]
        sizes = [microbatch.batch_size(x) for x in micro_inputs]
        self.fractions = [b / (global_batch or sum(sizes)) for b in sizes]
        # Per (cell, micro-batch): the auxiliary losses its forward recorded (reported).
        self.aux_forward: dict[tuple[int, int], list[aux_losses.Record]] = {}
        # Per loss key, the gradient of its reported sum; None: each loss's weight.
        self.aux_upstream: Optional[dict] = None
        # Per (cell, micro-batch) between a split backward's input and weight parts.
        self._awaiting_weights: dict[tuple[int, int], tuple] = {}
        self._last: dict[str, list[tf.Tensor]] = {}  # device -> outputs of its last task
        self._backwards_done = [0] * num_cells
        self.routes = portals.routes(self.cells)
        self.inbound = portals.inbound(self.routes)
        self.portal_inputs: dict[tuple[int, int], dict] = {}  # (dest, m) -> {key: tensor}
        self.portal_grads: dict[tuple[int, int], dict] = {}  # (source, m) -> {key: grads}

    # -- Public --------------------------------------------------------------------------

    # AutoGraph would convert every function the tasks call, once per (cell, micro-batch)
    # closure: most of the tracing time at large K*M. Nothing here branches on tensors.
    @tf.autograph.experimental.do_not_convert
    def run(self, tasks: Iterable[Task]) -> None:
        for task in tasks:
            if task.phase == FORWARD:
                self._forward(task.cell, task.micro_batch)
            elif task.phase == BACKWARD:
                self._backward(task.cell, task.micro_batch)
            elif task.phase == BACKWARD_INPUT:
                self._backward_input(task.cell, task.micro_batch)
            else:
                self._backward_weight(task.cell, task.micro_batch)

    def set_output_grads(self, grads_by_micro_batch: Sequence[list]) -> None:
        """Gradients of the final outputs (float leaves), one list per micro-batch."""
        last = len(self.cells) - 1
        for m, grads in enumerate(grads_by_micro_batch):
            self.output_grads[(last, m)] = grads

    def apply_batch_stats(self) -> None:
        """One moving-statistics update per BatchNorm, from all its micro-batches."""
        for cell, sink in zip(self.cells, self.sinks):
            with tf.device(cell.device), tf.name_scope(f'cell_{cell.index}/batch_stats'):
                for layer, stats in sink.records.values():
                    layer.ApplyBatchStatistics(stats)

    def aux_report(self) -> dict:
        """{(layer path, name): (sum over micro-batches of b_m / N x value, weight)}."""
        keys = sorted(self.aux_forward)
        return aux_losses.summed([self.aux_forward[key] for key in keys],
                                 [self.fractions[m] for _, m in keys])

    def theta_grads_of(self, k: int) -> dict:
        """Cell k's accumulated weight gradients, in the structure of its theta."""
        return tf.nest.pack_sequence_as(self.thetas[k], self.theta_grads[k])

    # -- Tasks ---------------------------------------------------------------------------

    def _scope(self, k: int, m: int, phase: str, extra_deps: Sequence[tf.Tensor] = (),
               inputs: Any = (), recorded_phase: Optional[str] = None):
        cell = self.cells[k]
        deps = list(self._last.get(cell.device, [])) + list(extra_deps)
        scopes = [tf.device(cell.device), tf.name_scope(f'cell_{k}/{phase}_{m}'),
                  tf.control_dependencies(deps)]
        if self.recorder is not None:
            scopes.append(self.recorder.begin(cell.device, k, m, recorded_phase or phase,
                                              tf.nest.flatten(inputs)))
        return _Scopes(*scopes)

    def _end(self, k: int, m: int, outputs: Sequence[tf.Tensor]) -> None:
        if self.recorder is not None:
            with tf.device(self.cells[k].device):
                self.recorder.end(k, m, outputs)

    def _context(self, m: int, sink: fprop_context.BatchStatsSink,
                 aux: fprop_context.AuxLossSink):
        ctx = self.context
        # A step variable (the trainer's global_step) is read here: a read inside a
        # tensor-parallel shard's tf.custom_gradient (Dropout.Mask) would make it
        # demand gradients for the variable.
        step = ctx.step.read_value() if isinstance(ctx.step, tf.Variable) else ctx.step
        return fprop_context.scope(training=ctx.training, step=step,
                                   example_offset=self.offsets[m], batch_stats=sink,
                                   aux_losses=aux)

    def _forward(self, k: int, m: int) -> None:
        cell = self.cells[k]
        portal_x = self.portal_inputs.pop((k, m), {})
        with self._scope(k, m, 'forward', inputs=(self.inputs[(k, m)], portal_x)):
            x = portals.give(self.inputs[(k, m)], portal_x)
            x = tf.nest.map_structure(tf.identity, x)  # on this device: the copy
            self.inputs[(k, m)] = x
            y = self._compute_forward(k, m, x)
            if not (cell.recompute and self.context.training):
                del self.inputs[(k, m)]  # only a recomputing cell needs its input again
        self._last[cell.device] = tf.nest.flatten(y)
        if k + 1 < len(self.cells):
            y, sent = portals.take(y, self.routes.get(k, {}))
            for key, value in sent.items():
                self.portal_inputs.setdefault((self.routes[k][key], m), {})[key] = value
            self.inputs[(k + 1, m)] = y
            self._end(k, m, self._last[cell.device])
            return
        self.outputs[m] = y
        grads = None
        if self.on_output is not None:
            with tf.device(cell.device), tf.name_scope(f'cell_{k}/loss_{m}'):
                grads = self.on_output(m, y)
            if grads is not None:
                self.output_grads[(k, m)] = grads
        self._end(k, m, self._last[cell.device] + list(grads or []))  # the loss: forward

    def _compute_forward(self, k: int, m: int, x: Any) -> Any:
        """F(k, m)'s computation (under its device and scope): the cell's output, with a
        tape kept for the backward unless the cell recomputes."""
        cell, theta = self.cells[k], self._task_theta(k)
        aux = fprop_context.AuxLossSink()
        with self._context(m, self.sinks[k], aux):
            if cell.recompute or not self.context.training:
                y = cell.forward(theta, x)
            else:
                tape = tf.GradientTape(watch_accessed_variables=False,
                                       persistent=self.split_backward)
                with tape:
                    tape.watch(float_leaves(x) + tf.nest.flatten(theta))
                    outs = cell.forward_layers(theta, x)
                self.tapes[(k, m)] = (tape, x, outs, aux_losses.records_of(aux), theta)
                y = outs[-1]
        self.aux_forward[(k, m)] = aux_losses.records_of(aux)
        return y

    def _backward(self, k: int, m: int) -> None:
        cell = self.cells[k]
        dy = self._incoming_grads(k, m)
        with self._scope(k, m, 'backward', extra_deps=dy, inputs=(dy, self._saved(k, m)),
                         recorded_phase=RECOMPUTE if cell.recompute else None):
            dx, dtheta, x_parts, x_received = self._gradients(k, m, dy)
            self._accumulate(k, dtheta)
        self._last[cell.device] = tf.nest.flatten(list(self.theta_grads[k]) + list(dx),
                                                  expand_composites=True)
        self._end(k, m, self._last[cell.device])
        self._pass_input_grads(k, m, dx, x_parts, x_received)

    def _backward_input(self, k: int, m: int) -> None:
        """B of a split backward: gradients of the input and of every layer's output."""
        cell = self.cells[k]
        dy = self._incoming_grads(k, m)
        with self._scope(k, m, 'backward_input', extra_deps=dy, inputs=(dy, self._saved(k, m)),
                         recorded_phase=RECOMPUTE if cell.recompute else None):
            tape, x, outs, records, theta = self._tape_of(k, m)
            x_leaves, y_leaves, x_parts, x_received = self._boundary(k, x, outs[-1])
            inner = [float_leaves(o) for o in outs[:-1]]
            values, coefficients = self._aux_targets(m, records)
            with self._after_recompute(k, m, BACKWARD_INPUT, outs):
                grads = tape.gradient(y_leaves + values,
                                      x_leaves + [t for o in inner for t in o],
                                      output_gradients=list(dy) + coefficients,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
            dx, rest = grads[:len(x_leaves)], grads[len(x_leaves):]
            douts, pos = [], 0
            for leaves in inner:
                douts.append(rest[pos:pos + len(leaves)])
                pos += len(leaves)
        # Layer i's weights are differentiated from its output (and its own auxiliary
        # losses) alone, in the W task.
        self._awaiting_weights[(k, m)] = (tape, inner + [y_leaves], douts + [list(dy)],
                                          records, theta)
        self._last[cell.device] = list(dx) + [g for d in douts for g in d]
        self._end(k, m, self._last[cell.device])
        self._pass_input_grads(k, m, dx, x_parts, x_received)

    def _backward_weight(self, k: int, m: int) -> None:
        """W of a split backward: each layer's weight gradients from its output gradient."""
        cell = self.cells[k]
        tape, targets, douts, records, theta = self._awaiting_weights.pop((k, m))
        with self._scope(k, m, 'backward_weight', inputs=douts):
            by_layer = {}
            for layer, target, dout in zip(cell.layers, targets, douts):
                name = layer.params.name
                flat = tf.nest.flatten(theta[name])
                values, coefficients = self._aux_targets(
                    m, aux_losses.under(records, layer.path))
                grads = tape.gradient(list(target) + values, flat,
                                      output_gradients=list(dout) + coefficients,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
                by_layer[name] = tf.nest.pack_sequence_as(theta[name], grads)
            del tape  # frees the activations it held since the input part
            self._accumulate(k, tf.nest.flatten({n: by_layer[n] for n in theta}))
        self._last[cell.device] = tf.nest.flatten(list(self.theta_grads[k]),
                                                  expand_composites=True)
        self._end(k, m, self._last[cell.device])

    # -- Backward helpers ----------------------------------------------------------------

    def _gradients(self, k: int, m: int, dy: list) -> tuple[list, list, list, dict]:
        """B(k, m)'s computation: (input gradients, flat weight gradients) and the
        input's parts for `_pass_input_grads`, recomputing first if the cell does."""
        tape, x, outs, records, theta = self._tape_of(k, m)
        x_leaves, y_leaves, x_parts, x_received = self._boundary(k, x, outs[-1])
        values, coefficients = self._aux_targets(m, records)
        with self._after_recompute(k, m, BACKWARD, outs):
            grads = tape.gradient(y_leaves + values,
                                  x_leaves + tf.nest.flatten(theta),
                                  output_gradients=list(dy) + coefficients,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return grads[:len(x_leaves)], grads[len(x_leaves):], x_parts, x_received

    def _saved(self, k: int, m: int) -> Any:
        """What a backward task starts from besides dy: the input it recomputes from, or
        the forward's recorded tape outputs (the timeline's start waits for them)."""
        return self.inputs.get((k, m)) if self.cells[k].recompute else self.tapes[(k, m)][1:3]

    def _aux_targets(self, m: int, records: list) -> tuple[list, list]:
        """The auxiliary losses a backward of micro-batch m differentiates beside the
        cell's outputs, and their output gradients (aux_losses.py)."""
        return aux_losses.targets(records, self.aux_upstream, self.fractions[m])

    def _after_recompute(self, k: int, m: int, phase: str, outs: list):
        """With a timeline: ends the recompute event when the recomputed outputs exist
        and makes the differentiation wait for that stamp (recompute -> `phase`)."""
        if self.recorder is None or not self.cells[k].recompute:
            return contextlib.nullcontext()
        stamp = self.recorder.split(k, m, phase, tf.nest.flatten(outs[-1]))
        return tf.control_dependencies([stamp])

    def _incoming_grads(self, k: int, m: int) -> list:
        """The gradient of the cell's output, then those of the skips it sent by portal."""
        dy = self.output_grads.pop((k, m))
        portal_dy = self.portal_grads.pop((k, m), {})
        return dy + [g for key in sorted(portal_dy) for g in portal_dy[key]]

    def _tape_of(self, k: int, m: int) -> tuple[tf.GradientTape, Any, list, list, dict]:
        """The tape of F(k, m), the outputs of each of the cell's layers, the auxiliary
        losses and the weights it watched: recorded by the forward, or recomputed now
        (under the caller's device and scope; the recomputed losses are differentiated,
        never reported)."""
        cell = self.cells[k]
        if not cell.recompute:
            return self.tapes.pop((k, m))
        theta = self._task_theta(k)
        x = tf.nest.map_structure(tf.identity, self.inputs.pop((k, m)))
        tape = tf.GradientTape(watch_accessed_variables=False, persistent=self.split_backward)
        aux = fprop_context.AuxLossSink()
        with tape:
            tape.watch(float_leaves(x) + tf.nest.flatten(theta))
            with self._context(m, fprop_context.BatchStatsSink(discard=True), aux):
                outs = cell.forward_layers(theta, x)
        return tape, x, outs, aux_losses.records_of(aux), theta

    def _task_theta(self, k: int) -> dict:
        """Cell k's weights for the task being built: regathered here, in the task's
        scope, for a recomputing cell when the run regathers per task."""
        if self.regather is not None and self.cells[k].recompute:
            self.thetas[k] = self.regather(k)
        return self.thetas[k]

    def _boundary(self, k: int, x: Any, y: Any) -> tuple[list, list, list, dict]:
        """The leaves to differentiate: the cell's input (main part first, then the skips
        it received by portal) and its output (main part, then the skips it sends)."""
        y_main, y_sent = portals.take(y, self.routes.get(k, {}))
        x_main, x_received = portals.take(x, self.inbound.get(k, {}))
        x_parts = [float_leaves(x_main)] + [float_leaves(v) for v in x_received.values()]
        if k == 0 and not self.need_input_grads:
            x_parts = [[]]
        x_leaves = [t for part in x_parts for t in part]
        y_leaves = float_leaves(y_main) + [t for v in y_sent.values() for t in float_leaves(v)]
        return x_leaves, y_leaves, x_parts, x_received

    def _accumulate(self, k: int, dtheta: list) -> None:
        """Adds one micro-batch's weight gradients into cell k's sums (dense at the end)."""
        acc = self.theta_grads[k] or [None] * len(dtheta)
        sums = []
        for a, g, weight in zip(acc, dtheta, tf.nest.flatten(self.thetas[k])):
            with on_device_of(weight):  # a weight shard's sum stays on the shard's device
                sums.append(accumulate.add(a, g))
        self._store_sum(k, sums)

    def _store_sum(self, k: int, acc: list) -> None:
        """Cell k's running sum after one more micro-batch (made dense after its last)."""
        self._backwards_done[k] += 1
        if self._backwards_done[k] == len(self.outputs):  # the cell's last micro-batch
            acc = [tf.convert_to_tensor(a) for a in acc]
        self.theta_grads[k] = acc

    def _pass_input_grads(self, k: int, m: int, grads: list, x_parts: list,
                          x_received: dict) -> None:
        """The main input gradient to cell k-1; skip gradients back to their sources."""
        dx, pos = grads[:len(x_parts[0])], len(x_parts[0])
        for key, part in zip(x_received, x_parts[1:]):
            source = self.inbound[k][key]
            self.portal_grads.setdefault((source, m), {})[key] = grads[pos:pos + len(part)]
            pos += len(part)
        if k > 0:
            self.output_grads[(k - 1, m)] = dx
        else:
            self.input_grads[m] = dx


class _Scopes:
    """Enters several context managers as one (device, name scope, dependencies)."""

    def __init__(self, *managers):
        self._managers = managers

    def __enter__(self):
        for manager in self._managers:
            manager.__enter__()

    def __exit__(self, *exc):
        for manager in reversed(self._managers):
            manager.__exit__(*exc)
        return False
