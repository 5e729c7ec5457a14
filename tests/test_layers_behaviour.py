"""Tests for tfpipe.layers, part 2: dropout, Stash/Pop skips, errors, text round trip,
Dense's memory on rank-3 inputs.

Part 1 (test_layers.py) holds the cost model, seeded init and numerics, and the
helpers shared by both.
"""
import math

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import fprop_context, layers
from tfpipe.base_layer import BaseLayer, apply_layer
from tfpipe.layers import dropout as dropout_lib
from tests.test_layers import (F64, _conv_seq, _dense, _make_input, _np, _random_theta,
                               _set_dtype, _skip_seq)

# -- 4. Dropout -------------------------------------------------------------------------

def _drop(keep=0.7, name='drop', dtype=F64):
    return layers.Dropout.Params().Set(name=name, keep_prob=keep, dtype=dtype).Instantiate()


def test_dropout_eval_is_identity():
    x = _make_input(_dense(), [8, 5], F64)
    with fprop_context.evaluation():
        np.testing.assert_array_equal(_drop(0.3)(x).numpy(), x.numpy())
    # keep_prob 1.0 is the identity even in training without a step.
    np.testing.assert_array_equal(_drop(1.0)(x).numpy(), x.numpy())


def test_dropout_training_needs_a_step():
    x = tf.ones([2, 3], F64)
    with pytest.raises(ValueError, match=r'drop: dropout in training mode needs the global '
                                         r'step.*tfpipe\.fprop_context\.training\(step='):
        _drop()(x)
    with fprop_context.scope(training=True, step=None):
        with pytest.raises(ValueError, match=r'fprop_context\.training'):
            _drop()(x)


@pytest.mark.parametrize('keep', [0.3, 0.7, 0.95])
def test_dropout_keep_fraction_and_scaling(keep):
    x = tf.ones([250, 400], F64)
    with fprop_context.training(step=3):
        y = _drop(keep)(x).numpy()
    kept = y != 0
    assert abs(kept.mean() - keep) < 0.01
    np.testing.assert_allclose(y[kept], 1 / keep, rtol=1e-15)
    # Scaling keeps the expectation.
    assert abs(y.mean() - 1) < 0.03


# (per-example shape, offset, micro-batch size): D*offset covers multiples of 4 and not.
MICRO_CASES = [
    ([3], 1, 2), ([3], 4, 3), ([3], 5, 5), ([3], 9, 1),     # D=3 odd
    ([6], 1, 3), ([6], 2, 4), ([6], 3, 7), ([2, 3], 5, 2),  # D=6 even, not multiple of 4
    ([4], 3, 2), ([2, 2], 7, 3),                            # D=4
    ([5], 2, 6), ([1, 5], 3, 1), ([7], 6, 4),               # D=5, 7 odd
]
assert {(math.prod(s) * o) % 4 == 0 for s, o, _ in MICRO_CASES} == {True, False}
assert {math.prod(s) % 2 for s, _, _ in MICRO_CASES} == {0, 1}


@pytest.mark.parametrize('per_example,offset,size', MICRO_CASES)
def test_dropout_micro_batch_mask_is_slice_of_full_mask(per_example, offset, size):
    batch = 12
    layer = _drop(0.6)
    x = tf.constant(np.random.default_rng(1).uniform(1, 2, size=[batch, *per_example]))
    with fprop_context.training(step=11):
        full = layer(x).numpy()
    with fprop_context.scope(training=True, step=11, example_offset=offset):
        part = layer(x[offset:offset + size]).numpy()
    np.testing.assert_array_equal(part, full[offset:offset + size])
    # A wrong offset gives a different mask (so the check above can fail).
    with fprop_context.scope(training=True, step=11, example_offset=offset + 1):
        shifted = layer(x[offset:offset + size]).numpy()
    assert not np.array_equal(shifted != 0, full[offset:offset + size] != 0)


def test_dropout_mask_depends_on_step_and_layer_path():
    x = tf.ones([16, 32], F64)

    def mask(layer, step):
        with fprop_context.training(step=step):
            return layer(x).numpy() != 0

    a, b = _drop(0.5, 'drop_a'), _drop(0.5, 'drop_b')
    np.testing.assert_array_equal(mask(a, 4), mask(a, 4))  # a recompute draws the same mask
    np.testing.assert_array_equal(mask(a, 4), mask(a, tf.constant(4, tf.int64)))
    np.testing.assert_array_equal(mask(a, 4), mask(_drop(0.5, 'drop_a'), 4))
    assert not np.array_equal(mask(a, 4), mask(a, 5))
    assert not np.array_equal(mask(a, 4), mask(b, 4))


def test_dropout_inside_tf_function_with_step_variable():
    layer = _drop(0.5)
    x = tf.ones([6, 10], F64)
    step = tf.Variable(7, dtype=tf.int64)

    @tf.function
    def run():
        with fprop_context.training(step=step):
            return layer(x)

    with fprop_context.training(step=7):
        eager = layer(x).numpy()
    np.testing.assert_array_equal(run().numpy(), eager)
    step.assign(8)
    assert not np.array_equal(run().numpy(), eager)


@pytest.mark.parametrize('first', [0, 1, 2, 3, 4, 5, 7, 8, 13, 30])
@pytest.mark.parametrize('n', [1, 3, 16])
def test_stateless_uniform_slice_is_slice_of_longer_stream(first, n):
    full = dropout_lib.stateless_uniform_slice(1234, tf.constant(9), 0, 64).numpy()
    part = dropout_lib.stateless_uniform_slice(1234, tf.constant(9), first, n).numpy()
    assert part.dtype == np.float32 and part.shape == (n,)
    np.testing.assert_array_equal(part, full[first:first + n])
    assert ((full >= 0) & (full < 1)).all()
    other_step = dropout_lib.stateless_uniform_slice(1234, tf.constant(10), first, n).numpy()
    assert not np.array_equal(other_step, part)


# -- 5. Stash / Pop ---------------------------------------------------------------------

def test_stash_pop_add_is_skip_connection():
    p = _set_dtype(_skip_seq('add'), F64)
    net = p.Instantiate()
    th = _random_theta(net)
    x = _make_input(p, [3, 6], F64).numpy()
    n = _np(th)
    h0 = np.tanh(x @ n['fc0']['w'] + n['fc0']['b'])
    f = np.maximum(h0 @ n['fc1']['w'] + n['fc1']['b'], 0) @ n['fc2']['w'] + n['fc2']['b']
    ref = (h0 + f) @ n['fc3']['w'] + n['fc3']['b']
    np.testing.assert_allclose(net.FProp(th, tf.constant(x)).numpy(), ref, rtol=1e-12)


def test_stash_pop_concat():
    p = _set_dtype(layers.Sequential.Params().Set(name='seq', body=[
        layers.Stash.Params().Set(name='stash'),
        _dense('fc', 4, 6, activation='relu'),
        layers.Pop.Params().Set(name='pop', combine='concat')]), F64)
    net = p.Instantiate()
    th = _random_theta(net)
    x = _make_input(p, [3, 4], F64).numpy()
    f = np.maximum(x @ th['fc']['w'].numpy() + th['fc']['b'].numpy(), 0)
    y = net.FProp(th, tf.constant(x)).numpy()
    assert y.shape == (3, 10)
    np.testing.assert_allclose(y, np.concatenate([f, x], -1), rtol=1e-12)


def test_nested_stashes_and_skip_rides_along():
    p = _set_dtype(layers.Sequential.Params().Set(name='seq', body=[
        layers.Stash.Params().Set(name='s_a', key='a'),
        _dense('fc0', 4, 4),
        layers.Stash.Params().Set(name='s_b', key='b'),
        _dense('fc1', 4, 4),
        layers.Pop.Params().Set(name='p_b', key='b'),
        layers.Pop.Params().Set(name='p_a', key='a', combine='concat')]), F64)
    net = p.Instantiate()
    x = _make_input(p, [2, 4], F64)
    act = x
    for layer in net.layers[:4]:
        act = apply_layer(layer, layer.theta, act)
    assert set(act) == {'x', 'a', 'b'}
    np.testing.assert_array_equal(act['a'].numpy(), x.numpy())  # untouched by fc0/fc1
    h0 = net.fc0(x)
    np.testing.assert_array_equal(act['b'].numpy(), h0.numpy())
    y = net(x)
    ref = tf.concat([net.fc1(h0) + h0, x], -1)
    np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=1e-12)
    assert p.cls.FPropMeta(p, [2, 4]).out_shapes.as_list() == [2, 8]


def test_pop_without_stash_raises():
    net = layers.Sequential.Params().Set(name='seq', body=[
        _dense('fc', 4, 4), layers.Pop.Params().Set(name='pop')]).Instantiate()
    with pytest.raises(ValueError, match=r"seq/pop: nothing is stashed under 'skip'; put a "
                                         r"Stash with key='skip' before this Pop"):
        net(tf.ones([2, 4]))
    pop = layers.Pop.Params().Set(name='pop', key='k').Instantiate()
    with pytest.raises(ValueError, match=r"put a Stash with key='k' before this Pop"):
        pop({'x': tf.ones([2, 4]), 'skip': tf.ones([2, 4])})


def test_stash_errors():
    stash = layers.Stash.Params().Set(name='st').Instantiate()
    with pytest.raises(ValueError, match=r"st: 'skip' is already stashed; give each Stash"):
        stash({'x': tf.ones([1]), 'skip': tf.ones([1])})
    with pytest.raises(ValueError, match=r"st: key 'x' is reserved"):
        layers.Stash.Params().Set(name='st', key='x').Instantiate()
    with pytest.raises(ValueError, match=r"pop: combine 'mul' must be 'add' or 'concat'"):
        layers.Pop.Params().Set(name='pop', combine='mul').Instantiate()


# -- 6. Errors with clear messages -------------------------------------------------------

@pytest.mark.parametrize('name', ['FC-1', 'Fc', '', '0fc', 'fc 1'])
def test_bad_layer_name(name):
    with pytest.raises(ValueError, match=r"Dense layer has name .*: set p\.name to a "
                                         r"snake_case identifier"):
        _dense(name).Instantiate()


def test_bad_child_name_names_parent():
    p = layers.Sequential.Params().Set(name='seq', body=[_dense('FC-1')])
    with pytest.raises(ValueError, match=r"Dense layer under 'seq' has name 'FC-1'"):
        p.Instantiate()


def test_duplicate_and_reserved_child_names():
    p = layers.Sequential.Params().Set(name='seq', body=[_dense('fc', 6, 6), _dense('fc')])
    with pytest.raises(ValueError, match=r"'seq' already has a variable or child named 'fc': "
                                         r'give every child a unique name'):
        p.Instantiate()
    p = layers.Sequential.Params().Set(name='seq', body=[_dense('theta')])
    with pytest.raises(ValueError, match=r"the name 'theta' is reserved by Sequential"):
        p.Instantiate()


@pytest.mark.parametrize('make,x,match', [
    (lambda: _dense(), tf.ones([2, 5]),
     r'fc: input has last dimension 5 but p\.input_dim is 6: set p\.input_dim=5'),
    (lambda: layers.Conv2D.Params().Set(name='conv', filter_shape=(3, 3, 2, 4)),
     tf.ones([1, 4, 4, 3]), r'conv: input has last dimension 3 but p\.filter_shape\[2\] is 2'),
    (lambda: layers.BatchNorm.Params().Set(name='bn', dim=4), tf.ones([2, 3]),
     r'bn: input has last dimension 3 but p\.dim is 4'),
    (lambda: layers.LayerNorm.Params().Set(name='ln', dim=4), tf.ones([2, 3]),
     r'ln: input has last dimension 3 but p\.dim is 4'),
    (lambda: layers.MultiHeadAttention.Params().Set(name='mha', model_dim=4),
     tf.ones([2, 3, 5]), r'mha: input has last dimension 5 but p\.model_dim is 4'),
])
def test_width_mismatch_names_the_param(make, x, match):
    with pytest.raises(ValueError, match=match):
        make().Instantiate()(x)


@pytest.mark.parametrize('make,match', [
    (lambda: _dense(activation='relu6'), r"fc: unknown activation 'relu6'; use one of"),
    (lambda: layers.Conv2D.Params().Set(name='conv', filter_shape=(3, 3, 2, 4),
                                        activation='Relu'), r"unknown activation 'Relu'"),
    (lambda: _dense(i=0), r'fc: input_dim=0 and output_dim=4 must both be >= 1'),
    (lambda: _dense(weight_init='xavier'), r"unknown initialiser 'xavier': use one of"),
    (lambda: layers.Conv2D.Params().Set(name='conv', filter_shape=(3, 3, 2)),
     r'conv: filter_shape=\(3, 3, 2\) must be 4 positive ints'),
    (lambda: layers.Conv2D.Params().Set(name='conv'),
     r'conv: filter_shape=\(3, 3, 0, 0\) must be 4 positive ints'),
    (lambda: layers.Conv2D.Params().Set(name='conv', filter_shape=(3, 3, 2, 4),
                                        padding='same'),
     r"conv: padding 'same' must be one of \('SAME', 'VALID'\)"),
    (lambda: layers.Pooling2D.Params().Set(name='pool', padding='FULL'),
     r"pool: padding 'FULL' must be one of"),
    (lambda: layers.Pooling2D.Params().Set(name='pool', pooling_type='MIN'),
     r"pool: pooling_type 'MIN' must be 'MAX' or 'AVG'"),
    (lambda: layers.BatchNorm.Params().Set(name='bn'), r'bn: dim=0; set p\.dim'),
    (lambda: layers.BatchNorm.Params().Set(name='bn', dim=2, decay=1.0),
     r'bn: decay=1\.0 must be in \[0, 1\)'),
    (lambda: layers.LayerNorm.Params().Set(name='ln'), r'ln: dim=0; set p\.dim'),
    (lambda: layers.Dropout.Params().Set(name='drop', keep_prob=0.0),
     r'drop: keep_prob=0\.0 must be in \(0, 1\]'),
    (lambda: layers.Dropout.Params().Set(name='drop', keep_prob=1.5),
     r'drop: keep_prob=1\.5 must be in \(0, 1\]'),
    (lambda: layers.MultiHeadAttention.Params().Set(name='mha', model_dim=8, num_heads=3),
     r'mha: num_heads=3 must be >= 1 and divide model_dim=8'),
    (lambda: layers.TransformerBlock.Params().Set(name='tb', model_dim=8, hidden_dim=4,
                                                  num_heads=3),
     r'tb/atten: num_heads=3 must be >= 1 and divide model_dim=8'),
    (lambda: layers.TransformerBlock.Params().Set(name='tb', model_dim=8),
     r'tb: hidden_dim=0 must be >= 1'),
    (lambda: layers.Embedding.Params().Set(name='emb', vocab_size=3),
     r'emb: vocab_size=3 and embedding_dim=0 must both be >= 1'),
    (lambda: layers.Sequential.Params().Set(name='seq'), r'seq: body is empty'),
    (lambda: layers.Residual.Params().Set(name='res', body=[_dense(weight_init='nope')]),
     r"unknown initialiser 'nope'"),
])
def test_bad_params_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make().Instantiate()


def test_base_layer_without_cost_model_says_what_to_do():
    class NoMeta(BaseLayer):
        pass

    p = NoMeta.Params().Set(name='nm')
    with pytest.raises(NotImplementedError, match=r'NoMeta does not implement FPropMeta'):
        NoMeta.FPropMeta(p, [1])
    with pytest.raises(NotImplementedError, match=r'NoMeta does not implement NumParams'):
        NoMeta.NumParams(p)
    with pytest.raises(NotImplementedError, match=r'NoMeta does not implement FProp'):
        p.Instantiate()(tf.ones([1]))


# -- 7. Params text round trip builds the same model ------------------------------------

def test_sequential_text_round_trip_builds_same_weights():
    p = _set_dtype(_conv_seq(), F64)
    p.random_seed = 3
    text = p.ToText()
    q = layers.Sequential.Params().FromText(text)
    assert q == p and q.ToText() == text and p.TextDiff(q) == ''
    a, b = p.Instantiate(), q.Instantiate()
    assert [type(c) for c in b.layers] == [type(c) for c in a.layers]
    assert len(a.variables) == len(b.variables) > 0
    for va, vb in zip(a.variables, b.variables):
        assert va.name == vb.name and va.dtype == vb.dtype == F64
        np.testing.assert_array_equal(va.numpy(), vb.numpy())
    x = _make_input(p, [2, 6, 6, 2], F64)
    with fprop_context.evaluation():
        np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())
    # And the seed in the text matters: a different one builds different weights.
    c = layers.Sequential.Params().FromText(text.replace('random_seed : 3',
                                                         'random_seed : 4')).Instantiate()
    assert not np.array_equal(a.conv.theta['w'].numpy(), c.conv.theta['w'].numpy())


# -- Dense on rank-3 inputs -------------------------------------------------------------

def test_dense_on_rank3_inputs_builds_no_rows_by_weights_intermediate():
    """An einsum over '...i,io->...o' differentiates through a [rows, in, out] broadcast
    (8 GiB peak at [8, 128, 512] x [512, 2048]); Dense flattens to one matmul instead."""
    # float64: a float32 gradient summed over 20 rows in another order drifts by 2e-4
    # relative where terms cancel (CI met it once); the check is the algebra, not rounding.
    dense = layers.Dense.Params().Set(name='d', input_dim=16, output_dim=32,
                                      dtype=F64).Instantiate()
    x = tf.random.stateless_normal([4, 5, 16], seed=[1, 2], dtype=F64)

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            y = dense.FProp(dense.theta, x)
            loss = tf.reduce_sum(y * y)
        assert y.shape == [4, 5, 32]  # the static shape survives the flattening
        return tape.gradient(loss, dense.theta)

    graph = grads.get_concrete_function().graph
    largest = max(t.shape.num_elements() or 0 for op in graph.get_operations()
                  for t in op.outputs if t.shape.is_fully_defined())
    assert largest < 4 * 5 * 16 * 32 // 4, largest
    rows = x.numpy().reshape(-1, 16)
    dy = 2 * (rows @ dense.theta['w'].numpy() + dense.theta['b'].numpy())
    np.testing.assert_allclose(grads()['w'].numpy(), rows.T @ dy, rtol=1e-10)
