"""The MLP that tensor-parallel steps are checked on, its T=1 reference and the comparison.

Megatron's layers (a column-parallel Dense, dropout on the home device, a
ParallelMLP pair with dropout on its split hidden layer, a plain Dense, a
row-parallel Dense) in float64, so that 1e-5 relative tests the mathematics.
Shared by tests/test_tensor_parallel.py (8 logical CPUs) and the 16-device
child of tests/test_tensor_parallel_16.py (its own TensorFlow), so that both
build and compare the same pipeline.
"""
import dataclasses

import numpy as np
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tfpipe import fprop_context, layers, variable_shards
from tfpipe.base_layer import flatten_by_path
from tfpipe.layers.tensor_parallel_dense import (ColumnParallelDense, ParallelMLP,
                                                 RowParallelDense)
from tfpipe.pipeline import partition

STEP = 7


def tp_body(dtype=tf.float64):
    body = [
        ColumnParallelDense.Params().Set(name='fc0', input_dim=12, output_dim=16,
                                         activation='relu'),
        layers.Dropout.Params().Set(name='drop0', keep_prob=0.7),
        ParallelMLP.Params().Set(name='mlp', input_dim=16, hidden_dim=32, keep_prob=0.8),
        layers.Dense.Params().Set(name='fc2', input_dim=16, output_dim=16, activation='tanh'),
        RowParallelDense.Params().Set(name='fc3', input_dim=16, output_dim=5),
    ]
    for p in body:
        p.dtype = dtype
    return body


def tp_pipeline(t, k, r=1, m=3, **kw):
    body = tp_body()
    return tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(len(body), k),
        num_micro_batches=m, num_replicas=r, tensor_parallel=t, **kw).Instantiate()


def inputs(batch=10):
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=[batch, 12]), tf.float64),
            tf.constant(rng.integers(0, 5, size=[batch]), tf.int32))


def whole(pipe, values_by_path):
    """{whole weight path: value} from per-variable values (shards concatenated)."""
    out, seen = {}, set()
    for path, var in pipe.VariablesByPath().items():
        sharded = variable_shards.of(var)
        if sharded is None:
            out[path] = np.asarray(values_by_path[path])
        elif sharded.path not in seen:
            seen.add(sharded.path)
            paths = {id(v): p for p, v in pipe.VariablesByPath().items()}
            out[sharded.path] = np.concatenate(
                [np.asarray(values_by_path[paths[id(s)]]) for s in sharded.shards],
                sharded.axis)
    return out


@dataclasses.dataclass
class Step:
    """One SGD step of a pipeline (`step`): the whole weights it started from, its loss,
    whole gradients and updated whole weights, and what its trace shows, so that tests of
    placement and memory read the very step whose numbers are checked: the traced
    function and {path: (variable's device, its gradient's device, the gradient's bytes)}
    of (replica 0's) theta."""

    initial: dict
    loss: np.ndarray
    grads: dict
    weights: dict
    function: object
    placed: dict


def step(pipe, replica_thetas=False) -> Step:
    """One SGD step through ForwardBackward (the trainer's form with replica_thetas)."""
    x, y = inputs()
    initial = whole(pipe, {p: v.numpy() for p, v in pipe.VariablesByPath().items()})
    placed = {}

    @tf.function(autograph=False)
    def run():
        with fprop_context.training(step=STEP):
            if replica_thetas:
                loss, grads = pipe.ForwardBackward(pipe.ReplicaThetas(), x, mz.loss_fn, y)
                for theta, g in zip(pipe.ReplicaThetas(), grads):
                    for v, d in zip(tf.nest.flatten(theta), tf.nest.flatten(g)):
                        v.assign_sub(0.1 * d)
                theta, grads = pipe.ReplicaThetas()[0], grads[0]
            else:
                loss, grads = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
                for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
                    v.assign_sub(0.1 * g)
                theta = pipe.theta
        variables = flatten_by_path(theta, 'pipe')
        placed.update({path: (variables[path].device, g.device,
                              g.shape.num_elements() * g.dtype.size)
                       for path, g in flatten_by_path(grads, 'pipe').items()})
        return loss, grads
    loss, grads = run()
    grads = {p: g.numpy() for p, g in flatten_by_path(grads, 'pipe').items()}
    weights = {p: v.numpy() for p, v in pipe.VariablesByPath().items()}
    return Step(initial, loss.numpy(), whole(pipe, grads), whole(pipe, weights),
                run.get_concrete_function(), placed)


_reference = {}


def reference():
    """The T=1, K=1 pipeline's initial weights and SGD step, computed once per process."""
    if not _reference:
        ref = step(tp_pipeline(1, 1, m=3))
        _reference.update(initial=ref.initial, loss=ref.loss, grads=ref.grads,
                          weights=ref.weights)
    return _reference


def assert_same(actual, expected, what):
    assert sorted(actual) == sorted(expected), what
    for path in expected:
        np.testing.assert_allclose(actual[path], expected[path], rtol=1e-5, atol=1e-12,
                                   err_msg=f'{what} {path}')


def check(pipe, replica_thetas=False) -> None:
    """`pipe` starts from the reference's weights and takes its step within 1e-5."""
    check_step(step(pipe, replica_thetas))


def check_step(result: Step) -> None:
    """`result` started from the reference's weights and took its step within 1e-5."""
    ref = reference()
    assert_same(result.initial, ref['initial'], 'initial weights')
    np.testing.assert_allclose(result.loss, ref['loss'], rtol=1e-5)
    assert_same(result.grads, ref['grads'], 'grads')
    assert_same(result.weights, ref['weights'], 'updated weights')
