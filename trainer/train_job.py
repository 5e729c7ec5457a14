"""The trainer job: the synchronous SGD loop over the pipelined step.

One step = `task.ForwardBackward` (GPipe over all micro-batches, gradients
summed per cell) -> global-norm clipping -> optimizer update, in one
tf.function. The checkpoint holds the model (by layer path), the optimizer
slots, the global step and the input iterator's position, so a resumed run
sees exactly the data an uninterrupted run would have seen.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from typing import Optional

import gin
import tensorflow as tf
from absl import logging

from tfpipe import checkpoints, fprop_context
from tfpipe.base_layer import flatten_by_path
from tfpipe.hyperparams import Params
from tfpipe.optimizers import clip_by_global_norm
from tfpipe.pipeline import timeline


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

    def __post_init__(self):
        for name in ('max_steps', 'save_interval_steps', 'summary_interval_steps',
                     'save_max_to_keep', 'pipeline_trace_step'):
            _check_positive_int(f'trainer.{name}', getattr(self, name), allow_none=True)
        for name in ('eval_poll_max_seconds', 'eval_idle_timeout_seconds'):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f'trainer.{name}={value!r} must be a positive number of seconds')


def _check_positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name}={value!r} must be an int >= 1')


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
        self.trace_step = options.pipeline_trace_step
        if self.trace_step is not None and self.trace_step > self.max_steps:
            raise ValueError(f'--pipeline_trace_step={self.trace_step} is beyond max_steps='
                             f'{self.max_steps}: pick a step in 1..{self.max_steps}')
        self.task = params.task.Instantiate()
        self.variables = {p: v for p, v in self.task.VariablesByPath().items() if v.trainable}
        self.optimizer = tp.optimizer.Instantiate()
        self.optimizer.CreateSlots(self.variables)
        self.schedule = tp.lr_schedule.Instantiate()
        self.learning_rate = tp.learning_rate
        self.clip_norm = tp.clip_gradient_norm_to_value or None
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
        self.input = params.input.train.Instantiate()
        self.batch_size = params.input.train.batch_size
        self.iterator = iter(self.input.Dataset())
        self.checkpoint = checkpoints.make(self.task.VariablesByPath(), step=self.global_step,
                                           optimizer=self.optimizer, iterator=self.iterator)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, train_dir, checkpoint_name='ckpt',
            max_to_keep=options.save_max_to_keep or tp.save_max_to_keep)
        self._stop_signal: Optional[int] = None
        self._recorder: Optional[timeline.Recorder] = None

    def restore_latest(self) -> int:
        """Restores the newest complete checkpoint, if any; returns the global step."""
        path = checkpoints.latest(self.train_dir)
        if path is not None:
            checkpoints.check_readable(path)
            checkpoints.restore(self.checkpoint, path)
            logging.info('restored %s at step %d', path, int(self.global_step.numpy()))
        return int(self.global_step.numpy())

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
        grads = flatten_by_path(grads, self.task.path)
        grads, norm = clip_by_global_norm(grads, self.clip_norm)
        lr = self.learning_rate * self.schedule.Value(step + 1)  # step + 1: the update number
        finite = tf.math.is_finite(loss) & tf.math.is_finite(norm)

        def update():
            self.optimizer.Apply(lr, grads, self.variables)
            step.assign_add(1)
            return tf.constant(True)

        tf.cond(finite, update, lambda: tf.constant(False))
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
        last_log_step, last_log_time = step, start_time
        if self.trace_step is not None and self.trace_step <= step:
            logging.warning('--pipeline_trace_step=%d: step %d is already done in %s; no '
                            'timeline recorded', self.trace_step, self.trace_step,
                            self.train_dir)
        while step < self.max_steps and self._stop_signal is None:
            if step + 1 == self.trace_step:
                loss, norm, lr, stamps = self._recorded_step(next(self.iterator))
                self._write_timeline(step + 1, stamps.numpy(), writer)
            else:
                loss, norm, lr = self._step(next(self.iterator))
            loss, norm = float(loss), float(norm)
            if not (math.isfinite(loss) and math.isfinite(norm)):
                self._non_finite(f'loss is {loss} and gradient norm {norm} at step {step}')
            step += 1
            if step % self.summary_interval == 0 or step == self.max_steps:
                now = time.time()
                steps_per_sec = (step - last_log_step) / max(now - last_log_time, 1e-9)
                with writer.as_default(step=step):
                    tf.summary.scalar('loss', loss)
                    tf.summary.scalar('learning_rate', float(lr))
                    tf.summary.scalar('grad_norm', norm)
                    tf.summary.scalar('steps_per_sec', steps_per_sec)
                    tf.summary.scalar('examples_per_sec', steps_per_sec * self.batch_size)
                eta = (self.max_steps - step) / max(steps_per_sec, 1e-9)
                logging.info('step %d/%d  loss %.4f  lr %.3g  grad_norm %.3g  %.2f steps/s  '
                             '%.1f examples/s  ETA %dm%02ds', step, self.max_steps, loss,
                             float(lr), norm, steps_per_sec, steps_per_sec * self.batch_size,
                             eta // 60, eta % 60)
                last_log_step, last_log_time = step, now
            if step % self.save_interval == 0 or step == self.max_steps:
                self._save(step)
        if self._stop_signal is not None:
            logging.info('signal %d: saving a checkpoint at step %d and stopping',
                         self._stop_signal, step)
            if self.manager.latest_checkpoint is None or \
                    checkpoints.step_of(self.manager.latest_checkpoint) != step:
                self._save(step)
        writer.flush()
        elapsed = time.time() - start_time
        logging.info('trained steps %d..%d in %.1fs', start_step, step, elapsed)
        return step

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

    def _save(self, step: int) -> None:
        if not bool(self._weights_are_finite()):
            self._non_finite(f'the weights after step {step} are not finite')
        path = self.manager.save(checkpoint_number=step)
        logging.info('saved %s', path)


def train_dir_of(logdir: str) -> str:
    """Where the trainer writes checkpoints; the evaler and decoder read them there."""
    return os.path.join(logdir, 'train')
