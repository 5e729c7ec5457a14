"""Dense's matmul gradient: the values of TensorFlow's own, without repacking the weight.

On few rows (a micro-batch), tfpipe.layers.dense.matmul computes the input
gradient as (w @ dy^T)^T so that no kernel repacks the transposed weight per
micro-batch (the cost measured by benchmarks/micro_batch_cost_benchmark.py); on
many rows it keeps TensorFlow's gradient.
"""
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import layers
from tfpipe.layers import dense


def _grads(fn, x, w):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = fn(x, w)
        loss = tf.reduce_sum(y * tf.cos(y))  # a non-uniform dy
    return tape.gradient(loss, [x, w])


@pytest.mark.parametrize('rows', [1, 3, 6, 7, 27, 28, 100])  # few: 27 (Eigen), 6 (oneDNN)
def test_matmul_gradient_equals_tensorflows(rows):
    x = tf.random.stateless_normal([rows, 64], [1, rows], dtype=tf.float64)
    w = tf.random.stateless_normal([64, 48], [2, rows], dtype=tf.float64)
    ours, theirs = _grads(dense.matmul, x, w), _grads(tf.matmul, x, w)
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)


def test_dense_gradient_through_rank_3_input_and_no_transposed_weight_matmul():
    layer = layers.Dense.Params().Set(name='fc', input_dim=64, output_dim=48,
                                      activation='relu').Instantiate()
    x = tf.random.stateless_normal([2, 3, 64], [3, 4])  # 6 rows: few for either kernel

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
        y = tf.nn.relu(tf.reshape(tf.reshape(x, [-1, 64]) @ theta['w'], [2, 3, 48]) + theta['b'])
        loss = tf.reduce_sum(tf.square(y))
    want_theta, want_x = tape.gradient(loss, [theta, x])
    np.testing.assert_allclose(dx.numpy(), want_x.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dtheta['w'].numpy(), want_theta['w'].numpy(), rtol=1e-5,
                               atol=1e-6)
    graph = step.get_concrete_function(theta, x).graph
    weight_transposed = [op for op in graph.get_operations() if op.type == 'MatMul'
                         and op.get_attr('transpose_b') and op.inputs[1].shape == [64, 48]]
    assert not weight_transposed, [op.name for op in weight_transposed]
