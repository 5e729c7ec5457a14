"""Dropout under recompute, skips across cells, automatic balance, eval path."""
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tfpipe import fprop_context, layers
from tfpipe.pipeline import costs, partition
from tfpipe.tuning import trace


def test_dropout_recompute_draws_the_forward_mask():
    body = [layers.Dropout.Params().Set(name=f'drop{i}', keep_prob=0.5, dtype=tf.float64)
            for i in range(3)]
    pipe = mz.pipeline(body, 3, 2, 'always')
    x = tf.constant(np.random.default_rng(0).uniform(1, 2, size=[7, 9]))

    @tf.function
    def run():
        with fprop_context.training(step=11):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = pipe.FProp(pipe.theta, x)
                loss = tf.reduce_sum(out)
        return out, tape.gradient(loss, x)

    out, dx = run()
    kept = out.numpy() != 0
    assert 0.05 < kept.mean() < 0.3  # three layers at keep 0.5: about 1/8 kept
    # d out / d x is 8 where every layer kept the unit, else 0: the recomputed
    # masks equal the forward masks exactly.
    np.testing.assert_array_equal(dx.numpy() != 0, kept)
    np.testing.assert_allclose(dx.numpy()[kept], 8.0)


@pytest.mark.parametrize('cell_functions', [True, False], ids=['functions', 'unrolled'])
def test_fprop_under_a_tape_takes_the_step_as_a_variable(cell_functions):
    """The trainer's kind of step, a tf.Variable, read by Dropout inside FProp's custom
    gradient (which refuses variables it was not given): equal to the step as an int."""
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    results = []
    for step in (tf.Variable(7, dtype=tf.int64), 7):
        pipe = mz.pipeline(body, 2, 3, 'except_last', cell_functions=cell_functions)
        results.append(mz.sgd_step_tape(pipe, x, y, step))
    (out_v, loss_v, grads_v), (out_i, loss_i, grads_i) = results
    np.testing.assert_array_equal(out_v, out_i)
    np.testing.assert_array_equal(loss_v, loss_i)
    for a, b in zip(grads_v, grads_i):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('num_cells,num_micro_batches', [(1, 1), (2, 3), (4, 4)])
def test_dropout_output_does_not_depend_on_partitioning(num_cells, num_micro_batches):
    body = mz.mlp_body()
    x, _ = mz.inputs_for(body)
    with fprop_context.training(step=2):
        ref = mz.sequential(body)(x).numpy()
        out = mz.pipeline(body, num_cells, num_micro_batches)(x).numpy()
        other_step = mz.sequential(body)
    np.testing.assert_allclose(out, ref, rtol=1e-10)
    with fprop_context.training(step=3):
        assert np.abs(other_step(x).numpy() - ref).max() > 1e-3  # a new step, a new mask


def skip_body():
    dense = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=6, output_dim=6,
                                       activation='tanh', dtype=tf.float64) for i in range(4)]
    return ([layers.Stash.Params().Set(name='stash', key='s')] + dense[:2] +
            [layers.Stash.Params().Set(name='stash2', key='t')] + dense[2:] +
            [layers.Pop.Params().Set(name='pop', key='s', combine='add'),
             layers.Pop.Params().Set(name='pop2', key='t', combine='concat'),
             layers.Dense.Params().Set(name='out', input_dim=12, output_dim=3,
                                       dtype=tf.float64)])


_skip_reference = {}


@pytest.mark.parametrize('num_cells', [2, 3, 4])
def test_skip_connections_cross_cell_boundaries(num_cells):
    body = skip_body()
    x = tf.constant(np.random.default_rng(1).normal(size=[5, 6]))
    y = tf.constant([0, 1, 2, 0, 1])
    if not _skip_reference:  # the unpartitioned step, once for the three cases
        _skip_reference['step'] = mz.sgd_step_tape(mz.sequential(body), x, y, 1)
    ref_out, ref_loss, ref_grads = _skip_reference['step']
    pipe = mz.pipeline(body, num_cells, 2)
    # The stashed tensors really travel between devices: some cell boundary
    # sits between a Stash and its Pop.
    names = [layer.params.name for layer in pipe.cells[0].layers]
    assert 'stash' in names and 'pop' not in names
    out, loss, grads = mz.sgd_step_tape(pipe, x, y, 1)
    np.testing.assert_allclose(out, ref_out, rtol=1e-10)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-14)


def test_nested_inputs_and_outputs():
    """A dict input flows through; int leaves ride along without gradients."""
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=4, output_dim=4,
                                      dtype=tf.float64) for i in range(2)]
    pipe = mz.pipeline(body, 2, 3)
    x = {'x': tf.constant(np.ones([6, 4])), 'ids': tf.range(6)}
    with fprop_context.training(step=0):
        out = pipe(x)
    assert set(out) == {'x', 'ids'}
    np.testing.assert_array_equal(out['ids'].numpy(), np.arange(6))
    seq = mz.sequential(body)
    np.testing.assert_allclose(out['x'].numpy(), seq(x['x']).numpy(), rtol=1e-12)


def wide_narrow_body():
    widths = [4, 64, 64, 8, 8, 8, 8, 4]
    return [layers.Dense.Params().Set(name=f'fc{i}', input_dim=a, output_dim=b)
            for i, (a, b) in enumerate(zip(widths, widths[1:]))]


@pytest.mark.parametrize('partition_by', ['params', 'flops', 'time'])
def test_automatic_balance(partition_by):
    body = wide_narrow_body()
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, num_cells=3, partition_by=partition_by,
        input_shape=[32, 4]).Instantiate()
    assert sum(pipe.balance) == len(body) and len(pipe.balance) == 3
    if partition_by == 'params':
        assert list(pipe.balance) == partition.solve_balance(costs.by_params(body), 3)
        assert pipe.balance[0] < pipe.balance[2]  # the big fc1 layer gets a cell of its own
    if partition_by == 'flops':
        expected = partition.solve_balance(costs.by_flops(body, tf.TensorShape([32, 4])), 3)
        assert list(pipe.balance) == expected


def test_costs_by_params_and_flops_match_layer_math():
    body = wide_narrow_body()
    assert costs.by_params(body)[1] == 64 * 64 + 64
    assert costs.by_flops(body, tf.TensorShape([32, 4]))[1] == 2 * 32 * 64 * 64


def test_eval_mode_runs_forward_only():
    body = mz.mlp_body()
    x, _ = mz.inputs_for(body)
    pipe = mz.pipeline(body, 4, 3)
    with fprop_context.evaluation():
        out = pipe(x).numpy()
        ref = mz.sequential(body)(x).numpy()  # dropout off in eval
    np.testing.assert_allclose(out, ref, rtol=1e-12)


def test_one_f_one_b_schedule_matches_fill_drain():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    fd = mz.pipeline(body, 4, 4)
    ofob = mz.pipeline(body, 4, 4, schedule='1f1b')
    loss_fd, grads_fd = mz.sgd_step_forward_backward(fd, x, y, 1)
    loss_1f, grads_1f = mz.sgd_step_forward_backward(ofob, x, y, 1)
    np.testing.assert_allclose(loss_1f, loss_fd, rtol=1e-10)
    for a, b in zip(grads_1f, grads_fd):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)


def test_costs_by_time_sees_a_heavy_layer():
    body = [layers.Dense.Params().Set(name='small', input_dim=256, output_dim=2),
            layers.Dense.Params().Set(name='big', input_dim=2, output_dim=256),
            layers.Dense.Params().Set(name='huge', input_dim=256, output_dim=2048)]
    small, big, huge = costs.by_time(body, costs.sample_input([1024, 256], tf.float32),
                                     '/CPU:0')
    assert min(small, big, huge) > 0
    assert huge > 3 * small  # ~1000x the flops of the small layer: 5.8 ms against 0.6 here, idle


def long_skip_body():
    """A skip of width 6 from cell 0 to cell 3 (balance [3, 1, 1, 3]); the cells in
    between work at width 9, so any width-6 tensor there is the skip passing through."""
    def dense(name, i, o):
        return layers.Dense.Params().Set(name=name, input_dim=i, output_dim=o,
                                         activation='tanh', dtype=tf.float64)
    return [dense('fc_in', 6, 6), layers.Stash.Params().Set(name='stash', key='s'),
            dense('fc0', 6, 9),
            dense('fc1', 9, 9), dense('fc2', 9, 9), dense('fc3', 9, 6),
            layers.Pop.Params().Set(name='pop', key='s', combine='add'),
            dense('out', 6, 3)]


@pytest.mark.parametrize('entry', ['forward_backward', 'tape'])
def test_a_skip_goes_straight_from_the_stashing_cell_to_the_popping_cell(entry):
    body = long_skip_body()
    x = tf.constant(np.random.default_rng(2).normal(size=[5, 6]))
    y = tf.constant([0, 1, 2, 0, 1])
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=[3, 1, 1, 3], num_micro_batches=2).Instantiate()

    @tf.function
    def step():
        with fprop_context.training(step=1):
            if entry == 'forward_backward':
                return pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(mz.loss_fn(pipe.FProp(pipe.theta, x), y))
            return loss, tape.gradient(loss, pipe.theta)

    fn = step.get_concrete_function()
    passing = [op.name for op in fn.graph.get_operations()
               if trace.cell_of_node(op.name) in (1, 2)
               and any(t.shape.rank == 2 and t.shape[-1] == 6 for t in op.outputs)]
    assert not passing, passing[:5]
    moved = trace.bytes_between_devices(fn)
    assert moved.get(('CPU:0', 'CPU:3'), 0) >= 5 * 6 * 8  # the skip, forward
    if entry == 'forward_backward':  # the tape's graph keeps its backward in a function
        assert moved.get(('CPU:3', 'CPU:0'), 0) >= 5 * 6 * 8  # and its gradient, back
    # Still exact: the same loss and gradients as the unpartitioned body.
    ref = mz.sequential(body)
    ref_out, ref_loss, ref_grads = mz.sgd_step_tape(ref, x, y, 1, lr=0.0)
    loss, grads = step()
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-12)
    for g, r in zip(tf.nest.flatten(grads), ref_grads):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-10, atol=1e-14)
