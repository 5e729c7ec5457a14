"""The trainer job: the synchronous SGD loop over the pipelined step.

One step = `task.ForwardBackward` (GPipe over all micro-batches, gradients
summed per cell) -> global-norm clipping -> optimizer update, in one
tf.function. The checkpoint holds the model (by layer path), the optimizer
slots, the global step and the input's position (epoch and index, not the
shuffle buffer), so a resumed run sees exactly the data an uninterrupted run
would have seen.

With data-parallel replicas (`task.pipeline.num_replicas` R > 1) each replica
has its own copy of the variables and an optimizer with slots on its own
devices, gets the all-reduced gradients and applies the same update, so the
copies stay identical; only replica 0's copy and optimizer are checkpointed,
and a restore copies them into the others.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import re
import shutil
import signal
import time
from typing import Optional, Sequence

import gin
import tensorflow as tf
from absl import logging

from tfpipe import checkpoints, fprop_context, memory_stats
from tfpipe.base_layer import flatten_by_path
from tfpipe.hyperparams import Params
from tfpipe.optimizers import BaseOptimizer, clip_by_global_norm
from tfpipe.pipeline import timeline
from trainer import experiment


@gin.configurable('trainer')
@dataclasses.dataclass
class RuntimeOptions:
    """Knobs of the training loop that are not part of the model (gin: `trainer.*`).

    None means "take the model's task.train value".
    """
    max_steps: Optional[int] = None
    save_interval_steps: Optional[int] = None
    summary_interval_steps: Optional[int] = None
    save_max_to_keep: Optional[int] = None
    eval_poll_max_seconds: float = 30.0
    eval_idle_timeout_seconds: Optional[float] = None  # None: evalers wait for the last step
    pipeline_trace_step: Optional[int] = None  # record the timeline of this step (1 = first)
    # Across processes: how long a step (or a save) may go without finishing before the
    # trainer gives up on a worker that accepts connections but does not answer.
    step_timeout_seconds: float = 600.0

    def __post_init__(self):
        for name in ('max_steps', 'save_interval_steps', 'summary_interval_steps',
                     'save_max_to_keep', 'pipeline_trace_step'):
            _check_positive_int(f'trainer.{name}', getattr(self, name), allow_none=True)
        for name in ('eval_poll_max_seconds', 'eval_idle_timeout_seconds',
                     'step_timeout_seconds'):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f'trainer.{name}={value!r} must be a positive number of seconds')


# Errors of a save that point at a lost peer (checkpoint I/O runs on the trainer, but the
# values come from the workers), not at the trainer's disk.
_LOST_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
                     tf.errors.CancelledError)


def _check_positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name}={value!r} must be an int >= 1')


def guarded_update(loss: tf.Tensor, replica_grads: Sequence[dict], clip_norm: Optional[float],
                   optimizers: Sequence[BaseOptimizer], replica_variables: Sequence[dict],
                   lr: tf.Tensor, global_step: tf.Variable) -> tf.Tensor:
    """The update half of the trainer's step; returns the global gradient norm.

    Global-norm clipping, then the optimizer's update and `global_step += 1` only
    when loss and norm are finite. The norm needs every gradient at once, which
    sets the step's peak memory, so benchmarks/pipeline_benchmark.py calls this
    same function rather than a lighter copy. With data-parallel replicas there
    is one gradient dict, optimizer and variable dict per replica: the gradients
    are all-reduced, so every replica clips by the same norm and applies the same
    update to its own copy.
    """
    clipped = [clip_by_global_norm(grads, clip_norm) for grads in replica_grads]
    norm = clipped[0][1]
    finite = tf.math.is_finite(loss) & tf.math.is_finite(norm)

    def update():
        for (grads, _), optimizer, variables in zip(clipped, optimizers, replica_variables):
            optimizer.Apply(lr, grads, variables)
        global_step.assign_add(1)
        return tf.constant(True)

    tf.cond(finite, update, lambda: tf.constant(False))
    return norm


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    """Builds the task, optimizer, input and checkpoint; `run()` trains."""

    def __init__(self, params: Params, train_dir: str, options: RuntimeOptions):
        tp = params.task.train
        for name in ('max_steps', 'save_interval_steps', 'summary_interval_steps',
                     'save_max_to_keep'):
            _check_positive_int(f'task.train.{name}', getattr(tp, name))
        self.max_steps = options.max_steps or tp.max_steps
        self.save_interval = options.save_interval_steps or tp.save_interval_steps
        self.summary_interval = options.summary_interval_steps or tp.summary_interval_steps
        self.train_dir = train_dir
        self.params = params
        self.trace_step = options.pipeline_trace_step
        if self.trace_step is not None and self.trace_step > self.max_steps:
            raise ValueError(f'--pipeline_trace_step={self.trace_step} is beyond max_steps='
                             f'{self.max_steps}: pick a step in 1..{self.max_steps}')
        self.task = params.task.Instantiate()
        self.replica_variables = [{p: v for p, v in copy.items() if v.trainable}
                                  for copy in self.task.pipe.ReplicaVariablesByPath()]
        self.variables = self.replica_variables[0]
        self.optimizers = [tp.optimizer.Instantiate() for _ in self.replica_variables]
        for optimizer, variables in zip(self.optimizers, self.replica_variables):
            optimizer.CreateSlots(variables)
        self.optimizer = self.optimizers[0]
        self.schedule = tp.lr_schedule.Instantiate()
        self.learning_rate = tp.learning_rate
        self.clip_norm = tp.clip_gradient_norm_to_value or None
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
        self.input = params.input.train.Instantiate()
        self.batch_size = params.input.train.batch_size
        self.iterator = self.input.Iterator()  # checkpointed as its position, not its buffer
        self.checkpoint = checkpoints.make(self.task.VariablesByPath(), step=self.global_step,
                                           optimizer=self.optimizer, iterator=self.iterator)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, train_dir, checkpoint_name='ckpt',
            max_to_keep=options.save_max_to_keep or tp.save_max_to_keep)
        self._stop_signal: Optional[int] = None
        self._restored: Optional[str] = None
        self._saved_this_run = False
        # (last finished step, when it or a later save finished), None before the first
        # step: what the cluster watchdog reads to tell a frozen worker from a slow step.
        self.heartbeat: Optional[tuple[int, float]] = None
        self._recorder: Optional[timeline.Recorder] = None

    def restore_latest(self) -> int:
        """Restores the newest complete checkpoint, if any; returns the global step.

        Called twice: to validate before anything is written, and again once the
        train dir is locked, in case a trainer that held it saved meanwhile
        (a no-op when the newest checkpoint is still the one restored).
        """
        path = checkpoints.latest(self.train_dir)
        if path is not None and path != self._restored:
            checkpoints.check_readable(path)
            checkpoints.restore(self.checkpoint, path)
            self._sync_replicas()
            self._restored = path
            logging.info('restored %s at step %d', path, int(self.global_step.numpy()))
        return int(self.global_step.numpy())

    def _sync_replicas(self) -> None:
        """Copies replica 0's restored variables and optimizer state into the other replicas."""
        self.task.pipe.SyncReplicas()
        for optimizer in self.optimizers[1:]:
            optimizer.iterations.assign(self.optimizer.iterations)
            for source, mirror in zip(self.optimizer.slot_variables, optimizer.slot_variables):
                mirror.assign(source)

    @tf.function
    def _step(self, batch):
        """One synchronous step; the update is skipped when loss or gradients are not finite."""
        return self._build_step(batch, record=False)

    @tf.function
    def _recorded_step(self, batch):
        """The same step with every pipeline task time-stamped (--pipeline_trace_step)."""
        return self._build_step(batch, record=True)

    def _build_step(self, batch, record: bool):
        step = self.global_step
        recording = self.task.pipe.RecordTimeline() if record else contextlib.nullcontext()
        with fprop_context.training(step=step), recording as recorder:
            loss, grads = self.task.ForwardBackward(self.task.theta, batch)
        lr = self.learning_rate * self.schedule.Value(step + 1)  # step + 1: the update number
        norm = guarded_update(
            loss, [flatten_by_path(g, self.task.path) for g in
                   (grads if isinstance(grads, list) else [grads])],
            self.clip_norm, self.optimizers, self.replica_variables, lr, step)
        if not record:
            return loss, norm, lr
        self._recorder = recorder
        return loss, norm, lr, recorder.stamps()

    @tf.function
    def _weights_are_finite(self):
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v))
                              for v in self.variables.values()])

    def _install_signal_handlers(self) -> dict:
        def handler(signum, frame):
            del frame
            self._stop_signal = signum
        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def run(self) -> int:
        """Trains to max_steps; returns the final step. SIGINT/SIGTERM save and return."""
        previous = self._install_signal_handlers()
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        step = int(self.global_step.numpy())
        writer = tf.summary.create_file_writer(self.train_dir)
        start_step, start_time = step, time.time()
        progress = Progress(self.max_steps, start_time)
        out_of_data = False
        if self.trace_step is not None and self.trace_step <= step:
            logging.warning('--pipeline_trace_step=%d: step %d is already done in %s; no '
                            'timeline recorded', self.trace_step, self.trace_step,
                            self.train_dir)
        while step < self.max_steps and self._stop_signal is None:
            try:
                batch = next(self.iterator)
            except StopIteration:
                out_of_data = True
                break
            if step + 1 == self.trace_step:
                loss, norm, lr, stamps = self._recorded_step(batch)
                self._write_timeline(step + 1, stamps.numpy(), writer)
            else:
                loss, norm, lr = self._step(batch)
            loss, norm = float(loss), float(norm)
            if not (math.isfinite(loss) and math.isfinite(norm)):
                self._non_finite(f'loss is {loss} and gradient norm {norm} at step {step}')
            step += 1
            self.heartbeat = (step, time.monotonic())
            progress.step_done(step, time.time())
            if step % self.summary_interval == 0 or step == self.max_steps:
                self._report(writer, progress, step, loss, norm, float(lr))
            if step % self.save_interval == 0 or step == self.max_steps:
                self.save(step)
        if out_of_data:
            logging.warning('input.train ran out of data after step %d of %d (it does not '
                            'repeat): saving a checkpoint and stopping; set '
                            'input.train.repeat=True to train to max_steps', step,
                            self.max_steps)
        if self._stop_signal is not None:
            logging.info('signal %d: saving a checkpoint at step %d and stopping',
                         self._stop_signal, step)
        if (out_of_data or self._stop_signal is not None) and (
                self.manager.latest_checkpoint is None or
                checkpoints.step_of(self.manager.latest_checkpoint) != step):
            self.save(step)
        writer.flush()
        elapsed = time.time() - start_time
        logging.info('trained steps %d..%d in %.1fs', start_step, step, elapsed)
        return step

    def _report(self, writer, progress: 'Progress', step: int, loss: float, norm: float,
                lr: float) -> None:
        steps_per_sec, eta = progress.rate_and_eta(step, time.time())
        with writer.as_default(step=step):
            tf.summary.scalar('loss', loss)
            tf.summary.scalar('learning_rate', lr)
            tf.summary.scalar('grad_norm', norm)
            if steps_per_sec is not None:
                tf.summary.scalar('steps_per_sec', steps_per_sec)
                tf.summary.scalar('examples_per_sec', steps_per_sec * self.batch_size)
            peaks = memory_stats.peak_bytes(d.name for d in tf.config.list_logical_devices())
            for device, peak in peaks.items():
                tf.summary.scalar(f'peak_bytes/{device}', peak)
        head = '  '.join(part for part in (
            f'step {step}/{self.max_steps}  loss {loss:.4f}  lr {lr:.3g}  grad_norm {norm:.3g}',
            memory_stats.format_peaks(peaks)) if part)
        if steps_per_sec is None:
            logging.info('%s  first step %.1fs (includes tracing; rate and ETA from the next '
                         'steps)', head, progress.first_step_seconds)
        else:
            logging.info('%s  %.2f steps/s  %.1f examples/s  ETA %dm%02ds', head,
                         steps_per_sec, steps_per_sec * self.batch_size, eta // 60, eta % 60)

    def _write_timeline(self, step: int, stamps, writer) -> None:
        line = timeline.Timeline.from_stamps(self._recorder, stamps)
        paths = line.write(self.train_dir, step)
        with writer.as_default():
            line.write_summaries(step)
        logging.info('step %d: %s; wrote %s', step, line.summary(), ' and '.join(paths))

    def _non_finite(self, what: str) -> None:
        raise NonFiniteLossError(
            f'{what}: training stopped; the last good checkpoint in {self.train_dir} is kept. '
            'Lower task.train.learning_rate or set task.train.clip_gradient_norm_to_value')

    def save(self, step: int) -> None:
        """Saves a checkpoint numbered `step`; a failed save leaves no partial files."""
        if not bool(self._weights_are_finite()):
            self._non_finite(f'the weights after step {step} are not finite')
        try:
            path = self.manager.save(checkpoint_number=step, options=checkpoints.io_options())
        except (OSError, tf.errors.OpError) as e:  # a full disk, a quota, a lost mount
            self._remove_partial_save(step)
            if isinstance(e, _LOST_PEER_ERRORS):
                raise  # a worker died during the save: the cluster watchdog names it
            last = checkpoints.latest(self.train_dir)  # from disk: the state file may be older
            raise checkpoints.CheckpointError(
                f'saving checkpoint ckpt-{step} in {self.train_dir} failed '
                f'({_reason(e)}); its partial files were removed: free '
                f'space there and restart, which resumes from '
                f'{os.path.basename(last) if last else "step 0"}') from None
        logging.info('saved %s', path)
        if self.heartbeat is not None:
            self.heartbeat = (self.heartbeat[0], time.monotonic())  # a slow save is progress
        if not self._saved_this_run:
            # From now on the checkpoints are this run's: params.txt must describe them.
            experiment.write_params(os.path.join(self.train_dir, experiment.PARAMS_FILE),
                                    self.params)
            self._saved_this_run = True

    def _remove_partial_save(self, step: int) -> None:
        """Deletes what a failed save of `step` left: its temp dir and unlisted data files."""
        prefix = os.path.join(self.train_dir, f'ckpt-{step}')
        if prefix in self.manager.checkpoints:
            return  # listed as complete: never delete a checkpoint the state file names
        for path in glob.glob(glob.escape(prefix) + '_temp*'):
            shutil.rmtree(path, ignore_errors=True)
        for path in glob.glob(glob.escape(prefix) + '.*'):
            os.remove(path)


def _reason(error: Exception) -> str:
    """'No space left on device' out of an OSError or a TF op error naming a temp file."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = checkpoints.one_line(str(error)).rsplit('; ', 1)[-1]
    return re.sub(r'\s*\[Op:\w+\]$', '', text)[:200]


def train_dir_of(logdir: str) -> str:
    """Where the trainer writes checkpoints; the evaler and decoder read them there."""
    return os.path.join(logdir, 'train')


class Progress:
    """Steps/s and ETA of one run, measured without the run's first step.

    The first step traces and compiles the step function: seconds here, minutes
    on big models. Counting it would make the first reports' rate too low and
    their ETA too long by that much, so rates start at the end of the first step.
    """

    def __init__(self, max_steps: int, start_time: float):
        self.max_steps = max_steps
        self.first_step_seconds: Optional[float] = None
        self._start = start_time
        self._mark: Optional[tuple[int, float]] = None  # rates are measured from here

    def step_done(self, step: int, now: float) -> None:
        if self._mark is None:
            self._mark = (step, now)
            self.first_step_seconds = now - self._start

    def rate_and_eta(self, step: int, now: float) -> tuple[Optional[float], Optional[float]]:
        """Steps/s since the last report (or the first step) and the seconds left at that rate.

        (None, None) when only the first step has run.
        """
        mark_step, mark_time = self._mark
        if step == mark_step:
            return None, None
        rate = (step - mark_step) / max(now - mark_time, 1e-9)
        self._mark = (step, now)
        return rate, (self.max_steps - step) / rate
