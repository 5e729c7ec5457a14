"""Resuming with another number of replicas R: the global micro-batches stay.

A step cuts the global batch into R*M micro-batches (M per replica, the R
replicas in one process or one per trainer client). BatchNorm normalises each
micro-batch by its own statistics, so the loss trajectory depends on that
count G = R*M, not only on the global batch. Every checkpoint records the R and
M it was trained with (`SplitRecord`, saved beside the model but never
restored into anything). A run resumed with another R keeps G: each replica
runs M' = G / R' micro-batches, whatever task.pipeline.num_micro_batches says,
so the restarted run continues the uninterrupted run's trajectory; an R' that
does not divide G is refused before anything is written. With the same R the
params' M is used as given (changing M is the user's choice).

Trainer clients other than the chief have no logdir: they receive the chief's
record in one small all-reduce before they build their replica.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf
from absl import logging

from tfpipe import checkpoints, devices
from tfpipe.cluster import WorkerUnavailableError
from tfpipe.hyperparams import Params
from tfpipe.pipeline import across_clients

_REPLICAS_KEY = 'batch_split/replicas/.ATTRIBUTES/VARIABLE_VALUE'
_MICRO_KEY = 'batch_split/micro_batches/.ATTRIBUTES/VARIABLE_VALUE'
# How long a client waits for the chief's record. Every client enters the exchange once
# all of them serve (clients.start), and the chief sends it as soon as it has checked its
# logdir (seconds); a chief that refused its flags has exited, and this bounds the wait.
EXCHANGE_TIMEOUT_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Split:
    """R replicas of M micro-batches each: G = R*M micro-batches per global batch."""
    replicas: int
    micro_batches: int

    @property
    def global_micro_batches(self) -> int:
        return self.replicas * self.micro_batches


class SplitRecord(tf.Module):
    """The (R, M) a checkpoint was trained with: two int64 scalars in the checkpoint."""

    def __init__(self, split: Split):
        super().__init__(name='batch_split')
        self.replicas = tf.Variable(split.replicas, dtype=tf.int64, trainable=False,
                                    name='replicas')
        self.micro_batches = tf.Variable(split.micro_batches, dtype=tf.int64, trainable=False,
                                         name='micro_batches')


def saved(train_dir: str) -> Optional[Split]:
    """The split of the newest checkpoint in `train_dir`; None without one (or a
    checkpoint from before splits were recorded)."""
    path = checkpoints.latest(train_dir)
    if path is None:
        return None
    checkpoints.check_readable(path)
    if not recorded(path):
        return None
    reader = tf.train.load_checkpoint(path)
    return Split(int(reader.get_tensor(_REPLICAS_KEY)), int(reader.get_tensor(_MICRO_KEY)))


def recorded(path: str) -> bool:
    """Whether the checkpoint `path` holds a SplitRecord (all since splits were recorded)."""
    return tf.train.load_checkpoint(path).has_tensor(_REPLICAS_KEY)


def from_chief(peers: across_clients.Peers, split: Optional[Split]) -> Optional[Split]:
    """Every client gets the chief's `split` (the others pass None)."""
    values = tf.constant([0.0, 0.0] if split is None or not peers.is_chief
                         else [split.replicas, split.micro_batches], tf.float32)
    try:
        summed, = across_clients.all_reduce_sum(peers, [values], devices.local_cpu(),
                                                timeout=EXCHANGE_TIMEOUT_SECONDS)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.CancelledError, tf.errors.AbortedError):
        raise WorkerUnavailableError(
            f'trainer task 0 (the chief) did not send its checkpoint\'s batch split within '
            f'{EXCHANGE_TIMEOUT_SECONDS:g} s: it exited or hangs; read its error and restart '
            'every client') from None
    replicas, micro = (int(v) for v in summed.numpy())
    return Split(replicas, micro) if replicas else None


def resume(params: Params, replicas: int, saved_split: Optional[Split],
           checkpoint: str) -> Split:
    """The split this run trains with; sets task.pipeline.num_micro_batches to its M.

    Raises ValueError (before anything is written) when `replicas` cannot split the
    saved checkpoint's global micro-batches evenly. `checkpoint` names it in the error.
    """
    pipeline = params.task.pipeline
    if saved_split is None or saved_split.replicas == replicas:
        if saved_split is not None and saved_split.micro_batches != pipeline.num_micro_batches:
            logging.info('resuming a checkpoint of %d replicas x %d micro-batches with %d '
                         'micro-batches per replica (the checkpoint ran %d): %d per global '
                         'batch instead of %d, as task.pipeline.num_micro_batches says',
                         replicas, saved_split.micro_batches, pipeline.num_micro_batches,
                         saved_split.micro_batches, replicas * pipeline.num_micro_batches,
                         saved_split.global_micro_batches)
        return Split(replicas, pipeline.num_micro_batches)
    total = saved_split.global_micro_batches
    if total % replicas:
        valid = ', '.join(str(r) for r in range(1, total + 1) if total % r == 0)
        raise ValueError(
            f'{checkpoint} was trained with {total} micro-batches per global '
            f'batch ({saved_split.replicas} replicas x {saved_split.micro_batches}), which '
            f'{replicas} replicas cannot share evenly: resume with R in {valid} (trainer '
            'clients, or task.pipeline.num_replicas in one process), or use a new --logdir')
    micro = total // replicas
    if micro != pipeline.num_micro_batches:
        logging.info('resuming a checkpoint of %d replicas x %d micro-batches with %d '
                     'replicas: each runs %d (task.pipeline.num_micro_batches=%d -> %d), the '
                     'same %d micro-batches per global batch', saved_split.replicas,
                     saved_split.micro_batches, replicas, micro, pipeline.num_micro_batches,
                     micro, total)
        pipeline.num_micro_batches = micro
    return Split(replicas, micro)
