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
cell's running sum (one set of accumulators per cell, never M sets alive), pass
the input gradient to cell k-1.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.pipeline.cell import Cell
from tfpipe.pipeline.schedule import BACKWARD, FORWARD, Task
from tfpipe.pipeline.timeline import RECOMPUTE, Recorder

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
                 need_input_grads: bool = False, on_output: Optional[OnOutput] = None,
                 recorder: Optional[Recorder] = None):
        self.cells = list(cells)
        self.recorder = recorder  # stamps every task's start and end when given
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

    def _scope(self, k: int, m: int, phase: str, extra_deps: Sequence[tf.Tensor] = (),
               inputs: Any = (), recorded_phase: Optional[str] = None):
        cell = self.cells[k]
        deps = list(self._last[k]) + list(extra_deps)
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

    def _context(self, m: int, sink: fprop_context.BatchStatsSink):
        ctx = self.context
        return fprop_context.scope(training=ctx.training, step=ctx.step,
                                   example_offset=self.offsets[m], batch_stats=sink)

    def _forward(self, k: int, m: int) -> None:
        cell, theta = self.cells[k], self.thetas[k]
        with self._scope(k, m, 'forward', inputs=self.inputs[(k, m)]):
            x = tf.nest.map_structure(tf.identity, self.inputs[(k, m)])
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
            self.inputs[(k + 1, m)] = y
            self._end(k, m, self._last[k])
            return
        self.outputs[m] = y
        grads = None
        if self.on_output is not None:
            with tf.device(cell.device), tf.name_scope(f'cell_{k}/loss_{m}'):
                grads = self.on_output(m, y)
            if grads is not None:
                self.output_grads[(k, m)] = grads
        self._end(k, m, self._last[k] + list(grads or []))  # the loss counts as forward

    def _backward(self, k: int, m: int) -> None:
        cell, theta = self.cells[k], self.thetas[k]
        dy = self.output_grads.pop((k, m))
        saved = self.inputs.get((k, m)) if cell.recompute else self.tapes[(k, m)][1:]
        with self._scope(k, m, 'backward', extra_deps=dy, inputs=(dy, saved),
                         recorded_phase=RECOMPUTE if cell.recompute else None):
            if cell.recompute:
                x = tf.nest.map_structure(tf.identity, self.inputs.pop((k, m)))
                tape = tf.GradientTape(watch_accessed_variables=False)
                with tape:
                    tape.watch(float_leaves(x) + tf.nest.flatten(theta))
                    with self._context(m, fprop_context.BatchStatsSink(discard=True)):
                        y = cell.forward(theta, x)
            else:
                tape, x, y = self.tapes.pop((k, m))
            x_leaves = float_leaves(x) if k > 0 or self.need_input_grads else []
            flat_theta = tf.nest.flatten(theta)
            recomputed = (self.recorder.split(k, m, BACKWARD, tf.nest.flatten(y))
                          if self.recorder is not None and cell.recompute else None)
            with tf.control_dependencies([recomputed] if recomputed is not None else []):
                grads = tape.gradient(float_leaves(y), x_leaves + flat_theta,
                                      output_gradients=dy,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
            dx, dtheta = grads[:len(x_leaves)], grads[len(x_leaves):]
            # Embedding lookups give IndexedSlices; the accumulator is dense.
            dtheta = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                      for g in dtheta]
            acc = self.theta_grads[k]
            self.theta_grads[k] = dtheta if acc is None else [a + g for a, g in zip(acc, dtheta)]
        self._last[k] = list(self.theta_grads[k]) + list(dx)
        self._end(k, m, self._last[k])
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
