"""Interleaved 1F1B and zero-bubble schedules, executed on real logical-CPU placement.

Whatever the schedule, one step must equal the unpartitioned model's step: loss,
gradients, updated weights (MLP with dropout against K=1, M=1) and, with
BatchNorm (statistics per micro-batch, as in GPipe), the K=1 run with the same M,
moving statistics included.
"""
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tfpipe.pipeline import partition
from tfpipe.tuning.trace import ops_per_device

RECOMPUTE = ['always', 'except_last', 'never']
ZB_SIZES = [(k, m) for k in (2, 4) for m in (2, 4, 5)]
INTERLEAVED_SIZES = [(2, 2, 2), (2, 4, 2), (4, 4, 2), (2, 4, 3)]  # (K, M, v): M a multiple of K


def build(body, num_devices, num_micro_batches, schedule_name, recompute, virtual_stages=1):
    return tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body,
        balance=partition.even_balance(len(body), num_devices * virtual_stages),
        num_micro_batches=num_micro_batches, recompute=recompute, schedule=schedule_name,
        virtual_stages=virtual_stages).Instantiate()


_reference_steps = {}


def reference_step(body_name, body, x, y, num_micro_batches):
    """Loss, gradients and updated weights of the K=1 run of `body` with M micro-batches:
    each computed once per module (tracing is the cost), then compared with many cases."""
    key = (body_name, num_micro_batches)
    if key not in _reference_steps:
        reference = mz.pipeline(body, 1, num_micro_batches)
        loss, grads = mz.sgd_step_forward_backward(reference, x, y, 2)
        _reference_steps[key] = (loss, grads, mz.snapshot(tf.nest.flatten(reference.theta)),
                                 {n: {s: getattr(reference.children[n], s).numpy()
                                      for s in ('moving_mean', 'moving_variance')}
                                  for n in ('bn0', 'bn1') if n in reference.children})
    return _reference_steps[key]


def assert_step_equal(pipe, reference, x, y):
    """`reference`: reference_step's (loss, gradients, updated weights, BN statistics)."""
    want_loss, want_grads, want_weights, _ = reference
    loss, grads = mz.sgd_step_forward_backward(pipe, x, y, 2)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-12)
    weights = tf.nest.flatten(pipe.theta)
    assert len(weights) == len(want_weights)
    for v, w in zip(weights, want_weights):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-5, atol=1e-12)


def cases():
    """Every size of each schedule once, its recompute policy by rotation (not all three:
    that product was 48 traces): each schedule meets every policy at every K, and the two
    zero-bubble schedules, rotated one apart, together meet every (M, policy)."""
    for shift, name in enumerate(('zb_h1', 'zb_h2')):
        for i, (k, m) in enumerate(ZB_SIZES):
            yield name, k, m, 1, RECOMPUTE[(i + (k == 4) + shift) % len(RECOMPUTE)]
    for i, (k, m, v) in enumerate(INTERLEAVED_SIZES):
        yield 'interleaved_1f1b', k, m, v, RECOMPUTE[i % len(RECOMPUTE)]


def test_the_cases_meet_every_policy_at_every_size_axis():
    all_cases = list(cases())
    for name in ('zb_h1', 'zb_h2', 'interleaved_1f1b'):
        assert {c[4] for c in all_cases if c[0] == name} == set(RECOMPUTE)
    for name in ('zb_h1', 'zb_h2'):
        assert {(c[1], c[4]) for c in all_cases if c[0] == name} == {
            (k, r) for k in (2, 4) for r in RECOMPUTE}
    assert {(c[2], c[4]) for c in all_cases if c[0] != 'interleaved_1f1b'} == {
        (m, r) for m in (2, 4, 5) for r in RECOMPUTE}


def deep_mlp_body():
    """mlp_body with two more layers: 8, enough for K=4 devices x v=2 cells each."""
    body = mz.mlp_body()
    extra = [body[2].Copy().Set(name='fc1b'), body[3].Copy().Set(name='fc2b')]
    return body[:4] + extra + body[4:]


@pytest.mark.parametrize('name,k,m,v,recompute', list(cases()))
def test_mlp_with_dropout_equals_unpartitioned(name, k, m, v, recompute):
    body_name = 'deep_mlp' if k * v > 6 else 'mlp'
    body = deep_mlp_body() if body_name == 'deep_mlp' else mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = build(body, k, m, name, recompute, v)
    assert_step_equal(pipe, reference_step(body_name, body, x, y, 1), x, y)


@pytest.mark.parametrize('recompute', ['always', 'never'])
@pytest.mark.parametrize('name,k,m,v', [('zb_h1', 2, 4, 1), ('zb_h2', 4, 5, 1),
                                        ('interleaved_1f1b', 2, 2, 3)])
def test_batch_norm_equals_k1_with_the_same_m(name, k, m, v, recompute):
    body = mz.conv_body(batch_norm=True)

    x, y = mz.inputs_for(body)
    pipe = build(body, k, m, name, recompute, v)
    reference = reference_step('conv_bn', body, x, y, m)
    assert_step_equal(pipe, reference, x, y)
    for n in ('bn0', 'bn1'):
        for stat in ('moving_mean', 'moving_variance'):
            got = getattr(pipe.children[n], stat).numpy()
            want = reference[3][n][stat]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12, err_msg=f'{n} {stat}')


def test_interleaved_cells_sit_on_device_j_mod_k_and_every_device_works():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = build(body, 2, 4, 'interleaved_1f1b', 'always', 3)
    assert [cell.device[-5:] for cell in pipe.cells] == ['CPU:0', 'CPU:1'] * 3
    for cell in pipe.cells:
        for layer in cell.layers:
            assert all(v.device == cell.device for v in layer.VariablesByPath().values())

    @tf.function(autograph=False)
    def step():
        with tfpipe.fprop_context.training(step=1):
            return pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)

    counts = ops_per_device(step.get_concrete_function())
    for device in ('CPU:0', 'CPU:1'):
        assert sum(n for d, n in counts.items() if d.endswith(device)) > 50, counts
    assert not any(d.endswith(('CPU:2', 'CPU:3')) for d in counts), counts


def test_zero_bubble_splits_each_backward_into_input_and_weight_tasks():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = build(body, 2, 2, 'zb_h1', 'always')

    @tf.function(autograph=False)
    def step():
        with tfpipe.fprop_context.training(step=1):
            return pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)

    graph = step.get_concrete_function().graph
    scopes = {op.name.split('/')[2].rsplit('_', 1)[0] for op in graph.get_operations()
              if op.name.startswith('pipe/cell_')}
    assert {'forward', 'backward_input', 'backward_weight'} <= scopes, scopes
    assert 'backward' not in scopes


@pytest.mark.parametrize('overrides, message', [
    (dict(schedule='interleaved_1f1b', virtual_stages=2, num_micro_batches=3),
     'M=3 is not a multiple of 2'),
    (dict(schedule='1f1b', virtual_stages=2), "needs schedule='interleaved_1f1b'"),
    (dict(schedule='interleaved_1f1b', virtual_stages=0), 'virtual_stages=0 must be'),
    (dict(schedule='interleaved_1f1b', virtual_stages=4), 'more cells than layers|cells'),
])
def test_impossible_combinations_are_refused(overrides, message):
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    p = tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body, num_cells=2,
                                            num_micro_batches=2)
    p.Set(**overrides)
    with pytest.raises(ValueError, match=message):
        pipe = p.Instantiate()
        with tfpipe.fprop_context.training(step=1):
            pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)

