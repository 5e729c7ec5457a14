"""Stateless dropout whose mask depends on (seed, layer, step, example) only.

A recomputed forward pass must drop the same units as the original one, and a
pipelined run must drop the same units as the unpartitioned run whatever K and
M are. Both follow if the random value of element e of the *mini-batch* is a
pure function of (layer seed, step, e). Philox is a counter-based generator:
the uniform for element e comes from counter e // 4 (four 32-bit outputs per
counter), so a micro-batch starting at example o generates its own slice of the
mini-batch's random stream directly, starting the counter at o * D // 4 (D =
elements per example), without generating the rest of the mini-batch's values.
The step goes into the counter's high word, the layer path into the key.
"""
from __future__ import annotations

import math
import zlib

import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.base_layer import BaseLayer, LayerMeta

_PHILOX = tf.random.Algorithm.PHILOX.value


def stateless_uniform_slice(key: int, step: tf.Tensor, first_element: int | tf.Tensor,
                            num_elements: int) -> tf.Tensor:
    """Float32 uniforms [first_element, first_element + num_elements) of stream (key, step).

    Always float32, whatever the activation dtype: float64 would draw two 32-bit
    values per element and break the element-to-counter arithmetic.
    `first_element` may be an int64 tensor (one traced cell function serves every
    micro-batch, see pipeline/cell_functions.py): then three spare values are drawn
    so that the shape stays static (XLA needs it) and the slice start is dynamic.
    """
    if isinstance(first_element, tf.Tensor):
        first_element = tf.cast(first_element, tf.int64)
        counter = tf.stack([tf.cast(first_element // 4, tf.uint64), tf.cast(step, tf.uint64)])
        values = tf.raw_ops.StatelessRandomUniformV2(
            shape=[num_elements + 3], key=tf.constant([key], tf.uint64), counter=counter,
            alg=_PHILOX, dtype=tf.float32)
        return tf.slice(values, tf.reshape(first_element % 4, [1]), [num_elements])
    skip = first_element % 4
    counter = tf.stack([tf.constant(first_element // 4, tf.uint64),
                        tf.cast(step, tf.uint64)])
    values = tf.raw_ops.StatelessRandomUniformV2(
        shape=[num_elements + skip], key=tf.constant([key], tf.uint64), counter=counter,
        alg=_PHILOX, dtype=tf.float32)
    return values[skip:]


def apply_mask(x: tf.Tensor, mask: tf.Tensor, keep_prob: float) -> tf.Tensor:
    """x / keep_prob where `mask`, else 0, with the gradient TensorFlow would give
    (dy / keep_prob where `mask`, else 0), value for value.

    Why not the plain ops: TensorFlow's gradient of `tf.where(mask, x / keep, 0)`
    also builds the quotient's gradient for the constant `keep` and the select's
    broadcast reductions, a dozen ops a tape then discards. Every dropout in every
    cell function and recompute traces them, and tracing is most of a first step.
    """
    @tf.custom_gradient
    def dropped(x):
        def grad(dy):
            return tf.where(mask, dy / keep_prob, tf.zeros([], dy.dtype))
        return tf.where(mask, x / keep_prob, tf.zeros([], x.dtype)), grad
    return dropped(x)


class Dropout(BaseLayer):
    """Drops units with probability 1 - keep_prob in training; identity in eval."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('keep_prob', 1.0, 'Probability of keeping a unit, in (0, 1].')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        if not 0.0 < self.params.keep_prob <= 1.0:
            raise ValueError(f'{self.path}: keep_prob={self.params.keep_prob} must be in '
                             '(0, 1]; 1.0 disables dropout')
        self._key = zlib.crc32(f'{self._seed}/{self.path}'.encode())

    def FProp(self, theta, x):
        keep = self.params.keep_prob
        mask = self.Mask(x.shape)
        if mask is None:
            return x
        return apply_mask(x, mask, keep)

    def Mask(self, shape: tf.TensorShape) -> tf.Tensor | None:
        """The keep mask of an activation of `shape` in the current context (None: keep
        everything, in eval or with keep_prob=1). A tensor-parallel layer cuts its part
        from the whole activation's mask, so each element keeps its mask whatever T is."""
        ctx = fprop_context.current()
        keep = self.params.keep_prob
        if not ctx.training or keep == 1.0:
            return None
        if ctx.step is None:
            raise ValueError(
                f'{self.path}: dropout in training mode needs the global step to draw a '
                'fresh mask each step: wrap the call in `with '
                'tfpipe.fprop_context.training(step=global_step):` (or use '
                'tfpipe.fprop_context.evaluation())')
        shape = tf.TensorShape(shape)
        if not shape[1:].is_fully_defined() or shape[0] is None:
            raise ValueError(f'{self.path}: dropout needs a static input shape, got '
                             f'{shape}; give the input a fixed batch and feature size')
        per_example = math.prod(shape[1:].as_list())
        uniform = stateless_uniform_slice(self._key, ctx.step, ctx.example_offset * per_example,
                                          shape[0] * per_example)
        return tf.reshape(uniform, shape) < keep

    @classmethod
    def FPropMeta(cls, p, x_shape):
        shape = tf.TensorShape(x_shape)
        return LayerMeta(2 * shape.num_elements(), shape)

    @classmethod
    def NumParams(cls, p):
        return 0
