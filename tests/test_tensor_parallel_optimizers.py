"""Sharded optimizer states (`shard_optimizer_states`) with tensor-parallel cells.

Adam over R=2 replicas x K=2 cells x T=2 devices per cell, slots sharded over
the replicas, must take the steps of the plain T=1 run with unsharded slots,
and its checkpoint must hold one whole copy per weight and per slot under the
layer path (`optimizer/_slots/pipe-mlp-fc1-w/m`, no `_shard`): the T=1 run's
checkpoint. So checkpoints are compared key by key, and they move both ways:
T=1 unsharded -> T=2 sharded and T=2 sharded -> T=1 continue as the T=1 run
does, and T=2 -> T=4 (other K) restores every value exactly. float64, so that
1e-5 relative tests the mathematics; the trainer's own update
(guarded_update) drives both optimizers. Adafactor, whose update reads
statistics of the whole weight, is checked the same way in
tests/test_tensor_parallel_adafactor.py (with `Run`'s rule).
"""
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tfpipe import checkpoints, fprop_context, optimizers
from tfpipe.base_layer import flatten_by_path
from tfpipe.layers.tensor_parallel_dense import (ColumnParallelDense, ParallelMLP,
                                                 RowParallelDense)
from tfpipe.pipeline import partition, replicas
from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
from trainer.guarded_update import guarded_update

LR = 0.01


def pipeline(t, k, r, dtype=tf.float64, tied=False, **pipeline_params):
    """The T-way split model over K cells (K*v with `virtual_stages`=v) and R replicas, its
    variables in `dtype`. `tied`: two more 8x8 layers around the MLP, the second reading
    the first's weight (ties.py; in cells 0 and 1 at K=2, in cells 0 and 2, both on
    device slot 0, at K=2 x v=2)."""
    body = [ColumnParallelDense.Params().Set(name='fc0', input_dim=6, output_dim=8,
                                             activation='relu'),
            ParallelMLP.Params().Set(name='mlp', input_dim=8, hidden_dim=16, keep_prob=0.8),
            RowParallelDense.Params().Set(name='fc3', input_dim=8, output_dim=5)]
    if tied:
        body[1:1] = [ColumnParallelDense.Params().Set(name='fc1', input_dim=8, output_dim=8,
                                                      activation='tanh')]
        body[3:3] = [ColumnParallelDense.Params().Set(name='fc2', input_dim=8, output_dim=8)]
        pipeline_params['tied_weights'] = {'fc2/w': 'fc1/w'}
    for p in body:
        p.dtype = dtype
    return tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body,
        balance=partition.even_balance(len(body), k * pipeline_params.get('virtual_stages', 1)),
        num_micro_batches=2, num_replicas=r, tensor_parallel=t, **pipeline_params).Instantiate()


class Run:
    """A pipeline with the trainer's optimizer(s) (`rule`'s Params, default Adam): sharded
    over replicas or one per replica."""

    def __init__(self, t, k, r, sharded, rule=None, **pipeline_params):
        self.pipe = pipeline(t, k, r, **pipeline_params)
        self.variables = [{p: v for p, v in copy.items() if v.trainable}
                          for copy in self.pipe.ReplicaVariablesByPath()]
        rule = rule or optimizers.Adam.Params().Set(name='adam')
        if sharded:
            self.optimizer = ShardedOptimizer(rule, self.variables)
            self.optimizers = self.optimizer
        else:
            self.optimizers = [rule.Instantiate() for _ in self.variables]
            for optimizer, variables in zip(self.optimizers, self.variables):
                optimizer.CreateSlots(variables)
            self.optimizer = self.optimizers[0]
        self.global_step = tf.Variable(0, dtype=tf.int64)
        self._step = tf.function(self._build_step)

    def _build_step(self, x, y):
        pipe = self.pipe
        with fprop_context.training(step=self.global_step):
            theta = pipe.ReplicaThetas() if pipe.num_replicas > 1 else pipe.theta
            loss, grads = pipe.ForwardBackward(theta, x, mz.loss_fn, y)
        grads = grads if isinstance(grads, list) else [grads]
        guarded_update(loss, [flatten_by_path(g, 'pipe') for g in grads], None,
                       self.optimizers, self.variables, tf.constant(LR, tf.float64),
                       self.global_step)

    def train(self, steps):
        for _ in range(steps):
            self._step(*inputs(int(self.global_step.numpy())))

    def checkpoint(self):
        return checkpoints.make(self.pipe.VariablesByPath(), optimizer=self.optimizer,
                                step=self.global_step)

    def save(self, path):
        return self.checkpoint().save(str(path), options=checkpoints.io_options())

    def restore(self, path):
        checkpoints.restore(self.checkpoint(), path)
        self.pipe.SyncReplicas()
        if not isinstance(self.optimizers, ShardedOptimizer):
            replicas.sync_slots(self.optimizers, self.variables)  # as the trainer does
        return self


def inputs(step):
    rng = np.random.default_rng(step)
    return (tf.constant(rng.normal(size=[8, 6]), tf.float64),
            tf.constant(rng.integers(0, 5, size=[8]), tf.int32))


def contents(path):
    """{checkpoint key: value} of the model and the optimizer (not the save counter)."""
    reader = tf.train.load_checkpoint(path)
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
            if key.startswith(('model/', 'optimizer/', 'step/'))}


def assert_same(actual, expected, rtol):
    assert sorted(actual) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], rtol=rtol, atol=1e-12,
                                   err_msg=key)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Checkpoints after 2 and 3 Adam steps at T=1 unsharded; after 2 at R=2 x K=2 x T=2
    sharded, whose replica copies are returned too; and both Runs, into which the tests
    restore (tracing a Run's step is most of its cost; a restore must then overwrite every
    value the Run trained)."""
    directory = tmp_path_factory.mktemp('tp_sharded')
    reference = Run(t=1, k=1, r=1, sharded=False)
    reference.train(2)
    out = {'t1_step2': reference.save(directory / 't1_step2')}
    reference.train(1)
    out['t1_step3'] = reference.save(directory / 't1_step3')
    split = Run(t=2, k=2, r=2, sharded=True)
    split.train(2)
    out['t2_step2'] = split.save(directory / 't2_step2')
    out['t2_replicas'] = [{p: v.numpy() for p, v in copy.items()} for copy in split.variables]
    out['t1_run'], out['t2_run'] = reference, split
    return out


def test_sharded_t2_steps_equal_t1_and_save_whole_weights_and_slots(runs):
    saved = contents(runs['t2_step2'])
    assert not any('shard' in key for key in saved), sorted(saved)
    assert 'optimizer/_slots/pipe-mlp-fc1-w/m/.ATTRIBUTES/VARIABLE_VALUE' in saved
    assert_same(saved, contents(runs['t1_step2']), rtol=1e-5)
    first, second = runs['t2_replicas']
    for path in first:
        np.testing.assert_array_equal(second[path], first[path], err_msg=path)


def test_t1_checkpoint_continues_at_t2_sharded(runs, tmp_path):
    target = runs['t2_run'].restore(runs['t1_step2'])
    target.train(1)
    assert_same(contents(target.save(tmp_path / 'ckpt')), contents(runs['t1_step3']),
                rtol=1e-5)


def test_t2_sharded_checkpoint_continues_at_t1(runs, tmp_path):
    target = runs['t1_run'].restore(runs['t2_step2'])
    assert_same(contents(target.save(tmp_path / 'restored')), contents(runs['t2_step2']),
                rtol=0)
    target.train(1)
    assert_same(contents(target.save(tmp_path / 'ckpt')), contents(runs['t1_step3']),
                rtol=1e-5)


@pytest.mark.parametrize('t,k,r,sharded', [(4, 1, 2, True), (4, 2, 1, False)])
def test_t2_sharded_checkpoint_restores_exactly_at_t4(runs, tmp_path, t, k, r, sharded):
    target = Run(t=t, k=k, r=r, sharded=sharded).restore(runs['t2_step2'])
    assert_same(contents(target.save(tmp_path / 'ckpt')), contents(runs['t2_step2']),
                rtol=0)
