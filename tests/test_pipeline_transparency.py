"""The central property: a pipelined step is the unpartitioned model's step.

For K in {1, 2, 4} cells on distinct logical CPUs, M in {1, 2, 3, 4}
micro-batches of an uneven mini-batch (N=10) and every recompute policy, the
outputs, loss, gradients and weights after one SGD step equal those of the
same body run as a plain `Sequential` under a plain `tf.GradientTape`, which
shares no pipeline code. Models are float64 so that 1e-5 relative is a test of
the mathematics, not of float32 summation order (a float32 case follows).
Every (K, M, policy) triple runs through both entry points, ForwardBackward and
FProp under a tape (72 traced pipelines). The other two axes, the model (MLP with
dropout, conv net) and the executor (cell functions, the default, or the unrolled
tasks, cell_functions=False), are a covering design over that grid, not a product
with it (which was 288 traces and a fifth of the suite's time): for each entry point
the four (model, executor) pairs rotate over the four M values of every (K, policy),
so each entry point meets every (K, policy, model, executor), and since the two entry
points rotate two apart, every (K, M, model, executor) is met by one of them.
"""
import numpy as np
import pytest
import tensorflow as tf

from tests import model_zoo as mz

STEP = 7
MODELS = {'mlp': mz.mlp_body, 'conv': mz.conv_body}
_reference_cache = {}


def reference(model):
    """Outputs, loss, grads and updated weights of the unpartitioned body."""
    if model not in _reference_cache:
        body = MODELS[model]()
        x, y = mz.inputs_for(body)
        seq = mz.sequential(body)
        initial = mz.snapshot(tf.nest.flatten(seq.theta))
        out, loss, grads = mz.sgd_step_tape(seq, x, y, STEP)
        _reference_cache[model] = dict(initial=initial, out=out, loss=loss, grads=grads,
                                       weights=mz.snapshot(tf.nest.flatten(seq.theta)))
    return _reference_cache[model]


def assert_all_close(actual, expected, what):
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-12, err_msg=f'{what}[{i}]')


CELLS = (1, 2, 4)
MICRO_BATCHES = (1, 2, 3, 4)
POLICIES = ('always', 'except_last', 'never')
PAIRS = [(model, cell_functions) for model in MODELS for cell_functions in (True, False)]


def grid(shift: int) -> list:
    """Every (K, M, policy), each with the (model, executor) pair the rotation gives it."""
    cases = []
    for i, k in enumerate(CELLS):
        for j, m in enumerate(MICRO_BATCHES):
            for n, policy in enumerate(POLICIES):
                model, cell_functions = PAIRS[(i + j + n + shift) % len(PAIRS)]
                executor = 'functions' if cell_functions else 'unrolled'
                cases.append(pytest.param(model, k, m, policy, cell_functions,
                                          id=f'{model}-{k}-{m}-{policy}-{executor}'))
    return cases


def test_the_grids_cover_every_pair_of_axes():
    """The covering design's claims (module docstring), checked on the grids themselves."""
    grids = [[c.values for c in grid(0)], [c.values for c in grid(2)]]
    for cases in grids:
        assert {(k, m, p) for _, k, m, p, _ in cases} == {
            (k, m, p) for k in CELLS for m in MICRO_BATCHES for p in POLICIES}
        assert {(k, p, model, f) for model, k, _, p, f in cases} == {
            (k, p, model, f) for k in CELLS for p in POLICIES for model, f in PAIRS}
    assert {(k, m, model, f) for cases in grids for model, k, m, _, f in cases} == {
        (k, m, model, f) for k in CELLS for m in MICRO_BATCHES for model, f in PAIRS}


@pytest.mark.parametrize('model,num_cells,num_micro_batches,recompute,cell_functions', grid(0))
def test_forward_backward_equals_unpartitioned(model, num_cells, num_micro_batches, recompute,
                                               cell_functions):
    ref = reference(model)
    body = MODELS[model]()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, num_cells, num_micro_batches, recompute,
                       cell_functions=cell_functions)
    assert len(set(pipe.devices)) == num_cells
    for cell in pipe.cells:
        for layer in cell.layers:
            assert all(v.device == cell.device for v in layer.trainable_variables)
    assert_all_close(mz.snapshot(tf.nest.flatten(pipe.theta)), ref['initial'], 'initial weights')
    loss, grads = mz.sgd_step_forward_backward(pipe, x, y, STEP)
    np.testing.assert_allclose(loss, ref['loss'], rtol=1e-5)
    assert_all_close(grads, ref['grads'], 'grads')
    assert_all_close(mz.snapshot(tf.nest.flatten(pipe.theta)), ref['weights'], 'updated weights')


@pytest.mark.parametrize('model,num_cells,num_micro_batches,recompute,cell_functions', grid(2))
def test_fprop_under_tape_equals_unpartitioned(model, num_cells, num_micro_batches, recompute,
                                               cell_functions):
    ref = reference(model)
    body = MODELS[model]()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, num_cells, num_micro_batches, recompute,
                       cell_functions=cell_functions)
    out, loss, grads = mz.sgd_step_tape(pipe, x, y, STEP)
    np.testing.assert_allclose(out, ref['out'], rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(loss, ref['loss'], rtol=1e-5)
    assert_all_close(grads, ref['grads'], 'grads')
    assert_all_close(mz.snapshot(tf.nest.flatten(pipe.theta)), ref['weights'], 'updated weights')


@pytest.mark.parametrize('recompute', ['always', 'never'])
def test_float32_pipeline_matches_within_float32_rounding(recompute):
    body = mz.mlp_body(dtype=tf.float32)
    x, y = mz.inputs_for(body, dtype=tf.float32)
    seq = mz.sequential(body)
    _, ref_loss, ref_grads = mz.sgd_step_tape(seq, x, y, STEP)
    pipe = mz.pipeline(body, 4, 3, recompute)
    loss, grads = mz.sgd_step_forward_backward(pipe, x, y, STEP)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_batch_smaller_than_micro_batches_runs_one_example_each():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body, batch=3)
    seq = mz.sequential(body)
    _, ref_loss, ref_grads = mz.sgd_step_tape(seq, x, y, STEP)
    pipe = mz.pipeline(body, 2, 8)
    loss, grads = mz.sgd_step_forward_backward(pipe, x, y, STEP)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_all_close(grads, ref_grads, 'grads')


def test_eager_forward_backward_equals_graph():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    ref = reference('mlp')
    pipe = mz.pipeline(body, 2, 3)
    with mz.fprop_context.training(step=STEP):
        loss, grads = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
    np.testing.assert_allclose(loss.numpy(), ref['loss'], rtol=1e-5)
    assert_all_close([g.numpy() for g in tf.nest.flatten(grads)], ref['grads'], 'grads')
