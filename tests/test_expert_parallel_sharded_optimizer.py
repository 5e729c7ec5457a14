"""ZeRO stages 1 and 2 with expert parallelism in one process: an expert weight's Adam slots
(and at stage 2 its gradient sums) shard over the R/P replicas holding the same experts,
every other weight's over all R.

2 steps of P=2 at R=4 (expert groups of 2 replicas, K=1; stages 1 and 2) and at R=2
(groups of 1: expert slots not sharded, K=2; stage 1), against the same pipeline
unsharded: losses, every replica's weights and slots within 1e-5 (float64; the trainer's
own update, no clipping). The R=4 stage-1 run's
checkpoint holds each expert slot whole ([E, ...]) and resumes into P=1 R=2 unsharded, which
takes the uninterrupted run's steps 3 and 4. tests/test_expert_parallel_resume.py's Run
(unsharded) and inputs; one traced run per grid point, shared by the module.
"""
import numpy as np
import pytest
import tensorflow as tf

from tests.test_expert_parallel_resume import (SLOTS, Run, is_expert, moe_trainer,
                                               saved_expert_slots)
from tfpipe import checkpoints, optimizers
from tfpipe.pipeline.shard_parts import shard_bounds
from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer


class ShardedRun(Run):
    """Run with one ShardedOptimizer over the replicas (as train_job builds it), at stage 2
    (`shard_gradients`) the pipeline's gradient sums deferred to its ReduceScatter."""

    def __init__(self, p, r, k=1, shard_gradients=False):
        super().__init__(p, r, k)
        if shard_gradients:
            self.pipe.DeferGradientSum()
        self.optimizers = ShardedOptimizer(optimizers.Adam.Params().Set(name='adam'),
                                           self.variables, shard_gradients=shard_gradients,
                                           expert_parallel=p)

    def checkpoint(self):
        return checkpoints.make(self.pipe.VariablesByPath(), optimizer=self.optimizers,
                                step=self.global_step)

    def restore(self, path):
        """As the trainer restores: each slot part cut from the whole slot it reads."""
        checkpoints.restore(self.checkpoint(), path)
        self.pipe.SyncReplicas()
        return self

    def slot(self, replica, path, name):
        return self.optimizers.GetSlot(path, name, replica)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """{(stage, P, R, K): (2 losses, [replica state], run)} (stage 0: unsharded), the R=4
    stage-1 run's checkpoint after 2 steps, and its losses and states of steps 3-4."""
    out = {}
    for stage, p, r, k in ((0, 2, 4, 1), (1, 2, 4, 1), (2, 2, 4, 1), (0, 2, 2, 2), (1, 2, 2, 2)):
        run = ShardedRun(p, r, k, shard_gradients=stage == 2) if stage else Run(p, r, k)
        losses = run.train(2)
        out[stage, p, r, k] = (losses, [run.state(i) for i in range(r)], run)
    sharded = out[1, 2, 4, 1][2]
    saved = sharded.checkpoint().save(str(tmp_path_factory.mktemp('ep_zero') / 'ckpt'),
                                      options=checkpoints.io_options())
    later = sharded.train(2)
    return out, saved, (later, [sharded.state(i) for i in range(4)])


@pytest.mark.parametrize('stage,p,r,k', [(1, 2, 4, 1), (2, 2, 4, 1), (1, 2, 2, 2)])
def test_sharded_steps_equal_the_unsharded_ones(runs, stage, p, r, k):
    out, _, _ = runs
    got_losses, got, _ = out[stage, p, r, k]
    want_losses, want, _ = out[0, p, r, k]
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for replica in range(r):
        assert sorted(got[replica]) == sorted(want[replica])
        for key, value in want[replica].items():
            np.testing.assert_allclose(got[replica][key], value, rtol=1e-5, atol=1e-12,
                                       err_msg=f'stage {stage} P={p} R={r} K={k} '
                                       f'replica {replica}: {key}')
    assert np.abs(want[0]['pipe/moe/wi/v']).min() > 0  # the slots took real steps


@pytest.mark.parametrize('stage,p,r,k', [(1, 2, 4, 1), (2, 2, 4, 1), (1, 2, 2, 2)])
def test_an_expert_slot_is_sharded_over_its_r_over_p_replicas(runs, stage, p, r, k):
    """Each replica holds 1/(R/P) of its experts' slots and 1/R of another weight's."""
    run = runs[0][stage, p, r, k][2]
    for replica in range(r):
        expert = run.optimizers.SlotParts('pipe/moe/wi', 'm', replica)
        shared = run.optimizers.SlotParts('pipe/fc2/w', 'm', replica)
        group = r // p  # the replicas holding the same experts
        assert [v.shape.num_elements() for v in expert] == [4 // p * 8 * 6 // group] * group
        assert [v.shape.num_elements() for v in shared] == [8 * 5 // r] * r
        assert {v.device for v in expert} == {
            run.variables[i]['pipe/moe/wi'].device for i in range(replica % p, r, p)}


def test_the_checkpoint_holds_expert_slots_whole(runs):
    shapes = dict(tf.train.list_variables(runs[1]))
    for name in SLOTS:
        assert shapes[f'optimizer/_slots/pipe-moe-wi/{name}/.ATTRIBUTES/VARIABLE_VALUE'] == \
            [4, 8, 6]
        assert shapes[f'optimizer/_slots/pipe-fc2-w/{name}/.ATTRIBUTES/VARIABLE_VALUE'] == \
            [8, 5]


def test_stage_2_sums_an_expert_gradient_over_its_group_only(runs):
    """ReduceScatter at P=2 R=4: replica r keeps its half of the sum over replicas r % 2 and
    r % 2 + 2 of an expert gradient, and its quarter of the sum over all 4 of another."""
    run = runs[0][2, 2, 4, 1][2]
    rng = np.random.default_rng(1)
    grads = [{q: rng.normal(size=v.shape) for q, v in vs.items()} for vs in run.variables]
    parts = tf.function(lambda: run.optimizers.ReduceScatter(
        [{q: tf.constant(g) for q, g in gr.items()} for gr in grads]), autograph=False)()
    for replica in range(4):
        for path, group in (('pipe/moe/wi', [replica % 2, replica % 2 + 2]),
                            ('pipe/fc2/w', [0, 1, 2, 3])):
            pieces = np.split(sum(grads[i][path] for i in group).reshape(-1), len(group))
            np.testing.assert_allclose(parts[replica][path], pieces[group.index(replica)],
                                       rtol=1e-12, err_msg=f'replica {replica}: {path}')


def test_a_sharded_p2_checkpoint_resumes_unsharded_at_p1_and_back(runs, tmp_path):
    """P=2 R=4 sharded, saved after step 2, resumed at P=1 R=2 unsharded: steps 3-4 equal.
    Then back: that run's checkpoint restores into the sharded run (every replica's
    weights and slots as P=1's, experts cut by rank), and both take the same step 5.
    Last in the module: it moves the shared sharded run."""
    out, saved, (losses, reference) = runs
    run = Run(1, 2).restore(saved)
    np.testing.assert_allclose(run.train(2), losses, rtol=1e-5)
    whole = {key: np.concatenate([reference[0][key], reference[1][key]]) if is_expert(key)
             else value for key, value in reference[0].items()}  # replicas 0, 1: a group
    for replica in range(2):
        got = run.state(replica)
        for key, want in whole.items():
            np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-12,
                                       err_msg=f'replica {replica}: {key}')
    back = run.checkpoint().save(str(tmp_path / 'ckpt'), options=checkpoints.io_options())
    sharded = out[1, 2, 4, 1][2].restore(back)
    whole = run.state(0)  # at P=1 every replica holds all experts
    for replica in range(4):
        got = sharded.state(replica)
        for key, want in whole.items():
            if is_expert(key):
                want = np.split(want, 2)[replica % 2]
            np.testing.assert_allclose(got[key], want, rtol=1e-12, atol=1e-15,
                                       err_msg=f'restored replica {replica}: {key}')
    np.testing.assert_allclose(sharded.train(1), run.train(1), rtol=1e-5)


def test_the_trainer_shards_expert_slots_and_restores_them_from_an_unsharded_run(tmp_path):
    """train_job's wiring (lm.pystdlib.TinyMoETransformerLM, Adam, no step taken): an
    unsharded P=2 R=2 trainer's checkpoint restores into a P=2 R=4 trainer at
    sharding='optimizer_states', each replica with its experts' slots, held in halves."""
    held = saved_expert_slots(moe_trainer(tmp_path, 2, 2))
    target = moe_trainer(tmp_path, 2, 4, 'optimizer_states')
    assert isinstance(target.optimizers, ShardedOptimizer)
    assert target.restore_latest() == 0
    for (q, name), want in held.items():
        for r in range(4):
            np.testing.assert_array_equal(target.optimizers.GetSlot(q, name, r).numpy(),
                                          want[r % 2], err_msg=f'replica {r}: {q}/{name}')
            parts = target.optimizers.SlotParts(q, name, r)
            assert [v.shape.num_elements() for v in parts] == [
                stop - start for start, stop in shard_bounds(want[0].size, 2)], q
