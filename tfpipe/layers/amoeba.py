"""A compact AmoebaNet-D-style cell, the GPipe paper's image workload.

Like AmoebaNet (Real et al. 2019), each cell reads the two previous hidden
states, combines them through pairs of operations (separable convolution,
max/avg pooling, identity) and hands (new state, its own input) to the next
cell, so the activation flowing through the pipeline is a dict {'x', 'prev'}
that crosses cell boundaries. Simplified against the paper: three combine
nodes instead of five, and the node outputs are concatenated and projected
back to `filters` channels by a 1x1 convolution.
"""
from __future__ import annotations

import tensorflow as tf

from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers.normalization import BatchNorm


class AmoebaCell(BaseLayer):
    """Normal (stride 1) or reduction (stride 2) cell over {'x': h1, 'prev': h0}."""

    NESTED_ACTIVATIONS = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_channels', 0, "Channels of 'x'.")
        p.Define('prev_channels', 0, "Channels of 'prev' (= input_channels for the first cell).")
        p.Define('filters', 0, 'Channels of the cell output.')
        p.Define('reduction', False, 'Halve height and width (stride 2).')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if min(p.input_channels, p.prev_channels, p.filters) < 1:
            raise ValueError(f'{self.path}: input_channels, prev_channels and filters must be '
                             '>= 1')
        f = p.filters
        self.CreateVariable('proj_x', [1, 1, p.input_channels, f], 'he_normal')
        self.CreateVariable('proj_prev', [1, 1, p.prev_channels, f], 'he_normal')
        for name in ('sep0', 'sep1'):
            self.CreateVariable(f'{name}_depthwise', [3, 3, f, 1], 'he_normal')
            self.CreateVariable(f'{name}_pointwise', [1, 1, f, f], 'he_normal')
        self.CreateVariable('out', [1, 1, 3 * f, f], 'he_normal')
        for name in ('bn_x', 'bn_prev', 'bn_out'):
            self.CreateChild(name, BatchNorm.Params().Set(dim=f, dtype=p.dtype))

    def _Bn(self, theta, name, x):
        return self.children[name].FProp(theta[name], x)

    def FProp(self, theta, act):
        act = act if isinstance(act, dict) else {'x': act, 'prev': act}
        x, prev = act['x'], act['prev']
        if prev.shape[1] > x.shape[1]:  # the previous cell reduced: match its input's size
            prev = tf.nn.avg_pool2d(prev, 2, 2, 'SAME')
        stride = 2 if self.params.reduction else 1
        h1 = self._Bn(theta, 'bn_x', tf.nn.conv2d(tf.nn.relu(x), theta['proj_x'], 1, 'SAME'))
        h0 = self._Bn(theta, 'bn_prev',
                      tf.nn.conv2d(tf.nn.relu(prev), theta['proj_prev'], 1, 'SAME'))

        def sep(name, v, s):
            return tf.nn.separable_conv2d(tf.nn.relu(v), theta[f'{name}_depthwise'],
                                          theta[f'{name}_pointwise'], [1, s, s, 1], 'SAME')

        def pool(kind, v, s):
            return tf.nn.pool(v, [3, 3], kind, strides=[s, s], padding='SAME')

        def resize(v):
            return v if stride == 1 else tf.nn.avg_pool2d(v, 2, 2, 'SAME')

        n0 = pool('MAX', h0, stride) + resize(h1)
        n1 = sep('sep0', h1, stride) + pool('AVG', h0, stride)
        n2 = sep('sep1', n0, 1) + resize(h0)
        out = tf.nn.conv2d(tf.nn.relu(tf.concat([n0, n1, n2], -1)), theta['out'], 1, 'SAME')
        return {'x': self._Bn(theta, 'bn_out', out), 'prev': x}

    @classmethod
    def FPropMeta(cls, p, shapes):
        shapes = shapes if isinstance(shapes, dict) else {'x': shapes, 'prev': shapes}
        n, h, w, _ = tf.TensorShape(shapes['x']).as_list()
        s = 2 if p.reduction else 1
        oh, ow, f = -(-h // s), -(-w // s), p.filters
        flops = 2 * n * h * w * f * (p.input_channels + p.prev_channels)  # 1x1 projections
        flops += 2 * 2 * n * oh * ow * f * (9 + f)  # two separable convs
        flops += 2 * n * oh * ow * 3 * f * f + 30 * n * oh * ow * f  # output conv, pools, BN
        return LayerMeta(flops, {'x': tf.TensorShape([n, oh, ow, f]),
                                 'prev': tf.TensorShape(shapes['x'])})

    @classmethod
    def NumParams(cls, p):
        f = p.filters
        return f * (p.input_channels + p.prev_channels) + 2 * (9 * f + f * f) + 3 * f * f + 6 * f
