"""Tests for tfpipe.layers, part 1: cost model, seeded init, numerics (and shared helpers)."""
import math

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import fprop_context, layers
from tfpipe.layers import normalization

F64 = tf.float64


# -- Helpers ---------------------------------------------------------------------------

def _set_dtype(p, dtype):
    """Sets dtype on p and, recursively, on every params in its body."""
    p.dtype = dtype
    if 'body' in p:
        for bp in p.body:
            _set_dtype(bp, dtype)
    return p


def _dense(name='fc', i=6, o=4, **kw):
    return layers.Dense.Params().Set(name=name, input_dim=i, output_dim=o, **kw)


def _flat_theta(theta, prefix=''):
    """{'child/var': numpy value} for a nested theta."""
    out = {}
    for k, v in theta.items():
        if isinstance(v, dict):
            out.update(_flat_theta(v, f'{prefix}{k}/'))
        else:
            out[prefix + k] = v.numpy()
    return out


def _shape_list(s):
    if isinstance(s, dict):
        return {k: _shape_list(v) for k, v in s.items()}
    return tf.TensorShape(s).as_list()


def _out_shapes(y):
    if isinstance(y, dict):
        return {k: _out_shapes(v) for k, v in y.items()}
    return y.shape.as_list()


# Integer entries of a packed activation (PackedTransformerBlock, PackedPositionEmbedding).
_PACKED_IDS = {'segment_ids': lambda b, t: np.repeat([[1] * (t // 2) + [2] * (t - t // 2)], b, 0),
               'positions': lambda b, t: np.repeat([np.arange(t)], b, 0)}


def _make_input(p, shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if isinstance(shape, dict) and set(_PACKED_IDS) <= set(shape):
        b, t = shape['segment_ids']
        return {'x': _make_input(p, shape['x'], dtype, seed),
                **{k: tf.constant(make(b, t), tf.int32) for k, make in _PACKED_IDS.items()}}
    if isinstance(shape, dict):
        return {k: _make_input(p, s, dtype, seed + i) for i, (k, s) in enumerate(shape.items())}
    if p.cls is layers.Embedding:
        return tf.constant(rng.integers(0, p.vocab_size, size=shape), tf.int32)
    return tf.constant(rng.normal(size=shape), dtype)


def _random_theta(layer, seed=0):
    """A theta like layer.theta with every entry drawn at random (biases non-zero)."""
    rng = np.random.default_rng(seed)
    return tf.nest.map_structure(
        lambda v: tf.constant(rng.normal(scale=0.5, size=v.shape.as_list()), v.dtype),
        layer.theta)


def _np(theta):
    return tf.nest.map_structure(lambda v: np.asarray(v), theta)


# -- One small valid params per layer -------------------------------------------------

def _conv_seq():
    return layers.Sequential.Params().Set(name='seq', body=[
        layers.Conv2D.Params().Set(name='conv', filter_shape=(3, 3, 2, 4), activation='relu'),
        layers.BatchNorm.Params().Set(name='bn', dim=4),
        layers.Pooling2D.Params().Set(name='pool'),
        layers.Flatten.Params().Set(name='flat'),
        _dense('logits', 3 * 3 * 4, 5),
        layers.Dropout.Params().Set(name='drop', keep_prob=0.8)])


def _skip_seq(combine):
    return layers.Sequential.Params().Set(name='seq', body=[
        _dense('fc0', 6, 4, activation='tanh'),
        layers.Stash.Params().Set(name='stash', key='s'),
        _dense('fc1', 4, 4, activation='relu'),
        _dense('fc2', 4, 4),
        layers.Pop.Params().Set(name='pop', key='s', combine=combine),
        _dense('fc3', 4 if combine == 'add' else 8, 3)])


# id -> (params builder, input shape, does FProp compute anything (flops > 0)?)
CASES = {
    'Dense': (lambda: _dense(), [3, 6], True),
    'Dense-rank3-nobias-gelu': (lambda: _dense(use_bias=False, activation='gelu'), [2, 3, 6],
                                True),
    'Projection': (lambda: layers.Projection.Params().Set(name='proj', input_dim=5,
                                                          output_dim=2), [4, 5], True),
    'Conv2D-same-stride2': (lambda: layers.Conv2D.Params().Set(
        name='conv', filter_shape=(3, 3, 2, 4), filter_stride=(2, 2)), [2, 7, 7, 2], True),
    'Conv2D-valid-nobias': (lambda: layers.Conv2D.Params().Set(
        name='conv', filter_shape=(2, 3, 3, 2), filter_stride=(1, 2), padding='VALID',
        use_bias=False), [1, 6, 7, 3], True),
    'Pooling2D-max-same': (lambda: layers.Pooling2D.Params().Set(name='pool'), [2, 5, 5, 3],
                           True),
    'Pooling2D-avg-valid': (lambda: layers.Pooling2D.Params().Set(
        name='pool', pooling_type='AVG', window_shape=(3, 2), window_stride=(1, 2),
        padding='VALID'), [2, 6, 7, 2], True),
    'GlobalAvgPool': (lambda: layers.GlobalAvgPool.Params().Set(name='gap'), [2, 4, 5, 3],
                      True),
    'Flatten': (lambda: layers.Flatten.Params().Set(name='flat'), [2, 3, 4, 5], False),
    'BatchNorm': (lambda: layers.BatchNorm.Params().Set(name='bn', dim=3), [4, 5, 3], True),
    'Dropout': (lambda: layers.Dropout.Params().Set(name='drop', keep_prob=0.5), [4, 6], True),
    'Embedding': (lambda: layers.Embedding.Params().Set(name='emb', vocab_size=10,
                                                        embedding_dim=4), [3, 5], True),
    'LayerNorm': (lambda: layers.LayerNorm.Params().Set(name='ln', dim=6), [2, 3, 6], True),
    'VocabLogits': (lambda: layers.VocabLogits.Params().Set(name='logits', input_dim=6,
                                                            vocab_size=9), [2, 3, 6], True),
    'MoEFeedForward': (lambda: layers.MoEFeedForward.Params().Set(
        name='moe', model_dim=8, hidden_dim=12, num_experts=4, capacity_factor=1.0),
        [2, 5, 8], True),
    'MoEFeedForward-top1-rank2': (lambda: layers.MoEFeedForward.Params().Set(
        name='moe', model_dim=6, hidden_dim=4, num_experts=3, top_k=1), [7, 6], True),
    'MultiHeadAttention': (lambda: layers.MultiHeadAttention.Params().Set(
        name='mha', model_dim=8, num_heads=2, causal=True, atten_dropout_keep_prob=0.9),
        [2, 5, 8], True),
    'TransformerBlock': (lambda: layers.TransformerBlock.Params().Set(
        name='tb', model_dim=8, hidden_dim=12, num_heads=4, residual_dropout_keep_prob=0.9),
        [2, 5, 8], True),
    'Residual': (lambda: layers.Residual.Params().Set(name='res', body=[
        _dense('fc0', 6, 6, activation='relu'), layers.LayerNorm.Params().Set(name='ln', dim=6),
        _dense('fc1', 6, 6)]), [3, 6], True),
    'Sequential-conv': (_conv_seq, [2, 6, 6, 2], True),
    'Sequential-skip-add': (lambda: _skip_seq('add'), [3, 6], True),
    'Sequential-skip-concat': (lambda: _skip_seq('concat'), [3, 6], True),
    'Stash': (lambda: layers.Stash.Params().Set(name='stash'), [3, 4], False),
    'Pop-add': (lambda: layers.Pop.Params().Set(name='pop'), {'x': [3, 4], 'skip': [3, 4]},
                True),
    'Pop-concat-extra': (lambda: layers.Pop.Params().Set(name='pop', key='a', combine='concat'),
                         {'x': [3, 4], 'a': [3, 2], 'b': [3, 1]}, False),
    'PositionEmbedding': (lambda: layers.PositionEmbedding.Params().Set(
        name='pos', max_length=7, embedding_dim=4), [2, 5, 4], True),
    'PackedPositionEmbedding': (lambda: layers.PackedPositionEmbedding.Params().Set(
        name='pos', max_length=7, embedding_dim=4),
        {'x': [2, 5, 4], 'segment_ids': [2, 5], 'positions': [2, 5]}, True),
    'PackedTransformerBlock': (lambda: layers.PackedTransformerBlock.Params().Set(
        name='tb', model_dim=8, hidden_dim=12, num_heads=4),
        {'x': [2, 5, 8], 'segment_ids': [2, 5], 'positions': [2, 5]}, True),
    'PackedMoETransformerBlock': (lambda: layers.PackedMoETransformerBlock.Params().Set(
        name='tb', model_dim=8, hidden_dim=6, num_heads=2, num_experts=4),
        {'x': [2, 5, 8], 'segment_ids': [2, 5], 'positions': [2, 5]}, True),
    'DropSkips': (lambda: layers.DropSkips.Params().Set(name='drop_skips'),
                  {'x': [3, 4], 'prev': [3, 2]}, False),
    'AmoebaCell': (lambda: layers.AmoebaCell.Params().Set(
        name='cell', input_channels=3, prev_channels=3, filters=4), [2, 6, 6, 3], True),
    'AmoebaCell-reduction-nested': (lambda: layers.AmoebaCell.Params().Set(
        name='cell', input_channels=4, prev_channels=2, filters=6, reduction=True),
        {'x': [2, 4, 4, 4], 'prev': [2, 8, 8, 2]}, True),
}
CASE_IDS = sorted(CASES)


def _build_case(case_id, dtype=tf.float32):
    make, shape, computes = CASES[case_id]
    return _set_dtype(make(), dtype), shape, computes


def test_every_exported_layer_has_a_case():
    covered = {cid.split('-')[0] for cid in CASES}
    assert set(layers.__all__) <= covered, set(layers.__all__) - covered
    for cid in CASES:
        name = cid.split('-')[0]
        p, _, _ = _build_case(cid)
        assert p.cls is getattr(layers, name)


# -- 1. NumParams and FPropMeta vs the real layer -------------------------------------

@pytest.mark.parametrize('case_id', CASE_IDS)
def test_num_params_and_meta_match_fprop(case_id):
    p, shape, computes = _build_case(case_id)
    layer = p.Instantiate()
    actual = sum(int(np.prod(v.shape.as_list())) for v in tf.nest.flatten(layer.theta))
    assert p.cls.NumParams(p) == actual
    # theta holds exactly the module's trainable variables.
    assert {id(v) for v in tf.nest.flatten(layer.theta)} == \
        {id(v) for v in layer.trainable_variables}

    meta = p.cls.FPropMeta(p, shape)
    with fprop_context.training(step=1):
        y = layer.FProp(layer.theta, _make_input(p, shape, p.dtype))
    assert _shape_list(meta.out_shapes) == _out_shapes(y)
    assert isinstance(meta.flops, int)
    if computes:
        assert meta.flops > 0
    else:
        assert meta.flops == 0


@pytest.mark.parametrize('shape', [[3, 6], [2, 5, 6], [6]])
def test_dense_flops_exact(shape):
    p = _dense()
    rows = math.prod(shape[:-1])
    assert layers.Dense.FPropMeta(p, shape).flops == 2 * rows * 6 * 4


def test_conv_flops_exact():
    p = layers.Conv2D.Params().Set(name='c', filter_shape=(3, 3, 2, 4), filter_stride=(2, 2))
    # SAME, 7x7 stride 2 -> 4x4 outputs.
    assert layers.Conv2D.FPropMeta(p, [2, 7, 7, 2]).flops == 2 * 2 * 4 * 4 * 3 * 3 * 2 * 4


@pytest.mark.parametrize('case_id', ['Sequential-conv', 'Sequential-skip-concat', 'Residual'])
def test_composite_meta_is_sum_of_children(case_id):
    p, shape, _ = _build_case(case_id)
    flops, shapes = 0, shape
    for lp in p.body:
        m = lp.cls.FPropMeta(lp, shapes['x']) if isinstance(shapes, dict) and \
            not lp.cls.NESTED_ACTIVATIONS else lp.cls.FPropMeta(lp, shapes)
        flops += m.flops
        shapes = {**shapes, 'x': m.out_shapes} if isinstance(shapes, dict) and \
            not lp.cls.NESTED_ACTIVATIONS else m.out_shapes
    extra = math.prod(shape) if p.cls is layers.Residual else 0
    assert p.cls.FPropMeta(p, shape).flops == flops + extra
    assert p.cls.NumParams(p) == sum(lp.cls.NumParams(lp) for lp in p.body)


@pytest.mark.parametrize('case_id', CASE_IDS)
def test_dtype_reaches_every_variable_and_output(case_id):
    p, shape, _ = _build_case(case_id, F64)
    layer = p.Instantiate()
    assert layer.variables or p.cls.NumParams(p) == 0
    for v in layer.variables:
        assert v.dtype == F64, v.name
    with fprop_context.training(step=2):
        y = layer.FProp(layer.theta, _make_input(p, shape, F64))
    for t in tf.nest.flatten(y):
        assert t.dtype == F64 or t.dtype.is_integer  # ids of a packed activation ride along


# -- 2. Seeded, path-keyed initialisation ---------------------------------------------

@pytest.mark.parametrize('case_id', ['Dense', 'Conv2D-same-stride2', 'Embedding', 'BatchNorm',
                                     'TransformerBlock', 'Sequential-conv'])
def test_same_params_same_weights(case_id):
    p, _, _ = _build_case(case_id)
    a, b = p.Instantiate(), p.Instantiate()
    wa, wb = _flat_theta(a.theta), _flat_theta(b.theta)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)
    for va, vb in zip(a.variables, b.variables):
        assert va.name == vb.name
        np.testing.assert_array_equal(va.numpy(), vb.numpy())


@pytest.mark.parametrize('case_id', ['Dense', 'Conv2D-same-stride2', 'Embedding',
                                     'MultiHeadAttention', 'TransformerBlock',
                                     'Sequential-conv', 'Residual'])
def test_random_seed_changes_every_random_weight(case_id):
    p, _, _ = _build_case(case_id)
    wa = _flat_theta(p.Copy().Set(random_seed=1).Instantiate().theta)
    wb = _flat_theta(p.Copy().Set(random_seed=2).Instantiate().theta)
    wd = _flat_theta(p.Instantiate().theta)  # None -> seed 0
    assert wa.keys() == wb.keys()
    random_keys = [k for k in wa if np.ptp(wa[k]) > 0]  # not a constant (zeros/ones) init
    assert random_keys
    for k in random_keys:
        assert not np.array_equal(wa[k], wb[k]), k
        assert not np.array_equal(wa[k], wd[k]), k
    # Constant initialisers do not depend on the seed.
    for k in set(wa) - set(random_keys):
        np.testing.assert_array_equal(wa[k], wb[k])


def test_weights_depend_on_path_not_creation_order():
    fc0, fc1 = _dense('fc0'), _dense('fc1')
    a = layers.Sequential.Params().Set(name='net', body=[fc0, fc1]).Instantiate()
    b = layers.Sequential.Params().Set(name='net', body=[fc1, fc0]).Instantiate()
    c = layers.Sequential.Params().Set(name='other', body=[fc0, fc1]).Instantiate()
    np.testing.assert_array_equal(a.fc0.theta['w'].numpy(), b.fc0.theta['w'].numpy())
    np.testing.assert_array_equal(a.fc1.theta['w'].numpy(), b.fc1.theta['w'].numpy())
    # Same params, different name / parent: different weights.
    assert not np.array_equal(a.fc0.theta['w'].numpy(), a.fc1.theta['w'].numpy())
    assert not np.array_equal(a.fc0.theta['w'].numpy(), c.fc0.theta['w'].numpy())
    # Identical child params inside one layer still differ by path.
    mha = layers.MultiHeadAttention.Params().Set(name='mha', model_dim=4).Instantiate()
    assert not np.array_equal(mha.query.theta['w'].numpy(), mha.key.theta['w'].numpy())


def test_explicit_child_seed_is_kept_and_unset_one_inherited():
    def net(seed):
        return layers.Sequential.Params().Set(name='net', random_seed=seed, body=[
            _dense('fc0', random_seed=7), _dense('fc1')]).Instantiate()
    a, b = net(1), net(2)
    np.testing.assert_array_equal(a.fc0.theta['w'].numpy(), b.fc0.theta['w'].numpy())
    assert not np.array_equal(a.fc1.theta['w'].numpy(), b.fc1.theta['w'].numpy())
    # fc1 inherits the parent's seed: same as a fc1 whose seed is set to it explicitly.
    c = layers.Sequential.Params().Set(name='net', random_seed=5, body=[
        _dense('fc0', random_seed=7), _dense('fc1', random_seed=1)]).Instantiate()
    np.testing.assert_array_equal(a.fc1.theta['w'].numpy(), c.fc1.theta['w'].numpy())


@pytest.mark.parametrize('case_id', ['Dense', 'TransformerBlock', 'Sequential-conv'])
def test_weights_do_not_depend_on_device(case_id):
    p, _, _ = _build_case(case_id)
    with tf.device('/CPU:0'):
        a = p.Instantiate()
    with tf.device('/CPU:3'):
        b = p.Instantiate()
    assert all(v.device.endswith('CPU:0') for v in a.variables)
    assert all(v.device.endswith('CPU:3') for v in b.variables)
    assert len(a.variables) == len(b.variables) > 0
    for va, vb in zip(a.variables, b.variables):
        np.testing.assert_array_equal(va.numpy(), vb.numpy())


@pytest.mark.parametrize('init,bound', [('glorot_uniform', math.sqrt(6 / (40 + 30))),
                                        ('he_normal', 2 * math.sqrt(2 / 40)),
                                        ('gaussian', 2 * 0.02)])
def test_initialiser_ranges(init, bound):
    w = _dense(i=40, o=30, weight_init=init, dtype=F64).Instantiate().theta['w'].numpy()
    assert np.abs(w).max() <= bound
    assert w.std() > bound / 10


# -- 3. Numerics vs independent references --------------------------------------------

_NP_ACT = {
    'none': lambda x: x,
    'relu': lambda x: np.maximum(x, 0),
    'tanh': np.tanh,
    'sigmoid': lambda x: 1 / (1 + np.exp(-x)),
    'swish': lambda x: x / (1 + np.exp(-x)),
    'gelu': lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
}


@pytest.mark.parametrize('activation', sorted(_NP_ACT))
@pytest.mark.parametrize('shape', [[4, 6], [2, 3, 6]])
def test_dense_matches_numpy(activation, shape):
    layer = _dense(activation=activation, dtype=F64).Instantiate()
    theta = _random_theta(layer)
    x = _make_input(layer.params, shape, F64)
    ref = _NP_ACT[activation](x.numpy() @ theta['w'].numpy() + theta['b'].numpy())
    tol = 1e-7 if activation == 'gelu' else 1e-12  # TF's float64 erf is ~1e-8 accurate
    np.testing.assert_allclose(layer.FProp(theta, x).numpy(), ref, rtol=tol, atol=tol)


def _np_conv2d(x, w, stride, padding):
    n, h, wd, _ = x.shape
    kh, kw, _, cout = w.shape
    sh, sw = stride
    if padding == 'SAME':
        oh, ow = -(-h // sh), -(-wd // sw)
        ph, pw = max((oh - 1) * sh + kh - h, 0), max((ow - 1) * sw + kw - wd, 0)
        x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    else:
        oh, ow = (h - kh) // sh + 1, (wd - kw) // sw + 1
    out = np.zeros((n, oh, ow, cout))
    for i in range(oh):
        for j in range(ow):
            for di in range(kh):
                for dj in range(kw):
                    out[:, i, j, :] += x[:, i * sh + di, j * sw + dj, :] @ w[di, dj]
    return out


@pytest.mark.parametrize('padding', ['SAME', 'VALID'])
@pytest.mark.parametrize('stride', [(1, 1), (2, 1), (2, 3)])
def test_conv2d_matches_numpy_direct_convolution(padding, stride):
    layer = layers.Conv2D.Params().Set(name='conv', filter_shape=(3, 2, 2, 3),
                                       filter_stride=stride, padding=padding,
                                       activation='relu', dtype=F64).Instantiate()
    theta = _random_theta(layer)
    x = _make_input(layer.params, [2, 6, 5, 2], F64)
    ref = _np_conv2d(x.numpy(), theta['w'].numpy(), stride, padding) + theta['b'].numpy()
    np.testing.assert_allclose(layer.FProp(theta, x).numpy(), np.maximum(ref, 0),
                               rtol=1e-12, atol=1e-12)


def test_pooling_flatten_gap_match_numpy():
    x = _make_input(_dense(), [2, 4, 6, 3], F64).numpy()
    mx = layers.Pooling2D.Params().Set(name='p', padding='VALID').Instantiate()
    ref = x.reshape(2, 2, 2, 3, 2, 3).max(axis=(2, 4))
    np.testing.assert_array_equal(mx(tf.constant(x)).numpy(), ref)
    avg = layers.Pooling2D.Params().Set(name='p', pooling_type='AVG').Instantiate()
    np.testing.assert_allclose(avg(tf.constant(x)).numpy(),
                               x.reshape(2, 2, 2, 3, 2, 3).mean(axis=(2, 4)), rtol=1e-12)
    gap = layers.GlobalAvgPool.Params().Set(name='g').Instantiate()
    np.testing.assert_allclose(gap(tf.constant(x)).numpy(), x.mean(axis=(1, 2)), rtol=1e-12)
    flat = layers.Flatten.Params().Set(name='f').Instantiate()
    np.testing.assert_array_equal(flat(tf.constant(x)).numpy(), x.reshape(2, -1))


def _np_bn(x, mean, var, gamma, beta, eps):
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def test_batch_norm_training_moving_stats_and_eval():
    decay, eps = 0.9, 1e-3
    layer = layers.BatchNorm.Params().Set(name='bn', dim=3, decay=decay, epsilon=eps,
                                          dtype=F64).Instantiate()
    theta = _random_theta(layer)
    g, b = theta['gamma'].numpy(), theta['beta'].numpy()
    x = _make_input(layer.params, [5, 2, 3], F64).numpy() * 2 + 1
    mean, var = x.mean(axis=(0, 1)), x.var(axis=(0, 1))  # biased variance
    old_mean, old_var = layer.moving_mean.numpy(), layer.moving_variance.numpy()
    np.testing.assert_array_equal(old_mean, 0)
    np.testing.assert_array_equal(old_var, 1)

    with fprop_context.training(step=0):
        y = layer.FProp(theta, tf.constant(x)).numpy()
    np.testing.assert_allclose(y, _np_bn(x, mean, var, g, b, eps), rtol=1e-10, atol=1e-12)
    new_mean = decay * old_mean + (1 - decay) * mean
    new_var = decay * old_var + (1 - decay) * var
    np.testing.assert_allclose(layer.moving_mean.numpy(), new_mean, rtol=1e-12)
    np.testing.assert_allclose(layer.moving_variance.numpy(), new_var, rtol=1e-12)

    x2 = x[:3] - 0.5
    with fprop_context.evaluation():
        y2 = layer.FProp(theta, tf.constant(x2)).numpy()
    np.testing.assert_allclose(y2, _np_bn(x2, new_mean, new_var, g, b, eps), rtol=1e-10,
                               atol=1e-12)
    # Eval leaves the moving statistics alone.
    np.testing.assert_allclose(layer.moving_mean.numpy(), new_mean, rtol=1e-12)


def test_batch_norm_sink_defers_one_full_batch_update():
    layer = layers.BatchNorm.Params().Set(name='bn', dim=2, decay=0.8,
                                          dtype=F64).Instantiate()
    x = _make_input(layer.params, [7, 2], F64).numpy() + 3
    sink = fprop_context.BatchStatsSink()
    with fprop_context.scope(training=True, step=0, batch_stats=sink):
        for part in (x[:2], x[2:7]):
            layer.FProp(layer.theta, tf.constant(part))
    np.testing.assert_array_equal(layer.moving_mean.numpy(), 0)  # recorded, not applied
    (owner, stats), = sink.records.values()
    assert owner is layer and [float(c) for c, _, _ in stats] == [2.0, 5.0]
    discard = fprop_context.BatchStatsSink(discard=True)
    with fprop_context.scope(training=True, step=0, batch_stats=discard):
        layer.FProp(layer.theta, tf.constant(x))
    assert discard.records == {}
    layer.ApplyBatchStatistics(stats)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.2 * x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.8 + 0.2 * x.var(0),
                               rtol=1e-12)


@pytest.mark.parametrize('sizes', [[12], [1, 11], [3, 4, 5], [1, 1, 10], [7, 2, 2, 1]])
def test_combine_moments_equals_whole(sizes):
    x = np.random.default_rng(3).normal(size=[sum(sizes), 3]) * 5 + 100
    parts, start = [], 0
    for n in sizes:
        chunk = x[start:start + n]
        start += n
        parts.append((tf.constant(float(n), F64), tf.constant(chunk.mean(0)),
                      tf.constant(chunk.var(0))))
    count, mean, var = normalization.combine_moments(parts)
    assert float(count) == sum(sizes)
    np.testing.assert_allclose(mean.numpy(), x.mean(0), rtol=1e-13)
    np.testing.assert_allclose(var.numpy(), x.var(0), rtol=1e-10)


def _np_ln(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + eps) * scale + bias


def test_layer_norm_matches_numpy():
    layer = layers.LayerNorm.Params().Set(name='ln', dim=5, epsilon=1e-6,
                                          dtype=F64).Instantiate()
    theta = _random_theta(layer)
    x = _make_input(layer.params, [2, 3, 5], F64).numpy() * 3 + 2
    np.testing.assert_allclose(
        layer.FProp(theta, tf.constant(x)).numpy(),
        _np_ln(x, theta['scale'].numpy(), theta['bias'].numpy(), 1e-6), rtol=1e-10,
        atol=1e-12)


@pytest.mark.parametrize('scale', [False, True])
def test_embedding_lookup(scale):
    layer = layers.Embedding.Params().Set(name='emb', vocab_size=7, embedding_dim=3,
                                          scale_sqrt_depth=scale, dtype=F64).Instantiate()
    table = layer.theta['emb'].numpy()
    ids = np.array([[0, 6, 3], [3, 3, 1]])
    out = layer(tf.constant(ids, tf.int32)).numpy()
    np.testing.assert_allclose(out, table[ids] * (math.sqrt(3) if scale else 1), rtol=1e-15)
    with pytest.raises(ValueError, match=r'emb: Embedding takes integer ids, got'):
        layer(tf.constant(ids, F64))


def _np_mha(x, th, heads, causal):
    b, t, d = x.shape
    hd = d // heads

    def proj(name, y):
        return y @ th[name]['w'] + th[name]['b']

    def split(y):
        return y.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)

    q, k, v = split(proj('query', x)), split(proj('key', x)), split(proj('value', x))
    logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
    if causal:
        logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return proj('post', (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, d))


@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('heads', [1, 2, 4])
def test_attention_matches_numpy(causal, heads):
    layer = layers.MultiHeadAttention.Params().Set(name='mha', model_dim=8, num_heads=heads,
                                                   causal=causal, dtype=F64).Instantiate()
    theta = _random_theta(layer)
    x = _make_input(layer.params, [2, 5, 8], F64)
    np.testing.assert_allclose(layer.FProp(theta, x).numpy(),
                               _np_mha(x.numpy(), _np(theta), heads, causal),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('t', [0, 2, 4])
def test_causal_attention_ignores_the_future(t):
    def run(causal, x):
        layer = layers.MultiHeadAttention.Params().Set(
            name='mha', model_dim=8, num_heads=2, causal=causal, dtype=F64).Instantiate()
        return layer(tf.constant(x)).numpy()

    x = _make_input(_dense(), [2, 6, 8], F64).numpy()
    x2 = x.copy()
    x2[:, t + 1:] += np.random.default_rng(9).normal(size=x2[:, t + 1:].shape)
    y, y2 = run(True, x), run(True, x2)
    np.testing.assert_allclose(y2[:, :t + 1], y[:, :t + 1], rtol=1e-12, atol=1e-12)
    assert not np.allclose(y2[:, t + 1:], y[:, t + 1:])
    # Without the mask the past does see the change (so the check above can fail).
    assert not np.allclose(run(False, x2)[:, :t + 1], run(False, x)[:, :t + 1])


def _np_transformer(x, th, heads, causal):
    h = _np_mha(_np_ln(x, th['atten_ln']['scale'], th['atten_ln']['bias'], 1e-6),
                th['atten'], heads, causal)
    x = x + h
    f = _np_ln(x, th['ffn_ln']['scale'], th['ffn_ln']['bias'], 1e-6)
    f = np.maximum(f @ th['ffn_in']['w'] + th['ffn_in']['b'], 0)
    return x + f @ th['ffn_out']['w'] + th['ffn_out']['b']


@pytest.mark.parametrize('causal', [False, True])
def test_transformer_block_matches_numpy_and_is_residual(causal):
    layer = layers.TransformerBlock.Params().Set(name='tb', model_dim=8, hidden_dim=12,
                                                 num_heads=2, causal=causal,
                                                 dtype=F64).Instantiate()
    theta = _random_theta(layer)
    x = _make_input(layer.params, [2, 4, 8], F64)
    y = layer.FProp(theta, x)
    assert y.shape == x.shape
    np.testing.assert_allclose(y.numpy(), _np_transformer(x.numpy(), _np(theta), 2, causal),
                               rtol=1e-10, atol=1e-12)
    # Zero the last projection of both branches: the block is the identity.
    zero = dict(theta)
    zero['atten'] = dict(theta['atten'])
    zero['atten']['post'] = tf.nest.map_structure(tf.zeros_like, theta['atten']['post'])
    zero['ffn_out'] = tf.nest.map_structure(tf.zeros_like, theta['ffn_out'])
    np.testing.assert_array_equal(layer.FProp(zero, x).numpy(), x.numpy())
    # Zero only the FFN branch: y = x + attention(LN(x)).
    only_atten = dict(theta, ffn_out=zero['ffn_out'])
    th = _np(theta)
    ref = x.numpy() + _np_mha(_np_ln(x.numpy(), th['atten_ln']['scale'],
                                     th['atten_ln']['bias'], 1e-6), th['atten'], 2, causal)
    np.testing.assert_allclose(layer.FProp(only_atten, x).numpy(), ref, rtol=1e-10,
                               atol=1e-12)
