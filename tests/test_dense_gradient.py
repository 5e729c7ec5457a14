"""Dense's matmul gradient: the values of TensorFlow's own, in cheaper forms.

On few rows (a micro-batch), tfpipe.layers.dense.matmul computes the input
gradient dy @ w^T as (w @ dy^T)^T (dense.input_gradient; the cost measured by
benchmarks/micro_batch_cost_benchmark.py), never with the weight transposed: not
in MatMul, whose kernels repack it per call, nor in BatchMatMulV2, whose faster dx
raised the step's peak memory (see input_gradient). On many rows (fewer with
oneDNN), on very few (under dense.MIN_ROWS) and on small weights (under
dense.MIN_WEIGHT elements) it keeps TensorFlow's gradient. This process runs
oneDNN (tests/conftest.py).
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


@pytest.mark.parametrize('rows', [32, 100])
def test_input_gradient_equals_tensorflows(rows):
    dy = tf.random.stateless_normal([rows, 384], [5, rows], dtype=tf.float64)
    w = tf.random.stateless_normal([WIDTH, 384], [6, rows], dtype=tf.float64)
    np.testing.assert_allclose(dense.input_gradient(dy, w).numpy(),
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


def test_dense_gradient_through_rank_3_input_never_transposes_the_weight():
    """48 rows: the weight is multiplied as it is under either kernel setting. Not in
    MatMul(transpose_b) (Eigen repacks the whole weight per call), nor in oneDNN's
    faster BatchMatMulV2(adj_y): its dx, as fast as the weight gradient beside it,
    let the next layer's weight gradient start before this one was summed
    (benchmarks/executor_memory_benchmark.py: +12 MiB at M=1, up to +45 at M=4)."""
    assert _transposed_weight_matmuls(4, 12) == []


def test_onednn_keeps_tensorflows_gradient_from_fewer_rows():
    """100 rows of a [512, 512] weight: Eigen's kernels repack the weight, so the custom
    form pays while rows * (in + out) <= in * out; oneDNN's repack less, so there it
    pays only to a quarter of that (1.03-1.06x MatMul's time at 256 rows of 1024)."""
    want = ['MatMul'] if runtime_defaults.onednn_enabled() else []
    assert _transposed_weight_matmuls(4, 25) == want


def test_below_min_rows_tensorflows_own_gradient_is_kept():
    """4-row micro-batches (16 x Dense(256), K=8, M=64) ran 2x slower on the custom
    gradient: under dense.MIN_ROWS the weight is multiplied transposed as TensorFlow does."""
    assert _transposed_weight_matmuls(2, 2) == ['MatMul']  # 4 rows
