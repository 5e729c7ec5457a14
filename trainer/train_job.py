"""The trainer job: the synchronous SGD loop over the pipelined step.

One step = `task.ForwardBackward` (GPipe over all micro-batches, gradients
summed per cell) -> global-norm clipping -> optimizer update, in one
tf.function. The checkpoint holds the model (by layer path), the optimizer
slots, the global step and the input iterator's position, so a resumed run
sees exactly the data an uninterrupted run would have seen.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from typing import Callable, Optional

import gin
import tensorflow as tf
from absl import logging

from tfpipe import checkpoints, fprop_context
from tfpipe.base_layer import flatten_by_path
from tfpipe.hyperparams import Params
from tfpipe.optimizers import clip_by_global_norm


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


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    """Builds the task, optimizer, input and checkpoint; `Run()` trains."""

    def __init__(self, params: Params, train_dir: str, options: RuntimeOptions):
        tp = params.task.train
        self.max_steps = options.max_steps or tp.max_steps
        self.save_interval = options.save_interval_steps or tp.save_interval_steps
        self.summary_interval = options.summary_interval_steps or tp.summary_interval_steps
        self.train_dir = train_dir
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

    def RestoreLatest(self) -> int:
        """Restores the newest complete checkpoint, if any; returns the global step."""
        path = checkpoints.latest(self.train_dir)
        if path is not None:
            checkpoints.check_readable(path)
            checkpoints.restore(self.checkpoint, path)
            logging.info('restored %s at step %d', path, int(self.global_step.numpy()))
        return int(self.global_step.numpy())

    @tf.function
    def _Step(self, batch):
        step = self.global_step
        with fprop_context.training(step=step):
            loss, grads = self.task.ForwardBackward(self.task.theta, batch)
        grads = flatten_by_path(grads, self.task.path)
        grads, norm = clip_by_global_norm(grads, self.clip_norm)
        lr = self.learning_rate * self.schedule.Value(step + 1)  # step + 1: the update number
        self.optimizer.Apply(lr, grads, self.variables)
        step.assign_add(1)
        return loss, norm, lr

    def _InstallSignalHandlers(self) -> None:
        def handler(signum, frame):
            del frame
            self._stop_signal = signum
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)

    def Run(self, on_checkpoint: Callable[[int], None] = lambda step: None) -> int:
        """Trains to max_steps; returns the final step. SIGINT/SIGTERM save and return."""
        self._InstallSignalHandlers()
        step = int(self.global_step.numpy())
        writer = tf.summary.create_file_writer(self.train_dir)
        start_step, start_time = step, time.time()
        last_log_step, last_log_time = step, start_time
        while step < self.max_steps and self._stop_signal is None:
            loss, norm, lr = self._Step(next(self.iterator))
            loss, norm = float(loss), float(norm)
            if not (math.isfinite(loss) and math.isfinite(norm)):
                raise NonFiniteLossError(
                    f'loss is {loss} and gradient norm {norm} at step {step}: training stopped; '
                    f'the last good checkpoint in {self.train_dir} is kept. Lower '
                    'task.train.learning_rate or set task.train.clip_gradient_norm_to_value')
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
                self._Save(step, on_checkpoint)
        if self._stop_signal is not None:
            logging.info('signal %d: saving a checkpoint at step %d and stopping',
                         self._stop_signal, step)
            if self.manager.latest_checkpoint is None or \
                    checkpoints.step_of(self.manager.latest_checkpoint) != step:
                self._Save(step, on_checkpoint)
        writer.flush()
        elapsed = time.time() - start_time
        logging.info('trained steps %d..%d in %.1fs', start_step, step, elapsed)
        return step

    def _Save(self, step: int, on_checkpoint: Callable[[int], None]) -> None:
        path = self.manager.save(checkpoint_number=step)
        logging.info('saved %s', path)
        on_checkpoint(step)


def train_dir_of(logdir: str) -> str:
    return os.path.join(logdir, 'train')
