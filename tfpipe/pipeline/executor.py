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

Skip connections that span cells (layers.Stash ... layers.Pop) travel through
portals (see portals.py): from the stashing cell's forward straight to the
popping cell's, and their gradients straight back.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.pipeline import accumulate, portals
from tfpipe.pipeline.cell import Cell
from tfpipe.pipeline.schedule import FORWARD, Task

OnOutput = Callable[[int, Any], Optional[list]]


def is_differentiable(t: tf.Tensor) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


def float_leaves(struct: Any) -> list[tf.Tensor]:
    """The differentiable leaves of a nested activation, in tf.nest order."""
    return [t for t in tf.nest.flatten(struct) if is_differentiable(t)]


class PipelineRun:
    """The ops of one mini-batch through the pipeline, built task by task."""

    def __init__(self, cells: Sequence[Cell], thetas: Sequence[dict], micro_inputs: Sequence,
                 offsets: Sequence[int], context: fprop_context.FPropContext,
                 need_input_grads: bool = False, on_output: Optional[OnOutput] = None):
        self.cells = list(cells)
        self.thetas = list(thetas)
        self.offsets = list(offsets)
        self.context = context
        self.need_input_grads = need_input_grads
        self.on_output = on_output
        num_cells = len(self.cells)
        self.inputs: dict[tuple[int, int], Any] = {(0, m): x for m, x in enumerate(micro_inputs)}
        self.tapes: dict[tuple[int, int], tuple[tf.GradientTape, Any]] = {}
        self.output_grads: dict[tuple[int, int], list] = {}
        self.outputs: list = [None] * len(micro_inputs)
        self.input_grads: list = [None] * len(micro_inputs)
        self.theta_grads: list[Optional[list]] = [None] * num_cells
        self.sinks = [fprop_context.BatchStatsSink() for _ in range(num_cells)]
        self._last: list[list[tf.Tensor]] = [[] for _ in range(num_cells)]
        self._backwards_done = [0] * num_cells
        self.routes = portals.routes(self.cells)
        self.inbound = portals.inbound(self.routes)
        self.portal_inputs: dict[tuple[int, int], dict] = {}  # (dest, m) -> {key: tensor}
        self.portal_grads: dict[tuple[int, int], dict] = {}  # (source, m) -> {key: grads}

    # -- Public --------------------------------------------------------------------------

    def run(self, tasks: Iterable[Task]) -> None:
        for task in tasks:
            if task.phase == FORWARD:
                self._forward(task.cell, task.micro_batch)
            else:
                self._backward(task.cell, task.micro_batch)

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

    def theta_grads_of(self, k: int) -> dict:
        """Cell k's accumulated weight gradients, in the structure of its theta."""
        return tf.nest.pack_sequence_as(self.thetas[k], self.theta_grads[k])

    # -- Tasks ---------------------------------------------------------------------------

    def _scope(self, k: int, m: int, phase: str, extra_deps: Sequence[tf.Tensor] = ()):
        cell = self.cells[k]
        deps = list(self._last[k]) + list(extra_deps)
        return _Scopes(tf.device(cell.device), tf.name_scope(f'cell_{k}/{phase}_{m}'),
                       tf.control_dependencies(deps))

    def _context(self, m: int, sink: fprop_context.BatchStatsSink):
        ctx = self.context
        return fprop_context.scope(training=ctx.training, step=ctx.step,
                                   example_offset=self.offsets[m], batch_stats=sink)

    def _forward(self, k: int, m: int) -> None:
        cell, theta = self.cells[k], self.thetas[k]
        with self._scope(k, m, 'forward'):
            x = portals.give(self.inputs[(k, m)], self.portal_inputs.pop((k, m), {}))
            x = tf.nest.map_structure(tf.identity, x)  # on this device: the copy
            self.inputs[(k, m)] = x
            with self._context(m, self.sinks[k]):
                if cell.recompute or not self.context.training:
                    y = cell.forward(theta, x)
                else:
                    tape = tf.GradientTape(watch_accessed_variables=False)
                    with tape:
                        tape.watch(float_leaves(x) + tf.nest.flatten(theta))
                        y = cell.forward(theta, x)
                    self.tapes[(k, m)] = (tape, x, y)
            if not (cell.recompute and self.context.training):
                del self.inputs[(k, m)]  # only a recomputing cell needs its input again
        self._last[k] = tf.nest.flatten(y)
        if k + 1 < len(self.cells):
            y, sent = portals.take(y, self.routes.get(k, {}))
            for key, value in sent.items():
                self.portal_inputs.setdefault((self.routes[k][key], m), {})[key] = value
            self.inputs[(k + 1, m)] = y
            return
        self.outputs[m] = y
        if self.on_output is not None:
            with tf.device(cell.device), tf.name_scope(f'cell_{k}/loss_{m}'):
                grads = self.on_output(m, y)
            if grads is not None:
                self.output_grads[(k, m)] = grads

    def _backward(self, k: int, m: int) -> None:
        cell, theta = self.cells[k], self.thetas[k]
        dy = self.output_grads.pop((k, m))
        portal_dy = self.portal_grads.pop((k, m), {})
        dy = dy + [g for key in sorted(portal_dy) for g in portal_dy[key]]
        with self._scope(k, m, 'backward', extra_deps=dy):
            if cell.recompute:
                x = tf.nest.map_structure(tf.identity, self.inputs.pop((k, m)))
                tape = tf.GradientTape(watch_accessed_variables=False)
                with tape:
                    tape.watch(float_leaves(x) + tf.nest.flatten(theta))
                    with self._context(m, fprop_context.BatchStatsSink(discard=True)):
                        y = cell.forward(theta, x)
            else:
                tape, x, y = self.tapes.pop((k, m))
            y_main, y_sent = portals.take(y, self.routes.get(k, {}))
            x_main, x_received = portals.take(x, self.inbound.get(k, {}))
            x_parts = [float_leaves(x_main)] + [float_leaves(v) for v in x_received.values()]
            if k == 0 and not self.need_input_grads:
                x_parts = [[]]
            x_leaves = [t for part in x_parts for t in part]
            y_leaves = float_leaves(y_main) + [t for v in y_sent.values() for t in float_leaves(v)]
            flat_theta = tf.nest.flatten(theta)
            grads = tape.gradient(y_leaves, x_leaves + flat_theta, output_gradients=dy,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            dx, dtheta = grads[:len(x_leaves)], grads[len(x_leaves):]
            acc = self.theta_grads[k] or [None] * len(dtheta)
            acc = [accumulate.add(a, g) for a, g in zip(acc, dtheta)]
            self._backwards_done[k] += 1
            if self._backwards_done[k] == len(self.outputs):  # the cell's last micro-batch
                acc = [tf.convert_to_tensor(a) for a in acc]
            self.theta_grads[k] = acc
        self._last[k] = tf.nest.flatten(list(self.theta_grads[k]) + list(dx),
                                        expand_composites=True)
        dx, pos = dx[:len(x_parts[0])], len(x_parts[0])
        for key, part in zip(x_received, x_parts[1:]):  # gradients back through the portals
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
