"""Convolution, pooling and flattening for NHWC images."""
from __future__ import annotations

import math

import tensorflow as tf

from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers import activations
from tfpipe.layers.dense import check_last_dim

_PADDINGS = ('SAME', 'VALID')


def _out_hw(size: int, window: int, stride: int, padding: str) -> int:
    if padding == 'SAME':
        return -(-size // stride)
    return (size - window) // stride + 1


def _check_padding(layer: BaseLayer, padding: str) -> None:
    if padding not in _PADDINGS:
        raise ValueError(f"{layer.path}: padding {padding!r} must be one of {_PADDINGS}")


class Conv2D(BaseLayer):
    """2-D convolution (NHWC) with optional bias and activation."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('filter_shape', (3, 3, 0, 0), '(height, width, in_channels, out_channels).')
        p.Define('filter_stride', (1, 1), '(height, width) strides.')
        p.Define('padding', 'SAME', "'SAME' or 'VALID'.")
        p.Define('activation', 'none', f'One of {activations.NAMES}.')
        p.Define('use_bias', True, 'Add a bias per output channel.')
        p.Define('weight_init', 'he_normal', 'Initialiser name for w.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if len(p.filter_shape) != 4 or min(p.filter_shape) < 1:
            raise ValueError(f'{self.path}: filter_shape={tuple(p.filter_shape)} must be 4 '
                             'positive ints (height, width, in_channels, out_channels)')
        _check_padding(self, p.padding)
        self._act = activations.get(p.activation, self.path)
        self.CreateVariable('w', list(p.filter_shape), p.weight_init)
        if p.use_bias:
            self.CreateVariable('b', [p.filter_shape[3]], 'zeros')

    def FProp(self, theta, x):
        p = self.params
        check_last_dim(self, x, p.filter_shape[2], 'filter_shape[2]')
        y = tf.nn.conv2d(x, theta['w'], strides=[1, *p.filter_stride, 1], padding=p.padding)
        if p.use_bias:
            y = tf.nn.bias_add(y, theta['b'])
        return self._act(y)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        n, h, w, _ = tf.TensorShape(x_shape).as_list()
        kh, kw, cin, cout = p.filter_shape
        oh = _out_hw(h, kh, p.filter_stride[0], p.padding)
        ow = _out_hw(w, kw, p.filter_stride[1], p.padding)
        return LayerMeta(2 * n * oh * ow * kh * kw * cin * cout,
                         tf.TensorShape([n, oh, ow, cout]))

    @classmethod
    def NumParams(cls, p):
        kh, kw, cin, cout = p.filter_shape
        return kh * kw * cin * cout + (cout if p.use_bias else 0)


class Pooling2D(BaseLayer):
    """Max or average pooling over height and width (NHWC)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('pooling_type', 'MAX', "'MAX' or 'AVG'.")
        p.Define('window_shape', (2, 2), '(height, width) of the window.')
        p.Define('window_stride', (2, 2), '(height, width) strides.')
        p.Define('padding', 'SAME', "'SAME' or 'VALID'.")
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        if self.params.pooling_type not in ('MAX', 'AVG'):
            raise ValueError(f"{self.path}: pooling_type {self.params.pooling_type!r} must be "
                             "'MAX' or 'AVG'")
        _check_padding(self, self.params.padding)

    def FProp(self, theta, x):
        p = self.params
        return tf.nn.pool(x, window_shape=list(p.window_shape), pooling_type=p.pooling_type,
                          strides=list(p.window_stride), padding=p.padding)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        n, h, w, c = tf.TensorShape(x_shape).as_list()
        oh = _out_hw(h, p.window_shape[0], p.window_stride[0], p.padding)
        ow = _out_hw(w, p.window_shape[1], p.window_stride[1], p.padding)
        return LayerMeta(n * oh * ow * c * math.prod(p.window_shape),
                         tf.TensorShape([n, oh, ow, c]))

    @classmethod
    def NumParams(cls, p):
        return 0


class GlobalAvgPool(BaseLayer):
    """Mean over height and width: [N, H, W, C] -> [N, C]."""

    def FProp(self, theta, x):
        return tf.reduce_mean(x, axis=[1, 2])

    @classmethod
    def FPropMeta(cls, p, x_shape):
        n, h, w, c = tf.TensorShape(x_shape).as_list()
        return LayerMeta(n * h * w * c, tf.TensorShape([n, c]))

    @classmethod
    def NumParams(cls, p):
        return 0


class Flatten(BaseLayer):
    """[N, ...] -> [N, prod(...)]."""

    def FProp(self, theta, x):
        return tf.reshape(x, [-1, math.prod(x.shape[1:].as_list())])

    @classmethod
    def FPropMeta(cls, p, x_shape):
        dims = tf.TensorShape(x_shape).as_list()
        return LayerMeta(0, tf.TensorShape([dims[0], math.prod(dims[1:])]))

    @classmethod
    def NumParams(cls, p):
        return 0
