"""A run with expert parallelism resumes at another P: optimizer slots included.

Adam's m and v of an expert weight live beside its slice, on the replicas 0..P-1 that
hold its experts. The checkpoint must hold them whole ([E, ...] under the slot's key,
as the weight), and a restore must give every replica the slots of the experts it
holds. One chain shows it: 2 steps at P=2 R=2, a checkpoint, and 2 more steps from it at
P=1 R=2 and at P=2 R=4 (replicas 2 and 3 take their slots from replicas 0 and 1) against
the 4 uninterrupted steps at P=2 R=2: every loss, and every replica's weights and slots,
within 1e-5. float64, the trainer's own update (guarded_update), join (JoinReplicaSlots)
and sync after a restore (replicas.sync_slots); tests/test_expert_parallel_pipeline.py's
body (capacity drops nothing, so any P takes the same step).
"""
import functools

import numpy as np
import pytest
import tensorflow as tf

from tests import model_zoo as mz
from tests.test_expert_parallel_pipeline import EXPERT_WEIGHTS, F64, pipeline
from tfpipe import checkpoints, fprop_context, optimizers
from tfpipe.base_layer import flatten_by_path
from tfpipe.pipeline import expert_parallel, replicas
from trainer.guarded_update import guarded_update

LR = 0.01
SLOTS = ('m', 'v')


class Run:
    """A P x R pipeline (K cells) with one Adam per replica, joined and synced as the trainer
    does; the inputs of each step are fixed by the global step, as a resumed trainer's."""

    def __init__(self, p, r, k=1):
        # R x M = 4 micro-batches at every R, as the trainer keeps them when R changes
        # (trainer/batch_split.py): capacity and the auxiliary losses are per micro-batch.
        self.p, self.pipe = p, pipeline(p, r, k, m=4 // r)
        self.variables = [{q: v for q, v in copy.items() if v.trainable}
                          for copy in self.pipe.ReplicaVariablesByPath()]
        self.optimizers = [optimizers.Adam.Params().Set(name='adam').Instantiate()
                           for _ in self.variables]
        for optimizer, variables in zip(self.optimizers, self.variables):
            optimizer.CreateSlots(variables)
        self.optimizers[0].JoinReplicaSlots(self.variables[0], list(
            zip(self.variables[1:], self.optimizers[1:])))
        self.global_step = tf.Variable(0, dtype=tf.int64)
        self._step = tf.function(self._build_step, autograph=False)

    def _build_step(self, x, y):
        with fprop_context.training(step=self.global_step):
            loss, grads = self.pipe.ForwardBackward(self.pipe.ReplicaThetas(), x, mz.loss_fn, y)
        guarded_update(loss, [flatten_by_path(g, 'pipe') for g in grads], None,
                       self.optimizers, self.variables, tf.constant(LR, F64), self.global_step)
        return loss

    def train(self, steps):
        return [float(self._step(*inputs(int(self.global_step.numpy())))) for _ in range(steps)]

    def checkpoint(self):
        return checkpoints.make(self.pipe.VariablesByPath(), optimizer=self.optimizers[0],
                                step=self.global_step)

    def restore(self, path):
        checkpoints.restore(self.checkpoint(), path)
        self.pipe.SyncReplicas()
        replicas.sync_slots(self.optimizers, self.variables, functools.partial(
            expert_parallel.source_replica, expert_parallel=self.p))
        return self

    def state(self, replica):
        """{path: value} of the replica's weights and its Adam slots ('path/m', 'path/v')."""
        out = {}
        for path, var in self.variables[replica].items():
            out[path] = var.numpy()
            for name in SLOTS:
                out[f'{path}/{name}'] = self.slot(replica, path, name).numpy()
        return out

    def slot(self, replica, path, name):
        """The replica's whole slot `name` of `path`."""
        return self.optimizers[replica].GetSlot(path, name)


def inputs(step):
    rng = np.random.default_rng(step)
    return (tf.constant(rng.normal(size=[16, 6]), F64),
            tf.constant(rng.integers(0, 5, size=[16]), tf.int32))


def is_expert(key):
    """Whether a state key is an expert weight of the MoE layer or one of its slots."""
    parts = key.split('/')
    return parts[1] == 'moe' and parts[2] in EXPERT_WEIGHTS


@pytest.fixture(scope='module')
def chain(tmp_path_factory):
    """(uninterrupted losses, its final replicas' states, its checkpoint after 2 steps,
    {(P, R): (resumed losses of steps 3-4, the resumed run)})."""
    reference = Run(2, 2)
    losses = reference.train(2)
    saved = reference.checkpoint().save(str(tmp_path_factory.mktemp('ep_resume') / 'ckpt'),
                                        options=checkpoints.io_options())
    losses += reference.train(2)
    resumed = {}
    for p, r in ((1, 2), (2, 4)):
        run = Run(p, r).restore(saved)
        resumed[p, r] = (run.train(2), run)
    return losses, [reference.state(i) for i in range(2)], saved, resumed


def test_the_checkpoint_holds_expert_slots_whole(chain):
    _, _, saved, _ = chain
    shapes = dict(tf.train.list_variables(saved))
    for name in SLOTS:
        assert shapes[f'optimizer/_slots/pipe-moe-wi/{name}/.ATTRIBUTES/VARIABLE_VALUE'] == \
            [4, 8, 6]
        assert shapes[f'optimizer/_slots/pipe-moe-bo/{name}/.ATTRIBUTES/VARIABLE_VALUE'] == \
            [4, 8]
    assert shapes['model/pipe.Smoe.Swi/.ATTRIBUTES/VARIABLE_VALUE'] == [4, 8, 6]


@pytest.mark.parametrize('p,r', [(1, 2), (2, 4)])
def test_resumed_at_another_p_takes_the_uninterrupted_steps(chain, p, r):
    """Losses of steps 3 and 4, and every replica's weights and Adam slots after them
    (experts cut to what the replica of the P=2 reference holding them has)."""
    losses, reference, _, resumed = chain
    got_losses, run = resumed[p, r]
    np.testing.assert_allclose(got_losses, losses[2:], rtol=1e-5)
    whole = {key: np.concatenate([reference[0][key], reference[1][key]]) if is_expert(key)
             else value for key, value in reference[0].items()}  # replicas 0, 1: P=2's group
    for replica in range(r):
        got = run.state(replica)
        assert sorted(got) == sorted(whole)
        for key, want in whole.items():
            if is_expert(key):  # the experts of member replica % P of its group
                want = np.split(want, p)[replica % p]
            np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-12,
                                       err_msg=f'P={p} R={r} replica {replica}: {key}')
    assert np.abs(whole['pipe/moe/wi/v']).min() > 0  # every expert's slots were compared


def moe_trainer(train_dir, p, r, sharding='none'):
    """The trainer of lm.pystdlib.TinyMoETransformerLM (Adam) at P x R, writing `train_dir`."""
    import model_registry
    from trainer import runtime_options, train_job
    params = model_registry.get_params('lm.pystdlib.TinyMoETransformerLM')
    params.task.pipeline.Set(num_replicas=r, expert_parallel=p)
    params.task.train.sharding = sharding
    return train_job.Trainer(params, str(train_dir), runtime_options.RuntimeOptions(max_steps=1))


def saved_expert_slots(trainer):
    """Gives the unsharded `trainer`'s slots distinct values and saves them (no step taken):
    {(expert weight's path, slot name): [each replica's slot]}."""
    experts = sorted(q for q, v in trainer.variables.items()
                     if expert_parallel.is_expert_variable(v))
    assert experts and all('/moe/' in q for q in experts)
    rng = np.random.default_rng(3)
    for optimizer in trainer.optimizers:
        for slot in optimizer.slot_variables:
            slot.assign(rng.normal(size=slot.shape).astype(slot.dtype.as_numpy_dtype))
    trainer.save(1)
    return {(q, name): [o.GetSlot(q, name).numpy() for o in trainer.optimizers]
            for q in experts for name in SLOTS}


def test_the_trainer_saves_expert_slots_whole_and_gives_each_replica_its_own(tmp_path):
    """The trainer's own wiring (lm.pystdlib.TinyMoETransformerLM, Adam, no step taken):
    distinct slots on the 2 replicas of a P=2 trainer, saved by it, restore whole into a
    P=1 trainer and, at P=2 R=4, each replica gets the slots of its experts."""
    want = saved_expert_slots(moe_trainer(tmp_path, 2, 2))
    whole, by_replica = moe_trainer(tmp_path, 1, 2), moe_trainer(tmp_path, 2, 4)
    for target in (whole, by_replica):
        assert target.restore_latest() == 0  # ckpt-1 holds global step 0: none was taken
    for (q, name), held in want.items():
        for optimizer in whole.optimizers:
            np.testing.assert_array_equal(optimizer.GetSlot(q, name).numpy(),
                                          np.concatenate(held), err_msg=f'P=1 {q}/{name}')
        for r, optimizer in enumerate(by_replica.optimizers):
            np.testing.assert_array_equal(optimizer.GetSlot(q, name).numpy(), held[r % 2],
                                          err_msg=f'P=2 R=4 replica {r}: {q}/{name}')
