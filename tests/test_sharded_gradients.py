"""ZeRO stage 2 (task.train.sharding='gradients'): gradient sums at 1/R per replica.

The reference is the unsharded trainer update (tests/test_sharded_optimizer.py's
`_train`: R optimizers with whole slots, through guarded_update, clipping and the
NaN guard included) given the gradients summed over replicas. Stage 2 gets each
replica's own share instead (shares that sum to those gradients, different per
replica), reduce-scatters them, clips by the norm summed over the parts and
updates its part: same weights on every replica and same slots within 1e-5, for
variables that R does not divide.
"""
import functools

import numpy as np
import pytest
import tensorflow as tf

from tests import model_zoo as mz
from tests import test_tensor_parallel_optimizers as tp_optimizers
from tfpipe import fprop_context
from tfpipe.base_layer import flatten_by_path
from tfpipe.hyperparams import Params
from tfpipe.pipeline import sharding
from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
from tests.test_sharded_optimizer import (CLIP, NAN_STEP, OPTIMIZERS, SHAPES, STEPS, _devices,
                                          _grads, _replica_variables, _slot, _slot_names,
                                          _train)
from trainer.guarded_update import guarded_update


def _shares(step, num_replicas):
    """Replica r's own gradients at `step`: unequal shares summing to `_grads(step)`."""
    rng = np.random.default_rng(200 + step)
    total = _grads(step)
    out = [{} for _ in range(num_replicas)]
    for path, g in total.items():
        noise = rng.normal(size=(num_replicas,) + g.shape).astype(np.float32)
        noise -= noise.mean(0)
        for r in range(num_replicas):
            out[r][path] = g / num_replicas + noise[r]
    return out


def _train_stage2(opt_params, num_replicas):
    variables = _replica_variables(num_replicas)
    optimizer = ShardedOptimizer(opt_params, variables, shard_gradients=True)
    global_step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(loss, shares):
        replica_grads = []
        for device, share in zip(_devices(num_replicas), shares):
            with tf.device(device):
                replica_grads.append({p: tf.identity(g) for p, g in share.items()})
        return guarded_update(loss, replica_grads, CLIP, optimizer, variables,
                              tf.constant(0.05), global_step)

    norms = [float(step(tf.constant(np.nan if t == NAN_STEP else 1.0),
                        _shares(t, num_replicas))) for t in range(STEPS)]
    return variables, optimizer, norms


@pytest.mark.parametrize('num_replicas', [2, 4])
@pytest.mark.parametrize('name', ['adam', 'adafactor', 'sgd_momentum'])
def test_stage2_update_equals_the_unsharded_one(name, num_replicas):
    opt_params = OPTIMIZERS[name]
    ref_vars, ref_opt = _train(opt_params, num_replicas, sharded=False)
    vars_, opt, norms = _train_stage2(opt_params, num_replicas)
    assert int(opt.iterations.numpy()) == STEPS - 1  # the NaN step was skipped
    assert all(n > CLIP for n in norms)  # every step clipped: the norm is the whole one
    for r in range(num_replicas):
        for path in SHAPES:
            np.testing.assert_allclose(vars_[r][path].numpy(), ref_vars[0][path].numpy(),
                                       rtol=1e-5, atol=1e-6, err_msg=f'{path} replica {r}')
    for path, names in _slot_names(opt_params).items():
        for slot in names:
            np.testing.assert_allclose(_slot(opt, path, slot), _slot(ref_opt, path, slot),
                                       rtol=1e-5, atol=1e-6, err_msg=f'{path}/{slot}')


def test_reduce_scatter_leaves_each_replica_its_part_of_the_sum():
    variables = _replica_variables(4)
    optimizer = ShardedOptimizer(OPTIMIZERS['adam'], variables, shard_gradients=True)
    shares = _shares(0, 4)
    parts = tf.function(lambda: optimizer.ReduceScatter(
        [{p: tf.constant(g) for p, g in s.items()} for s in shares]))()
    for path in SHAPES:
        whole = sum(s[path] for s in shares).reshape(-1)
        joined = np.concatenate([parts[r][path].numpy() for r in range(4)])
        np.testing.assert_allclose(joined, whole, rtol=1e-6, atol=1e-6, err_msg=path)
        assert parts[3][path].shape[0] < whole.shape[0]  # a part, not the whole


def _all_gathers(fn, *args):
    """The number of all-gathers in `fn`'s traced graph, its branches included."""
    graph = fn.get_concrete_function(*args).graph.as_graph_def()
    ops = [n.op for n in graph.node] + [n.op for f in graph.library.function for n in f.node_def]
    return ops.count('CollectiveGather')


@pytest.mark.parametrize('name,gathers', [('adam', 2), ('adafactor', 2 + 2 * 2)])
def test_stage2_gathers_a_whole_gradient_only_for_a_rule_that_reads_one(name, gathers):
    """One all-gather per replica of the updated weights (all variables on one device
    here: one buffer), and Adafactor's whole gradient of each of its 2 factored
    variables (rank >= 2), per replica; Adam reads none. (Reading a part's gradient shape
    used to all-gather the whole gradient of every variable, for every rule.)"""
    variables = _replica_variables(2)
    optimizer = ShardedOptimizer(OPTIMIZERS[name], variables, shard_gradients=True)
    global_step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(shares):
        return guarded_update(tf.constant(1.0), shares, CLIP, optimizer, variables,
                              tf.constant(0.05), global_step)

    shares = [{p: tf.constant(g) for p, g in s.items()} for s in _shares(0, 2)]
    assert _all_gathers(step, shares) == gathers


def _train_params(**values):
    p = Params()
    p.Define('sharding', 'none', '')
    p.Define('shard_optimizer_states', False, '')
    p.Define('regather_per_micro_batch', False, '')
    return p.Set(**values)


@pytest.mark.parametrize('values,count,message', [
    ({'sharding': 'gradient'}, 2, "did you mean 'gradients'"),
    ({'sharding': 'gradients'}, 1, 'with 1 replica does nothing'),
    ({'sharding': 'gradients', 'shard_optimizer_states': True}, 2, 'contradicts'),
    ({'sharding': 'weights', 'shard_optimizer_states': True}, 2, 'contradicts'),
    ({'sharding': 'weights'}, 1, 'with 1 replica does nothing'),
    ({'sharding': 'weight'}, 2, "did you mean 'weights'"),
    ({'sharding': 'gradients', 'regather_per_micro_batch': True}, 2,
     'only stage 3 gathers weights')])
def test_bad_stages_are_refused_in_one_line(values, count, message):
    with pytest.raises(ValueError, match=message) as e:
        sharding.stage_of(_train_params(**values), count)
    assert '\n' not in str(e.value)


def test_the_older_switch_means_optimizer_states():
    assert sharding.stage_of(_train_params(shard_optimizer_states=True), 2) == 'optimizer_states'
    assert sharding.stage_of(_train_params(sharding='gradients'), 4) == 'gradients'


@pytest.mark.parametrize('values,stage', [({'sharding': 'optimizer_states'}, 'optimizer_states'),
                                          ({'shard_optimizer_states': True}, 'optimizer_states'),
                                          ({'sharding': 'gradients'}, 'gradients'),
                                          ({'sharding': 'weights'}, 'weights')])
def test_every_stage_with_expert_parallelism_is_built(values, stage):
    """In one process (test_expert_parallel_sharded_optimizer.py, test_sharded_weights_
    experts.py) and across trainer clients (test_clients_experts.py), also with as many
    clients as experts' ranks."""
    assert sharding.stage_of(_train_params(**values), 4) == stage
    assert sharding.stage_of(_train_params(**values), 2) == stage


class PipelineRun(tp_optimizers.Run):
    """tests/test_tensor_parallel_optimizers.py's pipeline (float64 unless `dtype`, Dropout,
    T-way split layers, an fc3 bias of 5 that neither R divides; `pipeline_params` set on
    it) and the trainer's update at `stage` (task.train.sharding: one unsharded optimizer
    per replica, stage 1, 2 or 3; `regather`: stage 3 regathers per task), clipping by
    the global norm at `clip`. `train`
    continues from the global step (inputs of each step fixed by the step, as a resumed
    trainer's) and returns the loss of every step; `norms` gets each step's global
    gradient norm (before clipping)."""

    def __init__(self, t, k, r, stage, rule, clip=0.5, dtype=tf.float64, regather=False,
                 **pipeline_params):
        super().__init__(t, k, r, sharded=stage == sharding.OPTIMIZER_STATES, rule=rule,
                         dtype=dtype, **pipeline_params)
        self.clip, self.dtype, self.norms = clip, dtype, []
        if stage == sharding.GRADIENTS:
            self.pipe.DeferGradientSum()
            self.optimizer = self.optimizers = ShardedOptimizer(rule, self.variables,
                                                                shard_gradients=True)
        if stage == sharding.WEIGHTS:
            self.pipe.ShardWeights(per_micro_batch=regather)
            shards = self.pipe.weight_shards
            self.variables = shards.parts
            self.optimizer = self.optimizers = ShardedOptimizer(rule, self.variables,
                                                                weight_shapes=shards.shapes)

    def _build_step(self, x, y):
        with fprop_context.training(step=self.global_step):
            loss, grads = self.pipe.ForwardBackward(self.pipe.ReplicaThetas(), x,
                                                    mz.loss_fn, y)
        grads = grads if isinstance(grads, list) else [grads]
        norm = guarded_update(loss, [flatten_by_path(g, 'pipe') for g in grads], self.clip,
                              self.optimizers, self.variables,
                              tf.constant(tp_optimizers.LR, self.dtype), self.global_step)
        return loss, norm

    def train(self, steps):
        losses = []
        for _ in range(steps):
            x, y = tp_optimizers.inputs(int(self.global_step.numpy()))
            loss, norm = self._step(tf.cast(x, self.dtype), y)
            losses.append(float(loss))
            self.norms.append(float(norm))
        return losses


PIPELINE_GRID = [  # (optimizer, T, K, R): R in {2, 4} x K in {1, 2}, T=2 at one point
    ('adam', 1, 1, 2), ('adam', 1, 2, 4), ('adam', 2, 2, 2),
    ('adafactor', 1, 2, 2), ('adafactor', 1, 1, 4)]


@pytest.mark.parametrize('name,t,k,r', PIPELINE_GRID)
def test_stage2_pipeline_trains_as_unsharded(name, t, k, r):
    """Loss at every step, every replica's weights and the whole slots within 1e-5."""
    rule = OPTIMIZERS[name].Copy().Set(name=name)
    ref = PipelineRun(t, k, r, sharding.NONE, rule)
    run = PipelineRun(t, k, r, sharding.GRADIENTS, rule)
    np.testing.assert_allclose(run.train(3), ref.train(3), rtol=1e-5)
    for copy, ref_copy in zip(run.variables, ref.variables):
        for path, var in ref_copy.items():
            np.testing.assert_allclose(copy[path].numpy(), var.numpy(), rtol=1e-5, atol=1e-8,
                                       err_msg=path)
    names = rule.Instantiate().SlotShapes
    for path, var in ref.variables[0].items():
        for slot in names(var.shape):
            np.testing.assert_allclose(run.optimizer.GetSlot(path, slot).numpy(),
                                       ref.optimizer.GetSlot(path, slot).numpy(),
                                       rtol=1e-5, atol=1e-8, err_msg=f'{path}/{slot}')


@functools.lru_cache(maxsize=None)  # the unsharded reference, shared by stages 2 and 3
def _conv_bn_run(stage, dtype, fprop_dtype=None, steps=3):
    """model_zoo's conv net with two BatchNorm layers, R=2 x K=2 x M=2, trained by the
    trainer's update with Adam at `stage`. Returns the loss of every step, and every
    replica's variables (BN moving statistics included; at stage 3 each weight whole, its
    parts joined) after the first and the last."""
    body = mz.conv_body(dtype, batch_norm=True)
    pipe = mz.pipeline(body, 2, 2, num_replicas=2, fprop_dtype=fprop_dtype)
    if stage == sharding.WEIGHTS:
        pipe.ShardWeights()
    copies = pipe.ReplicaVariablesByPath()
    variables = [{p: v for p, v in copy.items() if v.trainable} for copy in copies]
    rule = OPTIMIZERS['adam']
    if stage == sharding.GRADIENTS:
        pipe.DeferGradientSum()
        optimizer = ShardedOptimizer(rule, variables, shard_gradients=True)
    elif stage == sharding.WEIGHTS:
        optimizer = ShardedOptimizer(rule, variables, weight_shapes=pipe.weight_shards.shapes)
    else:
        optimizer = [rule.Instantiate() for _ in variables]
        for opt, v in zip(optimizer, variables):
            opt.CreateSlots(v)
    x, y = mz.inputs_for(body, dtype)
    global_step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step():
        with fprop_context.training(step=global_step):
            loss, grads = pipe.ForwardBackward(pipe.ReplicaThetas(), x, mz.loss_fn, y)
        guarded_update(loss, [flatten_by_path(g, 'pipe') for g in grads], 0.5, optimizer,
                       variables, tf.constant(0.01), global_step)
        return loss

    def snapshot():
        shards = pipe.weight_shards
        return [{p: (shards.whole(p) if shards and shards.is_part(v) else v).numpy()
                 for p, v in copy.items()} for copy in copies]

    losses = [float(step())]
    first = snapshot()
    losses += [float(step()) for _ in range(steps - 1)]
    return losses, first, snapshot()


def test_stage3_keeps_batch_norm_statistics_over_replicas():
    """Stage 3 on the same conv net (float64): the losses, every replica's BN statistics
    (bit for bit after the first step) and the whole weights as the unsharded run's."""
    ref_losses, ref_first, ref_last = _conv_bn_run(sharding.NONE, tf.float64)
    losses, first, last = _conv_bn_run(sharding.WEIGHTS, tf.float64)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for r in range(2):
        assert first[r].keys() == ref_first[0].keys()
        for path, value in _moving_statistics(first[r]).items():
            np.testing.assert_array_equal(value, ref_first[0][path], err_msg=f'{path} {r}')
        for path, value in ref_last[r].items():
            np.testing.assert_allclose(last[r][path], value, rtol=1e-5, atol=1e-8,
                                       err_msg=f'{path} replica {r}')


def _moving_statistics(copy):
    return {p: v for p, v in copy.items() if '/moving_' in p}


@pytest.mark.parametrize('dtype,fprop_dtype', [(tf.float64, None), (tf.float32, tf.bfloat16)],
                         ids=['float64', 'bfloat16'])
def test_stage2_keeps_batch_norm_statistics_over_replicas_and_bfloat16(dtype, fprop_dtype):
    """BatchNorm's moving statistics combine the micro-batches of both replicas as the
    unsharded run does: after the first step (same weights) bit for bit on every replica,
    after three within 1e-5 in float64. With bfloat16 activations (float32 variables and
    gradient sums) the first step is bit for bit too, and three steps within the 2% that
    tests/test_pipeline_bfloat16.py allows bfloat16 against float32."""
    ref_losses, ref_first, ref_last = _conv_bn_run(sharding.NONE, dtype, fprop_dtype)
    losses, first, last = _conv_bn_run(sharding.GRADIENTS, dtype, fprop_dtype)
    assert losses[0] == ref_losses[0]
    statistics = _moving_statistics(ref_first[0])
    assert len(statistics) == 4  # bn0 and bn1: mean and variance
    for r in range(2):
        for path, value in _moving_statistics(first[r]).items():
            np.testing.assert_array_equal(value, ref_first[0][path], err_msg=f'{path} {r}')
        assert first[r].keys() == ref_first[0].keys()
    assert not np.allclose(ref_last[0]['pipe/bn0/moving_mean'], 0.0)  # the statistics moved
    tolerance = dict(rtol=1e-5, atol=1e-8) if fprop_dtype is None else dict(rtol=0.02,
                                                                             atol=1e-3)
    np.testing.assert_allclose(losses, ref_losses, rtol=tolerance['rtol'])
    for r in range(2):
        for path, value in ref_last[r].items():
            np.testing.assert_allclose(last[r][path], value, **tolerance,
                                       err_msg=f'{path} replica {r}')
