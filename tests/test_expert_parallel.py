"""Expert parallelism's all-to-all on the logical CPUs of conftest.py, all members in
one tf.function as a pipeline step builds them."""
import numpy as np
import pytest
import tensorflow as tf

from tfpipe.layers import mixture_of_experts as moe
from tfpipe.layers import moe_gating
from tfpipe.pipeline import expert_parallel as ep

CPUS = [f'/device:CPU:{i}' for i in range(8)]


def _inputs(p, rows=8, cols=3):
    return [tf.constant(np.random.default_rng(i).normal(size=[rows, cols]), tf.float32)
            for i in range(p)]


@pytest.mark.parametrize('p', [2, 4])
def test_all_to_all_moves_chunk_j_to_member_j_and_back(p):
    groups = ep.groups_of(CPUS[:p], p)
    xs = _inputs(p)

    @tf.function(autograph=False)
    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            there = [ep.all_to_all(x, g, f'test{p}/out') for x, g in zip(xs, groups)]
            back = [ep.all_to_all(y, g, f'test{p}/back') for y, g in zip(there, groups)]
            loss = sum(tf.reduce_sum(b * (i + 1.0)) for i, b in enumerate(back))
        return there, back, tape.gradient(loss, xs)

    there, back, grads = step(*xs)
    n = 8 // p
    for i in range(p):  # member i receives chunk i of every member, in member order
        want = np.concatenate([xs[j].numpy()[i * n:(i + 1) * n] for j in range(p)])
        np.testing.assert_array_equal(there[i].numpy(), want)
        np.testing.assert_array_equal(back[i].numpy(), xs[i].numpy())
        np.testing.assert_array_equal(grads[i].numpy(), np.full([8, 3], i + 1.0))


def test_groups_are_consecutive_replicas_and_experts_sum_strided():
    groups = ep.groups_of(CPUS[:4], 2)
    assert [g.devices for g in groups] == [tuple(CPUS[:2])] * 2 + [tuple(CPUS[2:4])] * 2
    assert [g.rank for g in groups] == [0, 1, 0, 1]
    assert ep.expert_data_parallel(4, 2, 1) == [1, 3]
    assert ep.expert_data_parallel(4, 4, 2) == [2]


@pytest.mark.parametrize('p,r,fix', [(3, 4, 'expert_parallel=3 does not divide num_replicas=4'),
                                     (0, 2, 'expert_parallel=0 must be an int >= 1')])
def test_bad_expert_parallel_is_one_line(p, r, fix):
    with pytest.raises(ValueError, match=fix) as info:
        ep.check_expert_parallel(p, r, 'pipe')
    assert '\n' not in str(info.value)
    assert ep.check_expert_parallel(2, 4, 'pipe') == 2


def test_called_eagerly_says_why():
    with pytest.raises(ValueError, match='eagerly'):
        ep.all_to_all(tf.zeros([4, 2]), ep.groups_of(CPUS[:2], 2)[0], 'eager')


# -- Dispatch, identity experts, combine (Megatron's test_token_dispatcher in spirit) ----

@pytest.mark.parametrize('p', [2, 4])
def test_dispatch_identity_experts_combine_is_the_input(p):
    """Each member routes its tokens (top-1, capacity for all), sends the slots to their
    experts' members and back with identity experts, combines with weight 1: its input;
    the backward of an upstream gradient g is g."""
    experts, tokens = 2 * p, 6
    groups = ep.groups_of(CPUS[:p], p)
    xs = _inputs(p, tokens, 3)
    logits = _inputs(p, tokens, experts)
    upstream = _inputs(p, tokens, 3)

    @tf.function(autograph=False)
    def step(xs, logits, upstream):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            outs = []
            for i, g in enumerate(groups):
                with tf.device(CPUS[i]):
                    gating = moe_gating.top_k_gating(logits[i], tf.ones([tokens]), 1,
                                                         capacity=tokens)
                    slots = moe.dispatch(xs[i], gating)  # [E, C, D]
                    shape = [p, experts // p] + slots.shape[1:].as_list()
                    there = ep.all_to_all(tf.reshape(slots, shape), g, f'tok{p}/dispatch')
                    back = tf.reshape(ep.all_to_all(there, g, f'tok{p}/combine'), slots.shape)
                    outs.append(moe.combine(back, gating, weighted=False))
        return outs, tape.gradient(outs, xs, output_gradients=upstream)

    outs, grads = step(xs, logits, upstream)
    for i in range(p):
        np.testing.assert_allclose(outs[i].numpy(), xs[i].numpy(), atol=1e-6)
        np.testing.assert_allclose(grads[i].numpy(), upstream[i].numpy(), atol=1e-6)


# -- The MoE layer with its experts over P members equals P=1 ------------------------------

def _layer_params(p_name='moe', top_k=2):
    return moe.MoEFeedForward.Params().Set(
        name=p_name, model_dim=4, hidden_dim=6, num_experts=4, top_k=top_k,
        capacity_factor=2.0, eval_capacity_factor=2.0, random_seed=3)


@pytest.fixture(scope='module', params=[2, 4], ids=['p2', 'p4'])
def member_and_whole_runs(request):
    """P members of one MoE layer (one expert group) on P logical CPUs, each with its own
    tokens, and the P=1 layer on each member's tokens; one traced step each. Returns P,
    the members, their (outputs, gradients) and the P=1 (outputs, per-member gradients)."""
    p = request.param
    params = _layer_params()
    members = []
    for i, g in enumerate(ep.groups_of(CPUS[:p], p)):
        with ep.building(g), tf.device(CPUS[i]):
            members.append(params.Instantiate())
    whole = params.Instantiate()
    xs = [tf.reshape(x, [1, 5, 4]) for x in _inputs(p, 5, 4)]
    weights = _inputs(p, 5, 4)  # a loss that weighs every output differently

    def member_loss(layer, theta, i):
        with tf.device(CPUS[i]):
            y = layer.FProp(theta, xs[i])
            return y, tf.reduce_sum(y[0] * weights[i])

    @tf.function(autograph=False)
    def spread():
        with tf.GradientTape() as tape:
            thetas = [m.theta for m in members]
            outs, losses = zip(*[member_loss(m, t, i)
                                 for i, (m, t) in enumerate(zip(members, thetas))])
            total = tf.add_n(losses)
        return outs, tape.gradient(total, thetas)

    @tf.function(autograph=False)
    def reference():
        outs, grads = [], []
        for i in range(p):
            with tf.GradientTape() as tape:
                y, loss = member_loss(whole, whole.theta, i)
            outs.append(y)
            grads.append(tape.gradient(loss, whole.theta))
        return outs, grads

    return p, members, spread(), reference()


def test_members_hold_their_slice_of_the_p1_experts(member_and_whole_runs):
    p, members, _, _ = member_and_whole_runs
    whole = _layer_params().Instantiate()
    for i, m in enumerate(members):
        assert m.theta['wi'].shape == [4 // p, 4, 6] and m.theta['bo'].shape == [4 // p, 4]
        np.testing.assert_array_equal(m.theta['wi'].numpy(),
                                      whole.theta['wi'].numpy()[i * 4 // p:(i + 1) * 4 // p])
        np.testing.assert_array_equal(m.theta['router_w'].numpy(),
                                      whole.theta['router_w'].numpy())


def test_outputs_equal_p1(member_and_whole_runs):
    p, _, (outs, _), (want, _) = member_and_whole_runs
    for i in range(p):
        np.testing.assert_allclose(outs[i].numpy(), want[i].numpy(), atol=1e-5)
    assert np.abs(want[0].numpy()).max() > 1e-2


def test_gradients_equal_p1(member_and_whole_runs):
    """The router's gradient is the member's own tokens' (gating stays local); an expert's
    is the sum over every member's tokens routed to it, i.e. the P=1 gradients of all P
    members' tokens, summed, sliced to the member's experts."""
    p, _, (_, grads), (_, want) = member_and_whole_runs
    local = 4 // p
    for i in range(p):
        np.testing.assert_allclose(grads[i]['router_w'].numpy(),
                                   want[i]['router_w'].numpy(), atol=1e-5)
        for name in ('wi', 'bi', 'wo', 'bo'):
            total = sum(w[name].numpy() for w in want)[i * local:(i + 1) * local]
            np.testing.assert_allclose(grads[i][name].numpy(), total, atol=1e-5)
            assert np.abs(total).max() > 1e-3, name


def test_experts_not_divisible_by_p_is_one_line():
    with ep.building(ep.groups_of(CPUS[:4], 4)[0]):
        with pytest.raises(ValueError, match=r'moe: num_experts=6 is not divisible by '
                           r'expert_parallel=4') as info:
            _layer_params().Set(num_experts=6).Instantiate()
    assert '\n' not in str(info.value)
