"""The recorder hooks of a pipelined step: `tf.timestamp` ops around each task.

The executor calls `begin` / `split` / `end` per task while it builds the step;
this is all the running side knows of measurement. A task's start stamp waits
(by control dependencies) for the task's inputs, for the end stamp of every
task that produced them and for the device's previous task, and every op of
the task waits for the start stamp; its end stamp waits for the task's
outputs. So each event brackets exactly the ops of its task, and the stamps
add edges but never change a value. Turning the stamps into a timeline, its
bubble and its files is analysis: `tfpipe.tuning.timeline`.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Optional, Sequence

import tensorflow as tf
# ACD's resolver registry (see _ANCHOR_OF) is only reachable here.
from tensorflow.python.framework import auto_control_deps


# tf.function's automatic control dependencies (ACD) chain every stateful op without a
# resource input in the order the step was built: bare tf.timestamp ops would chain all
# devices' stamps, and so serialize the very devices being measured. ACD's resolver
# registry lets an op declare the resources it touches: each stamp declares a read of a
# never-written handle, which leaves it out of that chain (reads are not ordered among
# themselves); the stamp's own control dependencies order it.
_ANCHOR_OF: 'weakref.WeakKeyDictionary[tf.Operation, tf.Tensor]' = weakref.WeakKeyDictionary()


@auto_control_deps.register_acd_resource_resolver
def _timeline_stamps_read_their_anchor(op, resource_reads, resource_writes) -> bool:
    del resource_writes
    anchor = _ANCHOR_OF.get(op)
    if anchor is None or anchor in resource_reads:
        return False
    resource_reads.add(anchor)
    return True


@dataclasses.dataclass(frozen=True)
class Label:
    """What one recorded interval was: a phase of cell `cell` on `micro_batch`."""
    device: str
    cell: int
    micro_batch: int
    phase: str


class Recorder:
    """Adds start/end `tf.timestamp` ops around the executor's tasks, in graph order."""

    def __init__(self):
        self.labels: list[Label] = []
        self._stamps: list[tuple[tf.Tensor, tf.Tensor]] = []
        self._open: dict[tuple[int, int], tuple[Label, tf.Tensor]] = {}
        self._end_of: dict[Any, tf.Tensor] = {}  # output tensor ref -> its task's end stamp
        self._last_end: dict[str, tf.Tensor] = {}  # device -> end stamp of its last task
        self._anchor: Optional[tf.Tensor] = None

    def unchain(self, op: tf.Operation) -> None:
        """Leaves a stateful op of the recording (a stamp, or a function call with a
        stamp inside) out of tf.function's program-order chain (see _ANCHOR_OF)."""
        if self._anchor is None or self._anchor.graph is not op.graph:
            with tf.control_dependencies(None), tf.name_scope('timeline'):
                self._anchor = tf.raw_ops.VarHandleOp(
                    dtype=tf.float32, shape=[], shared_name='tfpipe_timeline_anchor')
        _ANCHOR_OF[op] = self._anchor

    def timestamp(self, name: str) -> tf.Tensor:
        stamp = tf.timestamp(name=name)
        self.unchain(stamp.op)
        return stamp

    def begin(self, device: str, cell: int, micro_batch: int, phase: str,
              inputs: Sequence[tf.Tensor]) -> '_Start':
        """A context manager entered inside the task's device scope: stamps the start
        once `inputs` exist and makes every op created in it wait for that stamp."""
        return _Start(self, Label(device, cell, micro_batch, phase), list(inputs))

    def split(self, cell: int, micro_batch: int, phase: str, ready: Sequence[tf.Tensor] = (),
              stamp: Optional[tf.Tensor] = None) -> tf.Tensor:
        """Ends the open event of (cell, micro_batch) when `ready` exist (or at `stamp`,
        taken by the caller) and opens `phase` at the same stamp (recompute ->
        backward). Returns the stamp, which the next phase's ops must wait for."""
        label, start = self._open.pop((cell, micro_batch))
        if stamp is not None:
            self.unchain(stamp.op)
        else:
            with tf.control_dependencies(_ops(ready)):
                stamp = self.timestamp(f'{label.phase}_end')
        self._close(label, start, stamp)
        self._open[(cell, micro_batch)] = (dataclasses.replace(label, phase=phase), stamp)
        return stamp

    def end(self, cell: int, micro_batch: int, outputs: Sequence[tf.Tensor]) -> None:
        """Stamps the end of the open event of (cell, micro_batch) once `outputs` exist;
        call it under the task's device scope."""
        label, start = self._open.pop((cell, micro_batch))
        with tf.control_dependencies(None), tf.control_dependencies(_ops(outputs)):
            stamp = self.timestamp(f'{label.phase}_end')
        self._close(label, start, stamp)
        for t in outputs:
            self._end_of[t.ref()] = stamp
        self._last_end[label.device] = stamp

    def stamps(self) -> tf.Tensor:
        """[events, 2] float64 (start, end) in seconds since the epoch, in `labels` order:
        return it from the step's tf.function."""
        if self._open:
            raise ValueError(f'tasks {sorted(self._open)} were begun but not ended: stamps() '
                             'must be read after the whole step (forward and backward) is built')
        with tf.name_scope('timeline'):
            return tf.stack([tf.stack(pair) for pair in self._stamps])

    def _close(self, label: Label, start: tf.Tensor, end: tf.Tensor) -> None:
        self.labels.append(label)
        self._stamps.append((start, end))

    def _start_deps(self, label: Label, inputs: list[tf.Tensor]) -> list:
        deps = _ops(inputs)
        deps += [self._end_of[t.ref()] for t in inputs if t.ref() in self._end_of]
        if label.device in self._last_end:
            deps.append(self._last_end[label.device])
        return deps


class _Start:
    def __init__(self, recorder: Recorder, label: Label, inputs: list[tf.Tensor]):
        self._recorder, self._label, self._inputs = recorder, label, inputs
        self._deps = None

    def __enter__(self):
        with tf.control_dependencies(self._recorder._start_deps(self._label, self._inputs)):
            stamp = self._recorder.timestamp(f'{self._label.phase}_start')
        self._recorder._open[(self._label.cell, self._label.micro_batch)] = (self._label, stamp)
        self._deps = tf.control_dependencies([stamp])
        self._deps.__enter__()

    def __exit__(self, *exc):
        self._deps.__exit__(*exc)
        return False


def _ops(tensors: Sequence[tf.Tensor]) -> list:
    """Graph tensors only: constants captured from eager code need no waiting for."""
    return [t for t in tensors if isinstance(t, tf.Tensor) and hasattr(t, 'graph')]
