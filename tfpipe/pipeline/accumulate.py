"""Summing a weight's gradients over micro-batches, sparse where that is smaller.

An embedding lookup's gradient is an IndexedSlices: one row per looked-up id.
Densifying it per micro-batch makes a [V, D] tensor for every micro-batch and
adds it into a [V, D] running sum, several [V, D] buffers alive at once in the
middle of the pipeline. Concatenating the slices instead keeps only the rows
that were looked up, which is smaller as long as the rows of all micro-batches
so far do not outnumber the table's rows (a large vocabulary and few tokens per
step); past that the dense sum is the smaller one and is used. The sum is made
dense once, after the cell's last micro-batch, because the optimizers and the
global-norm clipping update and measure whole tensors.
"""
from __future__ import annotations

from typing import Union

import tensorflow as tf

Grad = Union[tf.Tensor, tf.IndexedSlices]


def _sparse_fits(g: Grad, extra_rows: int = 0) -> bool:
    """Are `g`'s slices (plus `extra_rows`) no more rows than the dense table? Static shapes."""
    if not isinstance(g, tf.IndexedSlices):
        return False
    rows = g.values.shape[0]
    table = tf.get_static_value(g.dense_shape)
    return rows is not None and table is not None and rows + extra_rows <= int(table[0])


def add(acc: Grad | None, g: Grad) -> Grad:
    """acc + g (acc None: the first micro-batch), concatenating slices while that stays
    no bigger than the dense sum."""
    if acc is None:
        return g if _sparse_fits(g) else tf.convert_to_tensor(g)
    if (isinstance(acc, tf.IndexedSlices) and isinstance(g, tf.IndexedSlices)
            and g.values.shape[0] is not None and _sparse_fits(acc, g.values.shape[0])):
        return tf.IndexedSlices(tf.concat([acc.values, g.values], 0),
                                tf.concat([acc.indices, g.indices], 0), acc.dense_shape)
    return tf.convert_to_tensor(acc) + tf.convert_to_tensor(g)
