"""An input's position as its checkpoint, and a trainer client's share of each batch.

`TfdsInput.Iterator()` (tfpipe/inputs.py) gives an `InputIterator`: its checkpoint
is the position of the next example, not tf.data's buffers, and it counts whole
batches whatever share of each batch it yields, so a position saved by one
trainer client restores into any number of clients or one process.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import tensorflow as tf

Example = Dict[str, tf.Tensor]
# (epoch, index) -> a dataset of (batch, epoch, index of the example after the batch)
BatchesFrom = Callable[[int, int], tf.data.Dataset]


def share_of_window(examples: dict, epochs: tf.data.Dataset, indices: tf.data.Dataset,
                    share: range, size: int) -> tf.data.Dataset:
    """Examples `share` of one batch-sized window, each carrying the position of the
    window's last example (so the batch of them ends where the whole batch ends)."""
    last_epoch, last_index = tf.data.Dataset.zip((epochs, indices)).skip(
        size - 1).get_single_element()
    return tf.data.Dataset.zip(examples).skip(share.start).take(len(share)).map(
        lambda ex: (ex, last_epoch, last_index))


class InputIterator(tf.Module):
    """Batches of a TfdsInput, checkpointed as a position instead of tf.data's buffers.

    A tf.data iterator checkpoint holds its shuffle buffer: 10000 CIFAR-10 images
    or 100000 WMT sentence pairs, tens of MB in every checkpoint. This one holds
    two int64 variables, the epoch and the index in it of the next example; after
    a restore, the next batch rebuilds the seeded order from that position
    (reading through the epoch up to it once), so a resumed run sees exactly the
    batches an uninterrupted run would have seen. `batches_from(epoch, index)` gives
    the batches from a position on, each with the position after it.
    """

    def __init__(self, batches_from: BatchesFrom):
        super().__init__(name='input_iterator')
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name='epoch')
        self.index = tf.Variable(0, dtype=tf.int64, trainable=False, name='index')
        self._make = batches_from
        self._live = None  # generator of (batch, position after it); a generator is never tracked
        self._live_from = None
        self.batch_bytes: Optional[int] = None  # of the last batch, as fed to the step

    def __iter__(self) -> InputIterator:
        return self

    def __next__(self) -> Example:
        position = (int(self.epoch.numpy()), int(self.index.numpy()))
        if self._live is None or position != self._live_from:  # first batch, or restored
            self._live = self._Generate(*position)
        batch, (epoch, index) = next(self._live)
        self.epoch.assign(epoch)
        self.index.assign(index)
        self._live_from = (epoch, index)
        self.batch_bytes = sum(t.shape.num_elements() * t.dtype.size
                               for t in tf.nest.flatten(batch))
        return batch

    def _Generate(self, epoch: int, index: int):
        for batch, end_epoch, end_index in self._make(epoch, index).prefetch(2):
            yield batch, (int(end_epoch), int(end_index))
