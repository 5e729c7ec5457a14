"""Auxiliary losses through the pipeline: a step's loss, auxiliary losses, gradients
and SGD-updated weights equal the plain body run on each micro-batch (weighted b_m /
N, tfpipe/pipeline/aux_losses.py) within 1e-5 in float64, over K in {1, 2} x M in
{1, 2, 3} x recompute {always, never} with both executors met by every pair of those
(a covering design, as the core grids), 1F1B, a zero-bubble schedule, R=2, T=2 and
FProp under a tape (P=2: tests/test_expert_parallel_pipeline.py). Two MoE layers (one
per cell at K=2, capacity that drops tokens, z-loss, the 'random' second-expert
policy) on 8 examples (M=3: 3, 3, 2)."""
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tfpipe import fprop_context, layers
from tfpipe.base_layer import flatten_by_path
from tfpipe.layers.mixture_of_experts import MoEFeedForward
from tfpipe.pipeline import microbatch

F64 = tf.float64
STEP, LR, BATCH = 3, 0.1, 8
BALANCE = {1: [5], 2: [2, 3]}


def body():
    def moe(name, **kw):
        return MoEFeedForward.Params().Set(name=name, model_dim=8, hidden_dim=6, num_experts=4,
                                           capacity_factor=1.0, aux_loss_weight=0.5,
                                           dtype=F64, **kw)
    return [layers.Dense.Params().Set(name='fc0', input_dim=6, output_dim=8, activation='tanh',
                                      dtype=F64),
            moe('moe_a', z_loss_weight=0.1),
            layers.Dense.Params().Set(name='fc1', input_dim=8, output_dim=8, activation='tanh',
                                      dtype=F64),
            moe('moe_b', second_expert_policy='random'),
            layers.Dense.Params().Set(name='fc2', input_dim=8, output_dim=5, dtype=F64)]


def pipeline(k, m, **kw):
    return tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body(), balance=BALANCE[k], num_micro_batches=m, **kw).Instantiate()


def data():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=[BATCH, 6]), F64),
            tf.constant(rng.integers(0, 5, size=[BATCH]), tf.int32))


_references = {}


def reference(pipe, count, training=True):
    """The plain body on each of `count` micro-batches, eagerly: (main loss, aux metrics,
    gradients of main + weighted aux by path, updated weights by path). Computed once per
    (count, training): every pipeline starts from the same weights (seeded by path),
    which is checked."""
    weights = {q: v.numpy() for q, v in pipe.VariablesByPath().items()}
    key = (count, training)
    if key not in _references:
        _references[key] = (weights, _reference(pipe, count, training))
    initial, result = _references[key]
    assert sorted(initial) == sorted(weights)
    for q in initial:
        np.testing.assert_array_equal(weights[q], initial[q], err_msg=q)
    return result


def _reference(pipe, count, training):
    x, y = data()
    body_layers = [layer for cell in pipe.cells for layer in cell.layers]
    sizes = microbatch.micro_batch_sizes(BATCH, count)
    theta = pipe.theta
    main, total, parts = 0.0, 0.0, {}
    with tf.GradientTape() as tape:
        for start, size in zip(microbatch.offsets(sizes), sizes):
            h = x[start:start + size]
            sink = fprop_context.AuxLossSink()
            with fprop_context.scope(training=training, step=STEP, example_offset=start,
                                     aux_losses=sink):
                for layer in body_layers:
                    h = layer.FProp(theta[layer.params.name], h)
            main += tf.reduce_sum(mz.loss_fn(h, y[start:start + size])) / BATCH
            total += sink.total() * size / BATCH
            for name, value in {**sink.metrics(), **sink.statistics()}.items():
                parts[name] = parts.get(name, 0.0) + value * size / BATCH
        objective = main + total
    grads = flatten_by_path(tape.gradient(objective, theta), 'pipe')
    weights = {q: v.numpy() for q, v in pipe.VariablesByPath().items()}
    return (main.numpy(), {n: v.numpy() for n, v in parts.items()},
            {q: g.numpy() for q, g in grads.items()},
            {q: w - LR * grads[q].numpy() for q, w in weights.items()})


def forward_backward(pipe):
    """One SGD step through ForwardBackward (every replica's theta when R > 1):
    (loss, the sink's metrics, replica 0's gradients and updated weights by path)."""
    x, y = data()
    replicated = pipe.num_replicas > 1
    theta = pipe.ReplicaThetas() if replicated else pipe.theta

    @tf.function(autograph=False)
    def run():
        sink = fprop_context.AuxLossSink()
        with fprop_context.training(step=STEP), fprop_context.scope(aux_losses=sink):
            loss, grads = pipe.ForwardBackward(theta, x, mz.loss_fn, y)
        for t, g in zip(theta if replicated else [theta], grads if replicated else [grads]):
            for v, d in zip(tf.nest.flatten(t), tf.nest.flatten(g)):
                v.assign_sub(LR * d)
        return loss, {**sink.metrics(), **sink.statistics()}, grads[0] if replicated else grads
    return _results(pipe, *run())


def fprop_under_tape(pipe):
    """The same step with FProp under a GradientTape, sink.total() added to the loss."""
    x, y = data()

    @tf.function(autograph=False)
    def run():
        sink = fprop_context.AuxLossSink()
        with tf.GradientTape() as tape, fprop_context.training(step=STEP), \
                fprop_context.scope(aux_losses=sink):
            loss = tf.reduce_mean(mz.loss_fn(pipe.FProp(pipe.theta, x), y))
            objective = loss + sink.total()
        grads = tape.gradient(objective, pipe.theta)
        for v, d in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(LR * d)
        return loss, {**sink.metrics(), **sink.statistics()}, grads
    return _results(pipe, *run())


def _results(pipe, loss, metrics, grads):
    return (loss.numpy(), {n: v.numpy() for n, v in metrics.items()},
            {q: g.numpy() for q, g in flatten_by_path(grads, 'pipe').items()},
            {q: v.numpy() for q, v in pipe.VariablesByPath().items()})


def check(pipe, count, step_fn=forward_backward):
    want = reference(pipe, count)
    got = step_fn(pipe)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert sorted(got[1]) == sorted(want[1])
    assert {'aux_loss', 'load_balancing_loss', 'z_loss', 'dropped_fraction',
            'expert_load/pipe/moe_b'} <= set(want[1])
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-5, err_msg=name)
    for what, g, w in (('grads', got[2], want[2]), ('weights', got[3], want[3])):
        assert sorted(g) == sorted(w)
        for path in w:
            np.testing.assert_allclose(g[path], w[path], rtol=1e-5, atol=1e-12,
                                       err_msg=f'{what} {path}')
    # The routers train on the auxiliary losses (their only gradient besides the combine).
    assert np.abs(want[2]['pipe/moe_a/router_w']).max() > 1e-4


# K x M x recompute, the executor rotated so that every pair of (K, M, recompute) meets
# both executors (12 traces instead of 24; checked below).
GRID = [(k, m, recompute, (k + m + (recompute == 'never')) % 2 == 0)
        for k in (1, 2) for m in (1, 2, 3) for recompute in ('always', 'never')]


def test_grid_pairs_meet_both_executors():
    for i, j in ((0, 1), (0, 2), (1, 2)):
        pairs = {(g[i], g[j], g[3]) for g in GRID}
        assert len(pairs) == 2 * len({(g[i], g[j]) for g in GRID})


@pytest.mark.parametrize('k,m,recompute,cell_functions', GRID)
def test_step_equals_body_per_micro_batch(k, m, recompute, cell_functions):
    check(pipeline(k, m, recompute=recompute, cell_functions=cell_functions), m)


@pytest.mark.parametrize('schedule,recompute', [('1f1b', 'except_last'), ('zb_h1', 'always'),
                                                ('zb_h1', 'never')])
def test_schedules(schedule, recompute):
    """1F1B, and zero bubble's split backward: each layer's weights differentiated from
    its output and its own auxiliary losses (recomputed or kept)."""
    check(pipeline(2, 3, schedule=schedule, recompute=recompute), 3)


def test_replicas():
    """R=2 replicas of M=2 each: 4 micro-batches of the global batch, weighted b_m / N."""
    check(pipeline(2, 2, num_replicas=2), 4)


def test_tensor_parallel():
    """T=2 (the layers run on each cell's home device; the cells' devices double)."""
    check(pipeline(2, 2, tensor_parallel=2), 2)


@pytest.mark.parametrize('recompute', ['always', 'never'])
def test_fprop_under_a_tape(recompute):
    """The caller's sink gets the summed losses as outputs of the pipeline's op: their
    gradients reach each cell's backward."""
    check(pipeline(2, 3, recompute=recompute), 3, fprop_under_tape)


def test_evaluation_reports_without_gradients():
    """FProp in evaluation records the summed losses of the body run in evaluation (the
    second MoE layer's input differs: the first drops nothing at eval capacity)."""
    pipe = pipeline(2, 2)
    x, _ = data()
    sink = fprop_context.AuxLossSink()
    with fprop_context.evaluation(), fprop_context.scope(aux_losses=sink):
        pipe.FProp(pipe.theta, x)
    got = {n: v.numpy() for n, v in {**sink.metrics(), **sink.statistics()}.items()}
    want = reference(pipe, 2, training=False)[1]
    assert not np.isclose(want['aux_loss'], reference(pipe, 2)[1]['aux_loss'])
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
    assert [r[:2] for r in sink.records if r[3] is not None] == [
        ('pipe/moe_a', 'load_balancing_loss'), ('pipe/moe_a', 'z_loss'),
        ('pipe/moe_b', 'load_balancing_loss')]


def test_body_without_aux_losses_records_nothing():
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=[b for b in body() if b.name.startswith('fc')], balance=[1, 2],
        num_micro_batches=2).Instantiate()
    x, y = data()
    sink = fprop_context.AuxLossSink()
    with fprop_context.training(step=STEP), fprop_context.scope(aux_losses=sink):
        loss, _ = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
    assert np.isfinite(loss.numpy())
    assert sink.records == [] and sink.metrics() == {}
