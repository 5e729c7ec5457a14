"""ZeRO stage 3 (task.train.sharding='weights') with expert parallelism (P=2) in one process.

A non-expert weight is cut into R parts and gathered over all R replicas; an expert weight
(each replica holds E/P experts) into R/P parts over the replicas holding the same experts,
gathered (and its gradient reduce-scattered) among them only
(tfpipe/pipeline/sharded_weights.py). At R=4 that group is 2 replicas; at R=P=2 it is one,
so an expert weight is not cut at all (its part is the whole, flattened) while every other
weight is cut in 2. The reference is the unsharded run at the same P, R and K: 3 steps
of tests/test_expert_parallel_pipeline.py's float64 MoE pipeline (capacity drops nothing)
with the trainer's update (guarded_update, clipping by the global norm active at every
step; one point regathers per task), with Adam and with Adafactor (factored moments,
parameter scale: statistics of the whole weight, which for an expert weight is the
replica's E/P experts, as unsharded).
Loss, auxiliary losses and norm at every step and the checkpoint's every weight and slot
([E, ...] for an expert weight) within 1e-5; the stage-3 P=2 checkpoint restores into
P=1 unsharded and back, key by key. One traced pair of runs per grid point.
"""
import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf

from tests import model_zoo as mz
from tests import test_tensor_parallel_optimizers as tp_optimizers
from tests.test_expert_parallel_pipeline import F64, pipeline
from tests.test_expert_parallel_resume import inputs
from tests.test_sharded_optimizer import OPTIMIZERS
from tfpipe import checkpoints, fprop_context
from tfpipe.base_layer import flatten_by_path
from tfpipe.pipeline import expert_parallel, replicas
from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
from trainer.guarded_update import guarded_update

STEPS = 3
LR = 0.01
CLIP = 0.05  # below every step's global norm here: every step clips
GRID = {  # name: (optimizer, P, R, K, regather_per_micro_batch)
    'adam_p2_r4_k1': ('adam', 2, 4, 1, False),
    'adam_p2_r2_k2': ('adam', 2, 2, 2, False),
    'regather_adafactor_p2_r4_k2': ('adafactor', 2, 4, 2, True),
    'adafactor_p2_r2_k1': ('adafactor', 2, 2, 1, False)}
EXPERT = 'pipe/moe/wi'  # [E, D, H] = [4, 8, 6]


class Run(tp_optimizers.Run):
    """The MoE pipeline at P x R x K (R x M = 4 micro-batches) trained by the trainer's
    update: unsharded with one optimizer per replica (expert slots joined), or at stage 3
    with one ShardedOptimizer over the replicas' parts, as train_job builds them. Saves as
    tests/test_tensor_parallel_optimizers.py's Run, whose pipeline it replaces."""

    def __init__(self, rule, p, r, k, stage3,  # pylint: disable=super-init-not-called
                 regather=False):
        self.p, self.pipe = p, pipeline(p, r, k, m=4 // r)
        if stage3:
            self.pipe.ShardWeights(per_micro_batch=regather)
            self.variables = self.pipe.weight_shards.parts
            self.optimizer = self.optimizers = ShardedOptimizer(
                rule, self.variables, weight_shapes=self.pipe.weight_shards.shapes,
                expert_parallel=p)
        else:
            self.variables = [{q: v for q, v in copy.items() if v.trainable}
                              for copy in self.pipe.ReplicaVariablesByPath()]
            self.optimizers = [rule.Instantiate() for _ in self.variables]
            for optimizer, variables in zip(self.optimizers, self.variables):
                optimizer.CreateSlots(variables)
            self.optimizer = self.optimizers[0]
            self.optimizer.JoinReplicaSlots(self.variables[0], list(
                zip(self.variables[1:], self.optimizers[1:])))
        self.global_step = tf.Variable(0, dtype=tf.int64)
        self._step = tf.function(self._build_step, autograph=False)

    def _build_step(self, x, y):
        sink = fprop_context.AuxLossSink()
        with fprop_context.training(step=self.global_step), \
                fprop_context.scope(aux_losses=sink):
            loss, grads = self.pipe.ForwardBackward(self.pipe.ReplicaThetas(), x, mz.loss_fn, y)
        norm = guarded_update(loss, [flatten_by_path(g, 'pipe') for g in grads], CLIP,
                              self.optimizers, self.variables, tf.constant(LR, F64),
                              self.global_step, expert_parallel=self.p)
        metrics = sink.metrics()
        return tf.stack([tf.cast(v, F64) for v in (loss, metrics['aux_loss'], metrics['z_loss'],
                                                   norm)])

    def train(self, steps):
        """[step] -> (loss, weighted auxiliary loss, z-loss, global gradient norm)."""
        return np.array([self._step(*inputs(int(self.global_step.numpy())))
                         for _ in range(steps)])

    def restore(self, path):
        """As the trainer restores: stage 3's parts cut from the whole values it reads."""
        checkpoints.restore(self.checkpoint(), path)
        self.pipe.SyncReplicas()
        if not isinstance(self.optimizers, ShardedOptimizer):
            replicas.sync_slots(self.optimizers, self.variables, lambda r, var: (
                expert_parallel.source_replica(r, var, self.p)))
        return self


@pytest.fixture(scope='module', params=sorted(GRID))
def trained(request):
    """(unsharded run, stage-3 run, their steps' figures, the grid point)."""
    name, p, r, k, regather = GRID[request.param]
    rule = OPTIMIZERS[name].Copy().Set(name=name)
    ref, run = Run(rule, p, r, k, False), Run(rule, p, r, k, True, regather)
    return ref, run, ref.train(STEPS), run.train(STEPS), GRID[request.param]


def test_loss_aux_losses_and_norm_at_every_step_equal_the_unsharded_ones(trained):
    _, _, want, got, _ = trained
    assert got.shape == (STEPS, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert (want[:, 1] > 0).all() and (want[:, 3] > CLIP).all()  # aux loss; clipped


def test_checkpoint_weights_and_slots_equal_the_unsharded_ones(trained, tmp_path):
    """Saved whole under the unsharded keys (an expert weight and its slots [E, ...], all
    P ranks joined), every value the unsharded run's within 1e-5."""
    ref, run, _, _, (name, *_) = trained
    want = tp_optimizers.contents(ref.save(tmp_path / 'unsharded'))
    got = tp_optimizers.contents(run.save(tmp_path / 'stage3'))
    assert sorted(got) == sorted(want)
    assert got['model/pipe.Smoe.Swi/.ATTRIBUTES/VARIABLE_VALUE'].shape == (4, 8, 6)
    slot = 'm' if name == 'adam' else 'vr'  # Adafactor's factored row moment
    assert got[f'optimizer/_slots/pipe-moe-wi/{slot}/.ATTRIBUTES/VARIABLE_VALUE'].shape[0] == 4
    for key, value in want.items():  # atol: an Adam moment near 0
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-10, err_msg=key)


def test_an_expert_weight_is_cut_over_the_replicas_holding_its_experts(trained):
    """Replica r holds 1/(R/P) of its experts' weight (the R/P replicas r % P, r % P + P,
    ... hold rank r % P's experts), on its own device; every other weight 1/R. At R = P
    the expert part is the rank's whole weight, flattened."""
    ref, run, _, _, (_, p, r, *_) = trained
    shards = run.pipe.weight_shards
    group = r // p
    for replica, copy in enumerate(run.pipe.ReplicaVariablesByPath()):
        part = copy[EXPERT]
        assert shards.is_part(part) and expert_parallel.is_expert_variable(part)
        assert part.shape == [4 // p * 8 * 6 // group]
        assert part.device == ref.variables[replica][EXPERT].device
        other = copy['pipe/fc2/w']
        assert other.shape == [8 * 5 // r] and not expert_parallel.is_expert_variable(other)
    assert shards.whole(EXPERT).shape == [4, 8, 6]  # as checkpoints save it


def test_a_step_gathers_in_its_tasks_only_when_regathering(trained):
    """Under regather_per_micro_batch the recomputing cells gather their weights inside
    each forward and backward task; else once a step, before the tasks."""
    _, run, _, _, (*_, regather) = trained
    graph = run._step.get_concrete_function(*inputs(0)).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    gathers = [n.name for n in nodes if n.op == 'CollectiveGather']
    in_tasks = [g for g in gathers if '/forward_' in g or '/backward_' in g]
    assert gathers and bool(in_tasks) == regather


def test_sharding_the_weights_frees_the_whole_expert_copies():
    """The whole expert variables (which the pipeline kept for checkpoints:
    expert_parallel.WholeExperts) are dropped too: the parts save the experts whole."""
    pipe = pipeline(2, 4, 1)
    whole = [weakref.ref(v) for copy in pipe.ReplicaVariablesByPath() for v in copy.values()
             if v.trainable]
    assert any(expert_parallel.is_expert_variable(ref()) for ref in whole)
    pipe.ShardWeights()
    gc.collect()
    assert all(ref() is None for ref in whole)


@pytest.mark.parametrize('trained', ['adam_p2_r4_k1'], indirect=True)
def test_a_stage3_p2_checkpoint_restores_into_p1_unsharded_and_back(trained, tmp_path):
    """The stage-3 P=2 R=4 checkpoint restored into P=1 R=2 unsharded (every replica holds
    all 4 experts) saves back the same values, key by key; that run takes a step
    (another K, M), and its checkpoint restored into the stage-3 run saves back the same
    again, each replica's parts cut from it. Last: it moves the shared stage-3 run."""
    _, run, _, _, (name, *_) = trained
    saved = run.save(tmp_path / 'stage3')
    p1 = Run(OPTIMIZERS[name].Copy().Set(name=name), 1, 2, 2, stage3=False).restore(saved)
    tp_optimizers.assert_same(tp_optimizers.contents(p1.save(tmp_path / 'p1')),
                              tp_optimizers.contents(saved), rtol=0)
    p1.train(1)
    stepped = p1.save(tmp_path / 'p1_stepped')
    want = tp_optimizers.contents(stepped)
    run.restore(stepped)
    tp_optimizers.assert_same(tp_optimizers.contents(run.save(tmp_path / 'back')), want,
                              rtol=0)
    expert = want['model/pipe.Smoe.Swi/.ATTRIBUTES/VARIABLE_VALUE']
    for replica, copy in enumerate(run.pipe.ReplicaVariablesByPath()):  # rank r % 2, half
        rank = np.split(expert, 2)[replica % 2].reshape(-1)
        np.testing.assert_array_equal(copy[EXPERT].numpy(), np.split(rank, 2)[replica // 2])
