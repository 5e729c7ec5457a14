"""Checkpoint saves that run beside training: a host snapshot written by one thread.

A synchronous save of a GPT-2-small-sized model (1 GB with Adam's slots) stopped
training for the whole write. Here a save takes a snapshot of every saved value
(a deep copy in host memory, which the next step's updates cannot change) and a
writer thread writes it through the trainer's CheckpointManager while the next
steps run. The copy costs one more host copy of the checkpointed state while a
write is in flight, released when it ends.

TensorFlow's own `CheckpointOptions(experimental_enable_async_checkpoint=True)`
copies only objects that implement `_copy_trackable_to_cpu`, and does so in a
traced function: a tensor-parallel weight (variable_shards.ShardedWeight) or a
sharded optimizer slot, whose gathered value exists only inside
`ShardedOptimizer.GatherSlots`, would be written from its live (or stale)
value. A snapshot of every object's `_serialize_to_tensors()` taken by the caller
inside that context is exact for all of them (benchmarks/async_checkpoint_benchmark.py
measures both).

Guarantees: CheckpointManager lists a checkpoint in its state file only after its
data files are written (a write callback), and every reader goes through that file
(checkpoints.latest), so a half-written checkpoint is never read and a process
killed mid-write resumes from the previous one. At most one save is in flight: a
new one first waits for the previous, and surfaces its error.

The writer thread runs at the lowest CPU priority (nice 19; Linux only): the step keeps
every core busy, and at equal priority the write's copying and checksumming took cores
from it (GPT-2 small on 2 cores: the step beside a write 1.27x a normal step, 1.11x at
nice 19, the write 4.9 s against 5.5 s; benchmarks/async_checkpoint_benchmark.py). A
niced thread still gets a share, so a write always ends; SCHED_IDLE could starve it.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import sys
import threading
import time
from typing import Callable, Optional

import tensorflow as tf
from tensorflow.python.training.saving import saveable_object
from tensorflow.python.util import object_identity

# Test-only: the writer of checkpoint number N (this variable's value) stops after its
# data files are written, before the state file lists it, and says so on stderr: a save
# that is deterministically in flight, for the kill-during-save test.
HOLD_ENV = 'TFPIPE_TEST_HOLD_SAVE'
WRITER_NICE = 19  # the writer thread's nice value above its caller's (at most 19)


@dataclasses.dataclass(frozen=True)
class SaveRecord:
    """What one finished save cost: the log line's figures."""
    path: str
    step: int
    blocked_seconds: float  # the caller waited this long (snapshot, or the whole write)
    write_seconds: float  # from the save's start until the state file listed it
    megabytes: float  # the checkpoint's files on disk
    asynchronous: bool

    def line(self) -> str:
        if not self.asynchronous:
            return (f'saved {self.path}: step {self.step}, {self.write_seconds:.2f} s, '
                    f'{self.megabytes:.2f} MB (synchronous)')
        return (f'saved {self.path}: step {self.step}, {self.write_seconds:.2f} s, '
                f'{self.megabytes:.2f} MB (asynchronous: training waited '
                f'{self.blocked_seconds:.2f} s for the snapshot and ran '
                f'{max(0.0, self.write_seconds - self.blocked_seconds):.2f} s beside the write)')


class _Frozen(tf.__internal__.tracking.Trackable):
    """Stands in for one checkpointed object while it is written: its values at the save."""

    def __init__(self, tensors: dict):
        self._tensors = tensors

    def _serialize_to_tensors(self) -> dict:
        return self._tensors


def _copy(value):
    if isinstance(value, saveable_object.SaveSpec):  # a variable's deferred read
        value = value.tensor
    with tf.device(value.device):
        return tf.raw_ops.DeepCopy(x=value)


def snapshot(checkpoint: tf.train.Checkpoint) -> tuple[dict, int]:
    """{object: its frozen stand-in} for every saved object of `checkpoint`, and the bytes
    copied. Call it where the values are whole (inside GatherSlots across clients)."""
    frozen, copied = object_identity.ObjectIdentityDictionary(), 0
    exclude = {id(checkpoint), id(getattr(checkpoint, '_save_counter', None))}
    for obj in tf.train.TrackableView(checkpoint).descendants():
        if id(obj) in exclude or not _serializes(obj):
            continue
        tensors = tf.nest.map_structure(_copy, obj._serialize_to_tensors())  # noqa: SLF001
        copied += sum(t.shape.num_elements() * t.dtype.size for t in tf.nest.flatten(tensors))
        frozen[obj] = _Frozen(tensors)
    return frozen, copied


def _serializes(obj) -> bool:
    """Whether `obj` writes values of its own (variables, sharded weights and slots)."""
    for cls in type(obj).__mro__:
        if cls is tf.__internal__.tracking.Trackable:
            return False
        if '_serialize_to_tensors' in vars(cls):
            return True
    return False


class CheckpointWriter:
    """Saves `manager`'s checkpoint numbered by step, in a writer thread (`asynchronous`)
    or in the caller's; `on_written(record)` runs once a checkpoint is listed."""

    def __init__(self, manager: tf.train.CheckpointManager, options: tf.train.CheckpointOptions,
                 asynchronous: bool, on_written: Callable[[SaveRecord], None],
                 nice: int = WRITER_NICE):
        self._manager = manager
        self._nice = nice  # the writer thread's; 0 keeps the caller's (the benchmark's A/B)
        self._options = options
        self.asynchronous = asynchronous
        self._on_written = on_written
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.step_in_flight: Optional[int] = None  # the save `wait` finishes (or failed)

    def save(self, step: int) -> None:
        """Starts (asynchronous) or does the save of `step`; waits for a previous one first,
        raising its error (`step_in_flight` then names it)."""
        self.wait()
        begin = time.monotonic()
        self.step_in_flight = step
        if not self.asynchronous:
            self._write(step, begin, 0.0)
            return
        frozen, _ = snapshot(self._manager.checkpoint)
        self._manager.checkpoint._saver._object_map = frozen  # noqa: SLF001 - TF's own hook
        blocked = time.monotonic() - begin
        self._thread = threading.Thread(target=self._run, args=(step, begin, blocked),
                                        name=f'checkpoint-writer-{step}', daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Returns once no save is in flight; raises the error of one that failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        self.step_in_flight = None

    def _run(self, step: int, begin: float, blocked: float) -> None:
        _lower_priority(self._nice)
        try:
            self._write(step, begin, blocked)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() in the caller's thread
            self._error = e
        finally:
            self._manager.checkpoint._saver._object_map = None  # noqa: SLF001 - frees the copy

    def _write(self, step: int, begin: float, blocked: float) -> None:
        options = tf.train.CheckpointOptions(
            experimental_io_device=self._options.experimental_io_device,
            experimental_write_callbacks=_test_hold(step))
        path = self._manager.save(checkpoint_number=step, options=options)
        seconds = time.monotonic() - begin
        size = sum(os.path.getsize(f) for f in glob.glob(glob.escape(path) + '.*'))
        self._on_written(SaveRecord(path, step, seconds if not self.asynchronous else blocked,
                                    seconds, size / 1e6, self.asynchronous))


def _lower_priority(nice: int) -> None:
    """Raises the calling thread's nice value by `nice` (Linux: per-thread, by its native
    id; elsewhere the call would renice the whole process, so nothing is done)."""
    if nice and sys.platform.startswith('linux'):
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, own + nice))


def _test_hold(step: int) -> list:
    if os.environ.get(HOLD_ENV) != str(step):
        return []

    def hold(save_path: str) -> None:
        print(f'{HOLD_ENV}: holding {save_path}, written but not listed', file=sys.stderr,
              flush=True)
        threading.Event().wait()
    return [hold]
