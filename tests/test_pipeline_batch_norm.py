"""BatchNorm under micro-batching (GPipe's design).

Training normalises each micro-batch with its own statistics, so M changes the
outputs: a pipelined run equals the K=1 run with the same M, whatever K and the
recompute policy. The moving statistics are updated once per mini-batch, from
all micro-batches combined, so they equal a full-batch BN update on the inputs
that BN layer saw. Eval uses the moving statistics. The training checks run on
both executors, cell functions (the default) and the unrolled tasks, alternating over
the grid of K, M and policy.
"""
import numpy as np
import pytest
import tensorflow as tf

from tests import model_zoo as mz
from tfpipe import fprop_context
from tfpipe.fprop_context import BatchStatsSink
from tfpipe.pipeline import microbatch

STEP = 5
DECAY = 0.9  # model_zoo's BN decay
EXECUTORS = pytest.mark.parametrize('cell_functions', [True, False],
                                    ids=['functions', 'unrolled'])


def bn_body():
    return mz.conv_body(batch_norm=True)


def run_step(num_cells, num_micro_batches, recompute, cell_functions=True):
    body = bn_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, num_cells, num_micro_batches, recompute,
                       cell_functions=cell_functions)
    out, loss, grads = mz.sgd_step_tape(pipe, x, y, STEP)
    stats = {n: (pipe.children[n].moving_mean.numpy(), pipe.children[n].moving_variance.numpy())
             for n in ('bn0', 'bn1')}
    return out, loss, grads, stats


_expected_moving_stats = {}


def expected_moving_stats(num_micro_batches):
    """Full-batch BN update on the inputs each BN layer saw, built without the pipeline
    (once per M: many cases compare with it)."""
    if num_micro_batches not in _expected_moving_stats:
        _expected_moving_stats[num_micro_batches] = _moving_stats_without_pipeline(
            num_micro_batches)
    return _expected_moving_stats[num_micro_batches]


def _moving_stats_without_pipeline(num_micro_batches):
    body = bn_body()
    x, _ = mz.inputs_for(body)
    names = [p.name for p in body]
    expected = {}
    for bn in ('bn0', 'bn1'):
        prefix = mz.sequential(body[:names.index(bn)])
        seen = []
        for mb, offset in zip(microbatch.split(x, num_micro_batches),
                              microbatch.offsets(microbatch.micro_batch_sizes(
                                  x.shape[0], num_micro_batches))):
            with fprop_context.scope(training=True, step=STEP, example_offset=offset,
                                     batch_stats=BatchStatsSink(discard=True)):
                seen.append(prefix.FProp(prefix.theta, mb).numpy())
        seen = np.concatenate(seen).reshape(-1, seen[0].shape[-1])
        expected[bn] = (DECAY * 0 + (1 - DECAY) * seen.mean(0),
                        DECAY * 1 + (1 - DECAY) * seen.var(0))
    return expected


_same_m_reference = {}


def same_m_reference(num_micro_batches):
    """The K=1 run with the same M (cell functions), once per M."""
    if num_micro_batches not in _same_m_reference:
        _same_m_reference[num_micro_batches] = run_step(1, num_micro_batches, 'never')
    return _same_m_reference[num_micro_batches]


SIZES = [(1, 'never'), (2, 'always'), (4, 'always'), (4, 'except_last'), (4, 'never')]


def pipeline_cases() -> list:
    """Every (K, policy) at every M, on one executor each, alternating (not both: 40 traces
    became 20): each (K, policy) and each M meets both executors."""
    return [pytest.param(k, m, policy, (i + j) % 2 == 0,
                         id=f'{k}-{m}-{policy}-' + ('functions' if (i + j) % 2 == 0
                                                   else 'unrolled'))
            for i, (k, policy) in enumerate(SIZES) for j, m in enumerate((1, 2, 3, 4))]


def test_the_cases_meet_both_executors_at_every_size_and_m():
    cases = [c.values for c in pipeline_cases()]
    assert {(k, p, f) for k, _, p, f in cases} == {(k, p, f) for k, p in SIZES
                                                   for f in (True, False)}
    assert {(m, f) for _, m, _, f in cases} == {(m, f) for m in (1, 2, 3, 4)
                                                for f in (True, False)}


@pytest.mark.parametrize('num_cells,num_micro_batches,recompute,cell_functions',
                         pipeline_cases())
def test_batch_norm_pipeline(num_cells, num_micro_batches, recompute, cell_functions):
    ref_out, ref_loss, ref_grads, _ = same_m_reference(num_micro_batches)
    out, loss, grads, stats = run_step(num_cells, num_micro_batches, recompute, cell_functions)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-12)
    for name, (mean, var) in expected_moving_stats(num_micro_batches).items():
        np.testing.assert_allclose(stats[name][0], mean, rtol=1e-5, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(stats[name][1], var, rtol=1e-5, atol=1e-12, err_msg=name)


def test_micro_batching_changes_training_outputs_but_first_bn_stats_do_not():
    out1, _, _, stats1 = run_step(2, 1, 'always')
    out4, _, _, stats4 = run_step(2, 4, 'always')
    assert np.abs(out1 - out4).max() > 1e-6  # per-micro-batch statistics differ
    # bn0 sees the raw conv outputs, identical for any M: same full-batch update.
    np.testing.assert_allclose(stats1['bn0'][0], stats4['bn0'][0], rtol=1e-10)
    np.testing.assert_allclose(stats1['bn0'][1], stats4['bn0'][1], rtol=1e-10)


def test_eval_uses_moving_statistics_and_ignores_micro_batching():
    body = bn_body()
    x, y = mz.inputs_for(body)
    pipe4 = mz.pipeline(body, 4, 4)
    mz.sgd_step_forward_backward(pipe4, x, y, STEP)  # moves the statistics off their init
    seq = mz.sequential(body)
    for name, layer in seq.children.items():
        for v_seq, v_pipe in zip(layer.variables, pipe4.children[name].variables):
            v_seq.assign(v_pipe)
    with fprop_context.evaluation():
        before = [v.numpy() for v in pipe4.non_trainable_variables]
        pipelined = pipe4.FProp(pipe4.theta, x).numpy()
        plain = seq.FProp(seq.theta, x).numpy()
        after = [v.numpy() for v in pipe4.non_trainable_variables]
    np.testing.assert_allclose(pipelined, plain, rtol=1e-10)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)  # eval never updates statistics


@EXECUTORS
@pytest.mark.parametrize('schedule', ['fill_drain', '1f1b'])
def test_batch_norm_through_forward_backward(schedule, cell_functions):
    """The trainer's entry point: same gradients and statistics as FProp under a tape."""
    _, ref_loss, ref_grads, _ = same_m_reference(3)
    body = bn_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, 4, 3, 'except_last', schedule=schedule,
                       cell_functions=cell_functions)
    loss, grads = mz.sgd_step_forward_backward(pipe, x, y, STEP)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-12)
    for name, (mean, var) in expected_moving_stats(3).items():
        np.testing.assert_allclose(pipe.children[name].moving_mean.numpy(), mean, rtol=1e-5)
        np.testing.assert_allclose(pipe.children[name].moving_variance.numpy(), var, rtol=1e-5)


def test_low_precision_statistics_stay_finite():
    """Counts and moments travel in float32: a float16 count of 65536 would be inf."""
    from tfpipe import layers
    bn = layers.BatchNorm.Params().Set(name='bn', dim=2, dtype=tf.float16).Instantiate()
    x = tf.ones([16, 64, 64, 2], tf.float16)
    with fprop_context.training(step=0):
        bn(x)
    assert np.isfinite(bn.moving_mean.numpy()).all()
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.01, rtol=1e-2)
