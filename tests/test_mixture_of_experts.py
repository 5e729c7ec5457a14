"""Mixture of experts: GShard's gating (tfpipe/layers/moe_gating.py) against plain NumPy."""

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.layers import moe_gating

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
