"""BatchNorm (micro-batch aware) and LayerNorm."""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers.dense import check_last_dim


def combine_moments(stats: Sequence[tuple]) -> tuple:
    """Merges per-part (count, mean, variance) into the whole's, exactly.

    Uses the parallel (Chan et al.) form: var = sum n_i (var_i + (mean_i - mean)^2) / n,
    which avoids the cancellation of sum(x^2)/n - mean^2.
    """
    if len(stats) == 1:
        return stats[0]
    total = tf.add_n([c for c, _, _ in stats])
    mean = tf.add_n([c * m for c, m, _ in stats]) / total
    var = tf.add_n([c * (v + tf.square(m - mean)) for c, m, v in stats]) / total
    return total, mean, var


class BatchNorm(BaseLayer):
    """Batch normalisation over every axis but the last.

    Training: normalises with the statistics of the batch it is given, which
    under a pipeline is one micro-batch (GPipe's choice: M changes the outputs).
    The moving statistics are updated once per mini-batch from the statistics
    of all micro-batches combined, so they equal a full-batch BN's update.
    Eval: normalises with the moving statistics.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('dim', 0, 'Number of channels (last dimension).')
        p.Define('decay', 0.99, 'Moving average decay: moving = decay * moving + '
                 '(1 - decay) * batch.')
        p.Define('epsilon', 1e-3, 'Added to the variance before the square root.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if p.dim < 1:
            raise ValueError(f'{self.path}: dim={p.dim}; set p.dim to the channel count')
        if not 0.0 <= p.decay < 1.0:
            raise ValueError(f'{self.path}: decay={p.decay} must be in [0, 1)')
        self.CreateVariable('gamma', [p.dim], 'ones')
        self.CreateVariable('beta', [p.dim], 'zeros')
        self.moving_mean = self.CreateVariable('moving_mean', [p.dim], 'zeros', trainable=False)
        self.moving_variance = self.CreateVariable('moving_variance', [p.dim], 'ones',
                                                   trainable=False)

    def FProp(self, theta, x):
        p = self.params
        check_last_dim(self, x, p.dim, 'dim')
        ctx = fprop_context.current()
        if not ctx.training:
            mean, var = (tf.cast(v, x.dtype) for v in (self.moving_mean, self.moving_variance))
        else:
            axes = list(range(x.shape.rank - 1))
            mean, var = tf.nn.moments(x, axes)
            # Statistics travel in at least float32: a float16 count overflows at 65504
            # and bfloat16 cannot count past 256 exactly.
            stat_dtype = tf.float32 if x.dtype.size < 4 else x.dtype
            count = tf.cast(tf.size(x) // p.dim, stat_dtype)
            moments = (count, tf.stop_gradient(tf.cast(mean, stat_dtype)),
                       tf.stop_gradient(tf.cast(var, stat_dtype)))
            if ctx.batch_stats is not None:
                ctx.batch_stats.record(self, *moments)
            else:
                self.ApplyBatchStatistics([moments])
        return tf.nn.batch_normalization(x, mean, var, theta['beta'], theta['gamma'],
                                         p.epsilon)

    def ApplyBatchStatistics(self, stats: Sequence[tuple]) -> None:
        """One moving-average update from the statistics of all parts of a batch."""
        _, mean, var = combine_moments(stats)
        decay = self.params.decay
        for moving, batch in ((self.moving_mean, mean), (self.moving_variance, var)):
            old = tf.cast(moving, batch.dtype)
            moving.assign(tf.cast(decay * old + (1 - decay) * batch, moving.dtype))

    @classmethod
    def FPropMeta(cls, p, x_shape):
        shape = tf.TensorShape(x_shape)
        return LayerMeta(8 * shape.num_elements(), shape)

    @classmethod
    def NumParams(cls, p):
        return 2 * p.dim


class LayerNorm(BaseLayer):
    """Normalises each example over its last dimension."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('dim', 0, 'Width of the last dimension.')
        p.Define('epsilon', 1e-6, 'Added to the variance before the square root.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        if self.params.dim < 1:
            raise ValueError(f'{self.path}: dim={self.params.dim}; set p.dim to the width')
        self.CreateVariable('scale', [self.params.dim], 'ones')
        self.CreateVariable('bias', [self.params.dim], 'zeros')

    def FProp(self, theta, x):
        check_last_dim(self, x, self.params.dim, 'dim')
        mean, var = tf.nn.moments(x, [-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + self.params.epsilon) * theta['scale'] + \
            theta['bias']

    @classmethod
    def FPropMeta(cls, p, x_shape):
        shape = tf.TensorShape(x_shape)
        return LayerMeta(8 * shape.num_elements(), shape)

    @classmethod
    def NumParams(cls, p):
        return 2 * p.dim
