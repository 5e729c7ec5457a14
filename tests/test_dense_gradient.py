"""Dense's matmul gradient: the values of TensorFlow's own, in cheaper forms.

On few rows (a micro-batch), tfpipe.layers.dense.matmul computes the input
gradient dy @ w^T in the form each kernel setting runs fastest
(dense.input_gradient: (w @ dy^T)^T for Eigen, BatchMatMulV2 for oneDNN; the cost
measured by benchmarks/micro_batch_cost_benchmark.py); on many rows, on very few
(under dense.MIN_ROWS) and on small weights (under dense.MIN_WEIGHT elements) it
keeps TensorFlow's gradient. This process runs oneDNN (tests/conftest.py); both
forms' values are checked directly.
"""
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import layers, runtime_defaults
from tfpipe.layers import dense


def _grads(fn, x, w):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = fn(x, w)
        loss = tf.reduce_sum(y * tf.cos(y))  # a non-uniform dy
    return tape.gradient(loss, [x, w])


WIDTH = 512  # a [512, 512] weight: dense.MIN_WEIGHT elements


# Few rows on a [512, 512] weight: 32..256; either side too.
@pytest.mark.parametrize('rows', [1, 31, 32, 48, 64, 65, 256, 257])
def test_matmul_gradient_equals_tensorflows(rows):
    x = tf.random.stateless_normal([rows, WIDTH], [1, rows], dtype=tf.float64)
    w = tf.random.stateless_normal([WIDTH, WIDTH], [2, rows], dtype=tf.float64)
    ours, theirs = _grads(dense.matmul, x, w), _grads(tf.matmul, x, w)
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('onednn', [False, True])
@pytest.mark.parametrize('rows', [32, 100])
def test_both_input_gradient_forms_equal_tensorflows(rows, onednn):
    dy = tf.random.stateless_normal([rows, 384], [5, rows], dtype=tf.float64)
    w = tf.random.stateless_normal([WIDTH, 384], [6, rows], dtype=tf.float64)
    np.testing.assert_allclose(dense.input_gradient(dy, w, onednn).numpy(),
                               tf.matmul(dy, w, transpose_b=True).numpy(), rtol=1e-12,
                               atol=1e-12)


def _transposed_weight_matmuls(batch: int, length: int) -> list[str]:
    """Dense's gradient through a [batch, length, WIDTH] input, checked against TensorFlow's
    gradient; returns the types of the traced step's matmuls that take the weight
    transposed."""
    layer = layers.Dense.Params().Set(name='fc', input_dim=WIDTH, output_dim=WIDTH,
                                      activation='relu').Instantiate()
    x = tf.random.stateless_normal([batch, length, WIDTH], [3, 4])

    @tf.function
    def step(theta, x):
        with tf.GradientTape() as tape:
            tape.watch([theta, x])
            loss = tf.reduce_sum(tf.square(layer.FProp(theta, x)))
        return tape.gradient(loss, [theta, x])

    theta = {name: tf.convert_to_tensor(v) for name, v in layer.theta.items()}
    (dtheta, dx) = step(theta, x)
    with tf.GradientTape() as tape:  # the same layer written with TensorFlow's gradient
        tape.watch([theta, x])
        y = tf.nn.relu(tf.reshape(tf.reshape(x, [-1, WIDTH]) @ theta['w'],
                                  [batch, length, WIDTH]) + theta['b'])
        loss = tf.reduce_sum(tf.square(y))
    want_theta, want_x = tape.gradient(loss, [theta, x])
    np.testing.assert_allclose(dx.numpy(), want_x.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dtheta['w'].numpy(), want_theta['w'].numpy(), rtol=1e-4,
                               atol=1e-4)
    graph = step.get_concrete_function(theta, x).graph
    flag = {'MatMul': 'transpose_b', 'BatchMatMulV2': 'adj_y'}
    return [op.type for op in graph.get_operations() if op.type in flag
            and op.get_attr(flag[op.type]) and op.inputs[1].shape == [WIDTH, WIDTH]]


def test_dense_gradient_through_rank_3_input_in_the_kernels_fast_form():
    """48 rows: oneDNN multiplies by the transposed weight in BatchMatMulV2, never in
    MatMul (its GEMM call, 1.3-1.6x the time there); Eigen not at all."""
    want = ['BatchMatMulV2'] if runtime_defaults.onednn_enabled() else []
    assert _transposed_weight_matmuls(4, 12) == want


def test_below_min_rows_tensorflows_own_gradient_is_kept():
    """4-row micro-batches (16 x Dense(256), K=8, M=64) ran 2x slower on the custom
    gradient: under dense.MIN_ROWS the weight is multiplied transposed as TensorFlow does."""
    assert _transposed_weight_matmuls(2, 2) == ['MatMul']  # 4 rows
