"""Cell k's forward, recompute and backward ops are placed on device k.

Read from the traced graph (and its function library) of a K=4 step, because
TensorFlow silently runs unplaced ops wherever it likes: with a plain outer
tape or tf.recompute_grad about half the backward ops come out unplaced.
"""
import collections

import pytest
import tensorflow as tf

from tests import model_zoo as mz
from tfpipe import fprop_context
from tfpipe.pipeline import trace

K, M = 4, 2


def forward_backward_step(pipe, x, y):
    @tf.function
    def step():
        with fprop_context.training(step=3):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(0.1 * g)
        return loss
    return step.get_concrete_function()


def tape_step(pipe, x, y):
    @tf.function
    def step():
        with fprop_context.training(step=3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(mz.loss_fn(pipe.FProp(pipe.theta, x), y))
        return tape.gradient(loss, pipe.trainable_variables)
    return step.get_concrete_function()


def pipeline_nodes(concrete_fn):
    """Compute nodes the pipeline created: under its 'pipe/' name scope, or the
    tape's gradients of those ('gradient_tape/pipe/...')."""
    return [n for n in trace.nodes(concrete_fn)
            if n.op not in trace.PLUMBING_OPS
            and n.name.removeprefix('gradient_tape/').split('/')[0] == 'pipe']


def phase_of(name):
    if name.startswith('gradient_tape/'):
        return 'backward'
    for part in name.split('/'):
        for phase in ('forward', 'backward'):
            if part.startswith(phase + '_'):
                return phase
    return None


@pytest.mark.parametrize('build_step', [forward_backward_step, tape_step])
@pytest.mark.parametrize('recompute', ['always', 'except_last', 'never'])
def test_every_cell_op_runs_on_its_cell_device(build_step, recompute):
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, K, M, recompute)
    nodes = pipeline_nodes(build_step(pipe, x, y))
    unplaced = [n.name for n in nodes if not n.device]
    assert not unplaced, f'unplaced pipeline ops: {unplaced[:10]}'
    seen = collections.Counter()
    for n in nodes:
        k = trace.cell_of_node(n.name)
        if k is None:
            continue
        assert trace.device_index(n.device) == f'CPU:{k}', (n.name, n.device)
        seen[(k, phase_of(n.name), n.op)] += 1
    for k in range(K):
        # Every cell holding weights does forward matmuls and backward gradient matmuls.
        if any(layer.trainable_variables for layer in pipe.cells[k].layers):
            assert seen[(k, 'forward', 'MatMul')] > 0, k
            assert seen[(k, 'backward', 'MatMul')] > 0, k
    # Recompute shows up as forward activations (Relu, not ReluGrad) inside the
    # backward scopes of exactly the recomputing cells.
    for k, cell in enumerate(pipe.cells):
        recomputed = sum(seen[(k, 'backward', op)] for op in ('Relu', 'Tanh'))
        has_activation = sum(seen[(k, 'forward', op)] for op in ('Relu', 'Tanh')) > 0
        if cell.recompute and has_activation:
            assert recomputed > 0, f'cell {k} should recompute its forward'
        else:
            assert recomputed == 0, f'cell {k} must not recompute'


def test_ops_per_device_reports_each_cell():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, K, M)
    counts = trace.ops_per_device(forward_backward_step(pipe, x, y))
    for k in range(K):
        assert counts.get(f'CPU:{k}', 0) > 0
