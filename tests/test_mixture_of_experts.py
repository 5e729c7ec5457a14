"""Mixture of experts: GShard's gating (tfpipe/layers/moe_gating.py) and the MoE
feed-forward layer (tfpipe/layers/mixture_of_experts.py), against plain NumPy."""
import math

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import fprop_context, layers
from tfpipe.layers import mixture_of_experts, moe_gating

F64 = tf.float64


# -- A plain one-device NumPy GShard, token by token ----------------------------------

def _softmax(logits):
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def np_gating(logits, nonpadding, top_k, capacity, uniform=None, threshold=0.5):
    """(combine [S, E, C], load-balancing loss, z-loss), one token and one choice at a time:
    every token's first choice in token order, then every token's second."""
    tokens, experts = logits.shape
    gates = _softmax(logits.astype(np.float64))
    first, second = [None] * tokens, [None] * tokens
    for s in range(tokens):
        if not nonpadding[s]:
            continue
        e1 = int(np.argmax(gates[s]))
        if top_k == 1:
            first[s] = (e1, gates[s, e1])
            continue
        rest = gates[s].copy()
        rest[e1] = -1.0
        e2 = int(np.argmax(rest))
        g1, g2 = gates[s, e1], gates[s, e2]
        first[s] = (e1, g1 / (g1 + g2))
        if uniform is None or uniform[s] < g2 / (g1 + g2) / threshold:
            second[s] = (e2, g2 / (g1 + g2))
    combine = np.zeros([tokens, experts, capacity])
    filled = [0] * experts
    for choices in (first, second):
        for s, choice in enumerate(choices):
            if choice is not None and filled[choice[0]] < capacity:
                combine[s, choice[0], filled[choice[0]]] = choice[1]
                filled[choice[0]] += 1
    real = [s for s in range(tokens) if nonpadding[s]]
    mean_gate = [np.mean([gates[s, e] for s in real]) for e in range(experts)]
    top1_share = [np.mean([float(np.argmax(gates[s]) == e) for s in real])
                  for e in range(experts)]
    aux = experts * sum(m * f for m, f in zip(mean_gate, top1_share))
    z = np.mean([np.log(np.sum(np.exp(logits[s].astype(np.float64)))) ** 2 for s in real])
    return combine, aux, z


def np_layer(x, theta, paddings, top_k, capacity):
    """The whole layer, token by token: each token's output is the combine-weighted sum of
    its experts' feed-forwards of it. x [S, D] -> ([S, D], combine weights, aux loss,
    z-loss)."""
    weights, aux, z = np_gating(x @ theta['router_w'], 1 - paddings, top_k, capacity)
    out = np.zeros_like(x)
    for s, e, c in zip(*np.nonzero(weights)):
        hidden = np.maximum(x[s] @ theta['wi'][e] + theta['bi'][e], 0.0)
        out[s] += weights[s, e, c] * (hidden @ theta['wo'][e] + theta['bo'][e])
    return out, weights, aux, z


# -- Golden: hand-checkable gates -------------------------------------------------------

# Token 0 is padding (if it were routed it would take expert 0's first slot); tokens 1-5
# have the gates below, given as logits = log(gates), so softmax returns them.
GATES = np.array([[0.90, 0.05, 0.05],
                  [0.60, 0.30, 0.10],   # e1 = 0, e2 = 1
                  [0.50, 0.20, 0.30],   # e1 = 0, e2 = 2
                  [0.70, 0.10, 0.20],   # e1 = 0 (over capacity), e2 = 2
                  [0.15, 0.80, 0.05],   # e1 = 1, e2 = 0
                  [0.25, 0.15, 0.60]])  # e1 = 2, e2 = 0
NONPADDING = np.array([0, 1, 1, 1, 1, 1])
# Mean gates over the 5 real tokens (0.44, 0.31, 0.25) x top-1 shares (3/5, 1/5, 1/5) x E.
AUX = 3 * (0.44 * 0.6 + 0.31 * 0.2 + 0.25 * 0.2)


def _gating(top_k, capacity, uniform=None, gates=GATES, nonpadding=NONPADDING):
    return moe_gating.top_k_gating(tf.constant(np.log(gates), tf.float32),
                                   tf.constant(nonpadding, tf.float32), top_k, capacity,
                                   None if uniform is None else tf.constant(uniform, tf.float32))


def _slots(gating):
    """{(token, expert, slot): combine weight} of the dispatched slots."""
    dispatch, combine = gating.dispatch.numpy(), gating.combine.numpy()
    assert set(np.unique(dispatch)) <= {0.0, 1.0}
    assert np.all(combine[dispatch == 0] == 0)
    return {tuple(int(i) for i in idx): float(combine[tuple(idx)])
            for idx in np.argwhere(dispatch)}


def test_top2_capacity_golden():
    # C = ceil(0.5 * 2 * 6 / 3) = 2: the padding token counts in S but takes no slot.
    capacity = moe_gating.expert_capacity(0.5, 6, 3, 2)
    assert capacity == 2
    gating = _gating(2, capacity)
    expected = {
        (1, 0, 0): 0.6 / 0.9, (2, 0, 1): 0.5 / 0.8,  # expert 0 full after tokens 1, 2
        (4, 1, 0): 0.8 / 0.95, (5, 2, 0): 0.6 / 0.85,  # the other first choices
        (1, 1, 1): 0.3 / 0.9, (2, 2, 1): 0.3 / 0.8,  # second choices behind them
    }  # dropped: token 3 both (it passes on by the residual), tokens 4, 5 their second
    got = _slots(gating)
    assert got.keys() == expected.keys()
    for key, weight in expected.items():
        assert got[key] == pytest.approx(weight, abs=1e-6), key
    assert float(gating.load_balancing_loss) == pytest.approx(AUX, abs=1e-6)
    np_combine, np_aux, _ = np_gating(np.log(GATES), NONPADDING, 2, capacity)
    np.testing.assert_allclose(gating.combine.numpy(), np_combine, atol=1e-6)
    assert np_aux == pytest.approx(AUX)


def test_top2_random_second_expert_golden():
    # Kept where uniform < g2 / (g1 + g2) / 0.5: token 1 (1/3 -> 0.667) drops its second
    # expert at 0.7, token 2 (3/8 -> 0.75) keeps it at 0.5; with token 1's second expert
    # gone, token 4's second choice (expert 0 is full) is still dropped.
    uniform = [0.0, 0.7, 0.5, 0.0, 0.99, 0.99]
    got = _slots(_gating(2, 2, uniform))
    assert set(got) == {(1, 0, 0), (2, 0, 1), (4, 1, 0), (5, 2, 0), (2, 2, 1)}
    assert got[(1, 0, 0)] == pytest.approx(0.6 / 0.9, abs=1e-6)  # normalised before the draw
    np_combine, _, _ = np_gating(np.log(GATES), NONPADDING, 2, 2, uniform)
    np.testing.assert_allclose(_gating(2, 2, uniform).combine.numpy(), np_combine, atol=1e-6)


def test_top1_capacity_golden():
    # Switch: C = ceil(1.0 * 1 * 6 / 3) = 2; the combine weight is the raw gate.
    capacity = moe_gating.expert_capacity(1.0, 6, 3, 1)
    assert capacity == 2
    gating = _gating(1, capacity)
    expected = {(1, 0, 0): 0.6, (2, 0, 1): 0.5, (4, 1, 0): 0.8, (5, 2, 0): 0.6}  # 3 dropped
    got = _slots(gating)
    assert got.keys() == expected.keys()
    for key, weight in expected.items():
        assert got[key] == pytest.approx(weight, abs=1e-6), key
    # The loss reads the top-1 choices before the capacity drop (Megatron-LM #1513).
    assert float(gating.load_balancing_loss) == pytest.approx(AUX, abs=1e-6)


@pytest.mark.parametrize('top_k', [1, 2])
@pytest.mark.parametrize('capacity', [1, 3, 40])
def test_gating_matches_numpy_on_random_logits(top_k, capacity):
    rng = np.random.default_rng(top_k * 100 + capacity)
    logits = rng.normal(size=[40, 5]) * 2
    nonpadding = (rng.uniform(size=40) > 0.2).astype(np.float64)
    gating = moe_gating.top_k_gating(tf.constant(logits), tf.constant(nonpadding), top_k,
                                     capacity)
    np_combine, np_aux, np_z = np_gating(logits, nonpadding, top_k, capacity)
    np.testing.assert_allclose(gating.combine.numpy(), np_combine, atol=1e-12)
    np.testing.assert_array_equal(gating.dispatch.numpy(), (np_combine > 0).astype(float))
    assert float(gating.load_balancing_loss) == pytest.approx(np_aux, abs=1e-12)
    assert float(gating.z_loss) == pytest.approx(np_z, abs=1e-12)
    # Megatron's bounds: at most C tokens per expert, one token per slot.
    assert gating.dispatch.numpy().sum((0, 2)).max() <= capacity
    assert gating.dispatch.numpy().sum(0).max() <= 1


def test_padding_is_never_routed_or_counted():
    # The same real tokens with and without padding among them: the same slots, the
    # same weights and losses, and no slot for any padding token.
    rng = np.random.default_rng(3)
    logits = rng.normal(size=[12, 4]) * 3
    pad = np.array([1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 1])
    padded = moe_gating.top_k_gating(tf.constant(logits), tf.constant(1.0 - pad), 2, 3)
    real = np.flatnonzero(pad == 0)
    alone = moe_gating.top_k_gating(tf.constant(logits[real]), tf.ones([len(real)], F64), 2, 3)
    assert np.all(padded.dispatch.numpy()[pad == 1] == 0)
    np.testing.assert_array_equal(padded.combine.numpy()[real], alone.combine.numpy())
    assert float(padded.load_balancing_loss) == pytest.approx(float(alone.load_balancing_loss))
    assert float(padded.z_loss) == pytest.approx(float(alone.z_loss))


# -- Dispatch and combine round trip (Megatron's test_token_dispatcher.py) -------------

@pytest.mark.parametrize('top_k', [1, 2])
def test_identity_experts_return_the_input_and_its_gradient(top_k):
    rng = np.random.default_rng(top_k)
    tokens, experts = 16, 4
    x = tf.constant(rng.normal(size=[tokens, 6]), F64)
    gating = moe_gating.top_k_gating(tf.constant(rng.normal(size=[tokens, experts])),
                                     tf.ones([tokens], F64), top_k, capacity=tokens)
    # Top-2 weights are normalised (g1 + g2 = 1); top-1 routes with probability 1.
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = mixture_of_experts.combine(mixture_of_experts.dispatch(x, gating), gating,
                                       weighted=top_k == 2)
    np.testing.assert_allclose(y.numpy(), x.numpy(), atol=1e-12)
    upstream = x * 3.0
    np.testing.assert_allclose(tape.gradient(y, x, output_gradients=upstream).numpy(),
                               upstream.numpy(), atol=1e-12)


# -- The layer --------------------------------------------------------------------------

def _moe(**kw):
    return layers.MoEFeedForward.Params().Set(name='moe', model_dim=6, hidden_dim=5,
                                              num_experts=4, **kw)


def _random_theta(layer, seed=0):
    rng = np.random.default_rng(seed)
    return {k: tf.constant(rng.normal(scale=0.7, size=v.shape.as_list()), v.dtype)
            for k, v in layer.theta.items()}


def _run(layer, theta, x, paddings=None, training=True):
    """(outputs, {loss name: (value, weight)}, the sink) of one call with an aux-loss
    sink (its statistics, weight None, are not in the dict)."""
    sink = fprop_context.AuxLossSink()
    scope = fprop_context.scope(training=training, step=1, aux_losses=sink)
    with scope:
        y = layer.FProp(theta, x, paddings)
    return y, {name: (value, weight) for _, name, value, weight in sink.records
               if weight is not None}, sink


@pytest.mark.parametrize('top_k,training', [(2, True), (2, False), (1, True)])
def test_layer_matches_numpy(top_k, training):
    # Training capacity 0.5 drops tokens; the eval factor 4 fits them all: the context
    # picks which one applies.
    layer = _moe(top_k=top_k, capacity_factor=0.5, eval_capacity_factor=4.0,
                 z_loss_weight=1e-3, dtype=F64).Instantiate()
    theta = _random_theta(layer)
    rng = np.random.default_rng(7)
    x = rng.normal(size=[2, 5, 6])
    paddings = np.zeros([2, 5])
    paddings[1, 3:] = 1
    y, losses, sink = _run(layer, theta, tf.constant(x), tf.constant(paddings), training)
    assert y.shape == x.shape and y.dtype == F64  # what a block's residual adds to
    capacity = math.ceil((0.5 if training else 4.0) * top_k * 10 / 4)
    np_theta = {k: v.numpy() for k, v in theta.items()}
    want, weights, aux, z = np_layer(x.reshape(10, 6), np_theta, paddings.reshape(10), top_k,
                                     capacity)
    np.testing.assert_allclose(y.numpy().reshape(10, 6), want, atol=1e-10)
    assert float(losses['load_balancing_loss'][0]) == pytest.approx(aux, abs=1e-10)
    assert float(losses['z_loss'][0]) == pytest.approx(z, abs=1e-10)
    assert float(sink.total()) == pytest.approx(0.01 * aux + 1e-3 * z, abs=1e-10)
    assert np.all(y.numpy()[1, 3:] == 0)  # padding: no expert, zeros
    # Training has 4 x C < top_k x 8 slots for the 8 real tokens: some choices dropped.
    assert (np.count_nonzero(weights) < top_k * 8) == training
    # The statistics: the share of the 8 x top_k choices dropped, each expert's share
    # of the choices before the drop (at least what it kept).
    stats = sink.statistics()
    assert float(stats['dropped_fraction/moe']) == pytest.approx(
        1 - np.count_nonzero(weights) / (top_k * 8), abs=1e-12)
    load = stats['expert_load/moe'].numpy()
    assert load.shape == (4,) and load.sum() == pytest.approx(1.0)
    kept = np.count_nonzero(weights.reshape(10, 4, -1), axis=(0, 2))
    assert np.all(load * top_k * 8 >= kept - 1e-9)
    assert sorted(sink.metrics()) == sorted(['aux_loss', 'dropped_fraction',
                                             'load_balancing_loss', 'z_loss'])


def test_z_loss_is_recorded_only_with_a_weight():
    layer = _moe().Instantiate()
    _, losses, sink = _run(layer, layer.theta, tf.random.normal([2, 3, 6]))
    assert set(losses) == {'load_balancing_loss'}
    assert float(sink.total()) == pytest.approx(0.01 * float(losses['load_balancing_loss'][0]))


def test_router_runs_in_float32_under_bfloat16():
    layer = _moe(z_loss_weight=1e-3).Instantiate()
    bf16 = {k: tf.cast(v, tf.bfloat16) for k, v in _random_theta(layer, 1).items()}
    x = tf.cast(tf.random.stateless_normal([4, 8, 6], [1, 2]), tf.bfloat16)
    y, losses, _ = _run(layer, bf16, x)
    assert y.dtype == tf.bfloat16
    # The gating of the bfloat16 values, done in float32: a bfloat16 softmax misses these
    # by about 1e-2.
    x64 = tf.cast(x, F64).numpy().reshape(32, 6)
    _, aux, z = np_gating(x64 @ tf.cast(bf16['router_w'], F64).numpy(), np.ones(32), 2, 16)
    for name, want in (('load_balancing_loss', aux), ('z_loss', z)):
        value = losses[name][0]
        assert value.dtype == tf.float32
        assert float(value) == pytest.approx(want, rel=1e-5)


def test_gradients_reach_router_and_experts():
    layer = _moe(capacity_factor=0.5).Instantiate()
    x = tf.random.stateless_normal([2, 6, 6], [3, 4])
    with tf.GradientTape() as tape:
        y, _, sink = _run(layer, layer.theta, x)
        loss = tf.reduce_sum(y ** 2) + sink.total()
    grads = tape.gradient(loss, layer.theta)
    for name, grad in grads.items():
        assert grad is not None and np.any(grad.numpy() != 0), name


@pytest.mark.parametrize('override,words', [
    (dict(top_k=2, num_experts=1), ['top_k=2', 'num_experts=1', 'top_k <= num_experts']),
    (dict(top_k=3, num_experts=8), ['top_k=3', 'top_k=2', 'or 1']),
    (dict(capacity_factor=0.0), ['capacity_factor=0.0', 'must be > 0']),
    (dict(capacity_factor=-1.0), ['capacity_factor=-1.0', 'must be > 0']),
    (dict(eval_capacity_factor=0), ['eval_capacity_factor=0', 'must be > 0']),
    (dict(num_experts=0), ['num_experts=0', '>= 1']),
    (dict(second_expert_policy='sampling'), ["'sampling'", "'random'"]),
])
def test_bad_params_fail_at_instantiate(override, words):
    p = _moe()
    p.Set(**override)
    with pytest.raises(ValueError) as err:
        p.Instantiate()
    message = str(err.value)
    assert '\n' not in message
    for word in words:
        assert word in message, message


def test_random_policy_needs_the_step_and_draws_per_step():
    layer = _moe(second_expert_policy='random').Instantiate()
    x = tf.random.stateless_normal([4, 8, 6], [5, 6])
    with fprop_context.scope(training=True, step=None), pytest.raises(ValueError, match='step'):
        layer(x)
    outputs = []
    for step in (1, 1, 2):
        with fprop_context.training(step=step):
            outputs.append(layer(x).numpy())
    np.testing.assert_array_equal(outputs[0], outputs[1])  # a recompute draws the same
    assert np.any(outputs[0] != outputs[2])
    # Evaluation keeps every second expert: the 'all' layer of the same weights.
    every = _moe().Instantiate()
    with fprop_context.evaluation():
        np.testing.assert_array_equal(layer(x).numpy(), every(x).numpy())


def test_each_expert_starts_at_the_scale_of_its_own_dense():
    # Glorot over [E, D, H] would read E as a receptive field: sqrt(E) = 2x too small.
    layer = layers.MoEFeedForward.Params().Set(name='moe', model_dim=64, hidden_dim=48,
                                               num_experts=4, dtype=F64).Instantiate()
    bound = math.sqrt(6 / (64 + 48))  # a Dense(64 -> 48)'s glorot_uniform
    for name in ('wi', 'wo'):
        for expert in layer.theta[name].numpy():
            assert np.abs(expert).max() <= bound
            assert expert.std() == pytest.approx(bound / math.sqrt(3), rel=0.05)


def test_random_policy_draws_per_token_of_the_mini_batch():
    # Capacity for every choice, so only the draw could tell micro-batches apart: two
    # micro-batches of 2 (example offsets 0 and 2) route as the mini-batch of 4 does.
    layer = _moe(second_expert_policy='random', capacity_factor=8.0).Instantiate()
    x = tf.random.stateless_normal([4, 8, 6], [7, 8])
    with fprop_context.training(step=3):
        whole = layer(x).numpy()
    parts = []
    for offset in (0, 2):
        with fprop_context.scope(training=True, step=3, example_offset=offset):
            parts.append(layer(x[offset:offset + 2]).numpy())
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-6)


def test_training_input_without_a_static_batch_is_refused():
    layer = _moe().Instantiate()

    def train(x):
        with fprop_context.training(step=1):
            return layer(x)

    with pytest.raises(ValueError, match='training and expert parallelism need a static'):
        tf.function(train, autograph=False).get_concrete_function(
            tf.TensorSpec([None, 4, 6], tf.float32))


def test_evaluation_of_any_shape_equals_the_static_call():
    """A serving signature's [None, None, D]: the capacity is sized at run time as the
    static call sizes it (here 0.25 drops choices), padding and statistics alike."""
    layer = _moe(eval_capacity_factor=0.25).Instantiate()
    theta = _random_theta(layer)
    x = tf.random.stateless_normal([3, 5, 6], [4, 2])
    paddings = tf.constant([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]], tf.float32)
    want, want_losses, want_sink = _run(layer, theta, x, paddings, training=False)

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None, None, 6]),
                                                   tf.TensorSpec([None, None])])
    def dynamic(x, paddings):
        y, losses, sink = _run(layer, theta, x, paddings, training=False)
        stats = {name: value for _, name, value, weight in sink.records if weight is None}
        return y, {k: v for k, (v, _) in losses.items()}, stats

    got, got_losses, got_stats = dynamic(x, paddings)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    assert set(got_losses) == set(want_losses)
    for name, (value, _) in want_losses.items():
        np.testing.assert_allclose(got_losses[name].numpy(), value.numpy(), rtol=1e-6)
    want_stats = {name: value for _, name, value, weight in want_sink.records
                  if weight is None}
    assert want_stats['dropped_fraction'].numpy() > 0  # the capacity binds
    for name, value in want_stats.items():
        np.testing.assert_allclose(got_stats[name].numpy(), value.numpy(), rtol=1e-6)


def test_in_a_bfloat16_sequence_traced_like_a_cell():
    # As a pipeline cell runs it: apply_layer casts weights and inputs to bfloat16, the
    # forward is traced without AutoGraph, and the recorded losses join the loss inside
    # the same trace.
    seq = layers.Sequential.Params().Set(name='seq', body=[
        _moe(fprop_dtype=tf.bfloat16, z_loss_weight=1e-3)]).Instantiate()
    x = tf.random.stateless_normal([2, 8, 6], [9, 9])

    @tf.function(autograph=False)
    def step(theta):
        sink = fprop_context.AuxLossSink()
        with tf.GradientTape() as tape, fprop_context.scope(training=True, step=1,
                                                            aux_losses=sink):
            tape.watch(theta)
            y = seq.FProp(theta, x)
            aux = sink.total()
            loss = tf.reduce_mean(tf.cast(y, tf.float32) ** 2) + aux
        return y, aux, tape.gradient(loss, theta)

    y, aux, grads = step(seq.theta)
    assert y.dtype == tf.bfloat16 and aux.dtype == tf.float32 and float(aux) > 0
    for name, grad in grads['moe'].items():
        assert grad.dtype == tf.float32 and np.all(np.isfinite(grad.numpy())), name
    assert np.any(grads['moe']['router_w'].numpy() != 0)
