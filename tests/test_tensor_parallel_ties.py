"""Ties of split weights (tensor parallelism) other than the LM's embedding and softmax.

Two column-parallel and two row-parallel layers, the second of each pair in
the other cell, share their weights (`tied_weights`, by whole path): user shard
t reads owner shard t, and the gradient of the one weight is the sum of both
uses. The reference is the body as a plain `Sequential` at T=1 under one tape,
with the owners' variables passed by hand as the users' weights (no pipeline,
tie or shard code), in float64 so that 1e-5 tests the mathematics. A tie the
shards cannot follow (a weight split by rows tied to one split by columns, or a
split weight to a whole one) is refused in one line naming both paths and the
fix, though T=1 takes it.
"""
import os

import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tests import tensor_parallel_lm_task as lm_tp
from tests import trainer_helpers as th
from tests.tensor_parallel_mlp import STEP, assert_same, inputs, step
from tfpipe import fprop_context, layers
from tfpipe.base_layer import flatten_by_path
from tfpipe.layers.tensor_parallel_dense import ColumnParallelDense, RowParallelDense

TIES = {'col_b/w': 'col_a/w', 'col_b/b': 'col_a/b',  # split by columns (w and b)
        'row_b/w': 'row_a/w', 'row_b/b': 'row_a/b'}  # split by rows (w), whole (b)


def body():
    out = [
        ColumnParallelDense.Params().Set(name='fc0', input_dim=12, output_dim=16,
                                         activation='relu'),
        ColumnParallelDense.Params().Set(name='col_a', input_dim=16, output_dim=16,
                                         activation='tanh'),
        RowParallelDense.Params().Set(name='row_a', input_dim=16, output_dim=16,
                                      activation='tanh'),
        ColumnParallelDense.Params().Set(name='col_b', input_dim=16, output_dim=16,
                                         activation='tanh'),
        RowParallelDense.Params().Set(name='row_b', input_dim=16, output_dim=16,
                                      activation='tanh'),
        RowParallelDense.Params().Set(name='fc3', input_dim=16, output_dim=5),
    ]
    for p in out:
        p.dtype = tf.float64
    return out


def tied_pipeline(t, k, r=1, ties=TIES):
    return tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body(), balance=[6] if k == 1 else [3, 3], num_micro_batches=3,
        num_replicas=r, tensor_parallel=t, tied_weights=dict(ties)).Instantiate()


_reference = {}


def reference():
    """Loss, gradients and updated weights of the unpartitioned, hand-tied model."""
    if not _reference:
        seq = layers.Sequential.Params().Set(name='pipe', body=body()).Instantiate()
        theta = {name: dict(weights) for name, weights in seq.theta.items()}
        for user in TIES:
            layer, name = user.split('/')
            del theta[layer][name]  # the users' own weights are not part of the model
        variables = flatten_by_path(theta, 'pipe')
        x, y = inputs()

        @tf.function
        def run():
            with fprop_context.training(step=STEP), tf.GradientTape() as tape:
                used = {name: dict(weights) for name, weights in theta.items()}
                for user, owner in TIES.items():
                    (layer, name), (owner_layer, owner_name) = user.split('/'), owner.split('/')
                    used[layer][name] = theta[owner_layer][owner_name]
                loss = tf.reduce_mean(mz.loss_fn(seq.FProp(used, x), y))
            grads = tape.gradient(loss, variables)
            for path, g in grads.items():
                variables[path].assign_sub(0.1 * g)
            return loss, grads

        initial = {p: v.numpy() for p, v in variables.items()}
        loss, grads = run()
        _reference.update(initial=initial, loss=loss.numpy(),
                          grads={p: g.numpy() for p, g in grads.items()},
                          weights={p: v.numpy() for p, v in variables.items()})
    return _reference


_tied = {}


def tied_step(t, k, r):
    """(pipeline, its `step`) at (t, k, r), built, traced and run once per process: the
    equality and the gradient placement tests read the same traced step."""
    if (t, k, r) not in _tied:
        pipe = tied_pipeline(t, k, r)
        _tied[t, k, r] = pipe, step(pipe, replica_thetas=r > 1)
    return _tied[t, k, r]


@pytest.mark.parametrize('t,k,r', [(2, 2, 1), (2, 2, 2), (4, 2, 1)])
def test_tied_split_weights_equal_the_unpartitioned_model(t, k, r):
    ref = reference()
    pipe, result = tied_step(t, k, r)
    assert not any('col_b' in p or 'row_b' in p for p in pipe.VariablesByPath())
    assert_same(result.initial, ref['initial'], 'initial weights')
    np.testing.assert_allclose(result.loss, ref['loss'], rtol=1e-5)
    assert_same(result.grads, ref['grads'], 'grads')
    assert_same(result.weights, ref['weights'], 'updated weights')


def gradient_devices(pipe, loss_fn, *args):
    """{variable path: (variable's device, its traced gradient's device)}."""
    placed = {}

    @tf.function
    def run():
        with fprop_context.training(step=STEP):
            _, grads = pipe.ForwardBackward(pipe.theta, *args[:1], loss_fn, *args[1:])
        for path, g in flatten_by_path(grads, pipe.path).items():
            placed[path] = g.device
    run.get_concrete_function()
    return {p: (v.device, placed[p]) for p, v in pipe.VariablesByPath().items()}


def test_tied_shards_gradients_are_summed_on_the_shards_devices():
    """Each shard's gradient (its own use's plus the other cell's) ends on the shard's
    device, as an untied shard's does, not on its cell's home device: for the MLP's
    ties (the traced step the test above checks) and for the LM's vocabulary-parallel
    embedding and softmax (T=2, K=2)."""
    pipe, result = tied_step(2, 2, 1)
    task = lm_tp.lm_task(2, 2)
    batch, _ = lm_tp.reference()
    mlp = {path: (v, g) for path, (v, g, _) in result.placed.items()}
    assert sorted(mlp) == sorted(pipe.VariablesByPath())
    for name, placed in [
            ('mlp', mlp),
            ('lm', gradient_devices(task.pipe, task.PerExampleLoss, task.PipelineInputs(batch),
                                    task.PipelineTargets(batch)))]:
        assert any(path.endswith(('col_a/w_shard1', 'embedding/emb_shard1'))
                   for path in placed), name
        misplaced = {p: d for p, d in placed.items() if d[0] != d[1]}
        assert not misplaced, (name, misplaced)


@pytest.mark.parametrize('ties,message', [
    ({'row_b/w': 'col_a/w'}, "'row_b/w' is split by rows over 2 devices but 'col_a/w' is split "
                             'by columns over 2 devices'),
    ({'row_a/b': 'col_a/b'}, "'row_a/b' is whole on its cell's home device but 'col_a/b' is "
                             'split along axis 0 over 2 devices'),
    ({'col_b/w': 'row_a/w', 'row_b/w': 'row_a/w'},
     "'col_b/w' is split by columns over 2 devices but 'row_a/w' is split by rows over 2 "
     'devices'),
], ids=['rows_to_columns', 'whole_to_split', 'columns_to_rows'])
def test_ties_split_unlike_are_refused_in_one_line_with_the_fix(ties, message):
    tied_pipeline(1, 2, ties=ties)  # T=1 takes them
    with pytest.raises(ValueError) as err:
        tied_pipeline(2, 2, ties=ties)
    assert str(err.value) == (
        f'pipe: tied_weights: {message}: a tie reads the owner shard by shard, so both layers '
        'must split the weight alike (e.g. two ColumnParallelDense, or an Embedding and a '
        'VocabLogits) or neither; tie layers of one kind, or set '
        'task.pipeline.tensor_parallel=1')


def test_a_shard_path_is_refused_with_the_whole_path_suggested():
    with pytest.raises(ValueError, match=r"^pipe: tied_weights: no variable 'col_b/w_shard0' "
                                         r"in the body; did you mean 'col_b/w'\?"):
        tied_pipeline(2, 2, ties={'col_b/w_shard0': 'col_a/w_shard0'})


def test_trainer_refuses_an_unlike_tie_before_the_logdir(tmp_path):
    """TensorParallelMLP's row-parallel bias (whole) tied to its column-parallel embed/b."""
    logdir = str(tmp_path / 'fresh')
    result = th.run('image.shapes.TensorParallelMLP', logdir, 'unused', '--max_steps=2',
                    th.overrides(**{'task.pipeline.tensor_parallel': 2,
                                    'task.pipeline.tied_weights': {'mlp1/fc2/b': 'embed/b'}}))
    assert result.returncode == 2, result.stderr[-3000:]
    assert th.error_line(result).startswith(
        "error: task/pipe: tied_weights: 'mlp1/fc2/b' is whole on its cell's home device but "
        "'embed/b' is split along axis 0 over 2 devices: ")
    assert th.error_line(result).endswith('or set task.pipeline.tensor_parallel=1')
    assert not os.path.exists(logdir)
