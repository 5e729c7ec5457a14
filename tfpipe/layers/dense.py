"""Fully connected projection over the last dimension."""
from __future__ import annotations

import math

import tensorflow as tf

from tfpipe import runtime_defaults
from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers import activations


def check_last_dim(layer: BaseLayer, x: tf.Tensor, expected: int, param: str) -> None:
    """Fails early, naming the layer and the param, when a width does not match."""
    got = x.shape[-1]
    if got is not None and got != expected:
        raise ValueError(f'{layer.path}: input has last dimension {got} but p.{param} is '
                         f'{expected}: set p.{param}={got} or fix the previous layer')


def projection_meta(x_shape, input_dim: int, output_dim: int) -> LayerMeta:
    """Flops and output shape of x @ w over the last dimension (Dense, its tensor-parallel
    forms and VocabLogits: splitting w over devices changes neither)."""
    x_shape = tf.TensorShape(x_shape)
    rows = math.prod(x_shape[:-1].as_list())
    return LayerMeta(2 * rows * input_dim * output_dim, x_shape[:-1].concatenate([output_dim]))


def projection_params(input_dim: int, output_dim: int, use_bias: bool) -> int:
    """Weights of x @ w (+ b), however w is split."""
    return input_dim * output_dim + (output_dim if use_bias else 0)


MIN_ROWS = 32  # the fewest rows the custom gradient was measured to pay at
MIN_WEIGHT = 256 * 1024  # the smallest weight (elements) it was measured to pay on


@tf.autograph.experimental.do_not_convert  # static Python: AutoGraph would only rewrite it
def matmul(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """x @ w for x of shape [rows, in]; on few rows, with a cheaper input gradient.

    TensorFlow's gradient computes dx = dy @ w^T with MatMul(transpose_b=True),
    which on the few rows of a micro-batch costs more than the product itself:
    both CPU kernels repack the whole transposed weight (in * out values) on every
    call. `input_gradient` repacks dy and transposes dx instead, rows * (out + in)
    values. Static shapes decide: from MIN_ROWS rows and MIN_WEIGHT weight
    elements while rows * (in + out) <= in * out (Eigen), or 4 * rows * (in + out)
    <= in * out with oneDNN, which repacks less (its MatMul on 256 rows of a [1024,
    1024] weight beat this form: 1.03-1.06x); otherwise TensorFlow's gradient.
    Below those bounds the custom gradient's own cost wins: 16 x Dense(256), K=8,
    M=64 (4 rows) took 95 ms a step against 46 ms with TensorFlow's gradient, and
    M=32 (8 rows) 47 against 36 ms (benchmarks/first_step_benchmark.py, quiet, Eigen).
    """
    rows, (fan_in, fan_out) = x.shape[0], w.shape
    repacked = (4 if runtime_defaults.onednn_enabled() else 1) * (fan_in + fan_out)
    if (rows is not None and fan_in and fan_out and rows >= MIN_ROWS
            and fan_in * fan_out >= MIN_WEIGHT and rows * repacked <= fan_in * fan_out):
        return _matmul_small_rows(x, w)
    return tf.matmul(x, w)


def input_gradient(dy: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """dy @ w^T, the input gradient of x @ w, computed as (w @ dy^T)^T.

    CPU time of one call, one thread, against TensorFlow's MatMul(dy, w,
    transpose_b=True) (benchmarks/matmul_forms_benchmark.py): Eigen, [1024, 1024]
    weight, 32 rows 0.18x, 128 rows 0.49x, 256 rows 0.69x, 1024 rows 1.09x; oneDNN
    32 rows 0.68x, 64 rows 0.93-0.97x.

    oneDNN runs BatchMatMulV2(dy, w, adj_y=True) faster still (0.64x, 0.75x), and
    Dense used it, but it raised the step's peak memory: the weight gradient
    x^T @ dy (0.71-0.73x at 32-64 rows) runs beside dx on the other inter-op
    thread and its [in, out] buffer lives until its consumer (the running sum's
    add, the optimizer) runs. With a dx slower than dw, as this form's from 64
    rows, dw and its consumer end first and the next layer's dw starts after them;
    with BatchMatMulV2's dx, as fast as dw, the next layer's dw often started while
    this one still waited, and two or three weight gradients were alive at once
    (8 x Dense(2048), K=2: +12 MiB at M=1, +13 to +45 MiB at M=4; allocations
    traced with the profiler, benchmarks/README.md, "Dense input gradient and
    executor memory"). The products and sums are the same ones; only the order
    of the loops differs.
    """
    return tf.transpose(tf.matmul(w, dy, transpose_b=True))


@tf.custom_gradient
def _matmul_small_rows(x: tf.Tensor, w: tf.Tensor):
    """x @ w, whose input gradient is `input_gradient`'s: see `matmul`."""
    def grad(dy):
        return input_gradient(dy, w), tf.matmul(x, dy, transpose_a=True)
    return tf.matmul(x, w), grad


class Dense(BaseLayer):
    """y = activation(x @ w + b), applied over the last dimension of any rank."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Width of the input (last dimension).')
        p.Define('output_dim', 0, 'Width of the output.')
        p.Define('activation', 'none', f'One of {activations.NAMES}.')
        p.Define('use_bias', True, 'Add a bias.')
        p.Define('weight_init', 'glorot_uniform', 'Initialiser name for w.')
        p.Define('weight_layout', 'io', "Layout of w: 'io' is [input_dim, output_dim]; 'oi' is "
                 '[output_dim, input_dim], the layout of an Embedding table, so that an output '
                 "softmax can tie its w to the input embedding (Lingvo's "
                 'use_num_classes_major_weight).')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if p.input_dim < 1 or p.output_dim < 1:
            raise ValueError(f'{self.path}: input_dim={p.input_dim} and output_dim='
                             f'{p.output_dim} must both be >= 1; set them in the Dense params')
        self._act = activations.get(p.activation, self.path)
        if p.weight_layout not in ('io', 'oi'):
            raise ValueError(f"{self.path}: weight_layout={p.weight_layout!r}: use 'io' "
                             "([input_dim, output_dim]) or 'oi' ([output_dim, input_dim])")
        shape = [p.input_dim, p.output_dim]
        self.CreateVariable('w', shape if p.weight_layout == 'io' else shape[::-1],
                            p.weight_init)
        if p.use_bias:
            self.CreateVariable('b', [p.output_dim], 'zeros')

    def FProp(self, theta, x):
        p = self.params
        check_last_dim(self, x, p.input_dim, 'input_dim')
        # Rank > 2 is flattened to one matmul: an einsum's gradient builds a
        # broadcast intermediate as large as batch x input_dim x output_dim.
        rows = tf.reshape(x, [-1, p.input_dim]) if x.shape.rank != 2 else x
        if p.weight_layout == 'io':
            y = matmul(rows, theta['w'])
        else:
            y = tf.matmul(rows, theta['w'], transpose_b=True)
        if x.shape.rank != 2:
            y = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [p.output_dim]], 0))
        if self.params.use_bias:
            y = tf.nn.bias_add(y, theta['b'])
        return self._act(y)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        return projection_meta(x_shape, p.input_dim, p.output_dim)

    @classmethod
    def NumParams(cls, p):
        return projection_params(p.input_dim, p.output_dim, p.use_bias)


# Lingvo's name for the same layer.
Projection = Dense
