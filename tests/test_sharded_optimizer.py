"""Tests for tfpipe.pipeline.sharded_optimizer (optimizer states sharded over replicas).

The reference is the unsharded trainer update: R optimizers, one per replica,
each with whole slots, driven through trainer.guarded_update with
the same gradients (global-norm clipping and the NaN guard included). The
sharded update must leave the same weights on every replica and the same
slots, for every optimizer, with variables that R does not divide.
"""
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import checkpoints, optimizers
from tfpipe.pipeline import replicas
from tfpipe.pipeline.shard_parts import client_bounds, join_rows, shard_bounds
from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
from trainer.guarded_update import guarded_update

# Sizes 15, 5 and 30: R=2 and R=4 divide none of them; 'one' leaves replicas empty.
SHAPES = {'pipe/fc0/w': (3, 5), 'pipe/fc0/b': (5,), 'pipe/fc1/w': (2, 3, 5), 'pipe/one': (1,)}
STEPS = 4
CLIP = 3.0  # below the gradients' norm: every step is clipped
NAN_STEP = 2  # this step's loss is NaN: nothing may change

OPTIMIZERS = {
    'sgd_momentum': optimizers.SGD.Params().Set(momentum=0.9, nesterov=True),
    'adam': optimizers.Adam.Params(),
    'rmsprop': optimizers.RMSProp.Params(),
    'adafactor': optimizers.Adafactor.Params().Set(beta1=0.9),
    'adafactor_unfactored': optimizers.Adafactor.Params().Set(factored=False, beta2=0.99),
}


def _devices(num_replicas):
    """Replica r's variables on CPU r (one cell per replica here)."""
    return [f'/device:CPU:{r}' for r in range(num_replicas)]


def _replica_variables(num_replicas, seed=0):
    rng = np.random.default_rng(seed)
    values = {path: rng.normal(size=shape).astype(np.float32) for path, shape in SHAPES.items()}
    out = []
    for device in _devices(num_replicas):
        with tf.device(device):
            out.append({path: tf.Variable(v, name=path.replace('/', '_'))
                        for path, v in values.items()})
    return out


def _grads(step):
    rng = np.random.default_rng(100 + step)
    return {path: rng.normal(size=shape).astype(np.float32) for path, shape in SHAPES.items()}


def _train(opt_params, num_replicas, sharded, steps=STEPS, replica_variables=None,
           optimizer=None, first_step=0):
    """Guarded updates with the gradients of steps first_step.. first_step + steps - 1;
    returns the replicas' variables and the optimizer(s)."""
    variables = replica_variables or _replica_variables(num_replicas)
    if optimizer is None:
        if sharded:
            optimizer = ShardedOptimizer(opt_params, variables)
        else:
            optimizer = [opt_params.Instantiate() for _ in variables]
            for opt, v in zip(optimizer, variables):
                opt.CreateSlots(v)
    global_step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(loss, grads):
        replica_grads = []
        for device in _devices(num_replicas):
            with tf.device(device):
                replica_grads.append({p: tf.identity(g) for p, g in grads.items()})
        return guarded_update(loss, replica_grads, CLIP, optimizer, variables,
                              tf.constant(0.05), global_step)

    for t in range(first_step, first_step + steps):
        step(tf.constant(np.nan if t == NAN_STEP else 1.0), _grads(t))
    return variables, optimizer


def _slot(optimizer, path, name):
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.GetSlot(path, name).numpy()
    return optimizer[0].GetSlot(path, name).numpy()


def _slot_names(opt_params):
    shapes = opt_params.Instantiate().SlotShapes
    return {path: sorted(shapes(tf.TensorShape(s))) for path, s in SHAPES.items()}


@pytest.mark.parametrize('size,num_shards,expected', [
    (15, 2, [(0, 8), (8, 15)]), (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
    (1, 4, [(0, 1), (1, 1), (1, 1), (1, 1)]), (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)])])
def test_shard_bounds_cover_the_variable_once_with_only_the_last_parts_short(
        size, num_shards, expected):
    assert shard_bounds(size, num_shards) == expected


@pytest.mark.parametrize('num_replicas', [2, 4])
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_sharded_update_equals_the_unsharded_one(name, num_replicas):
    opt_params = OPTIMIZERS[name]
    ref_vars, ref_opt = _train(opt_params, num_replicas, sharded=False)
    vars_, opt = _train(opt_params, num_replicas, sharded=True)
    assert int(opt.iterations.numpy()) == STEPS - 1  # the NaN step was skipped
    for r in range(num_replicas):
        for path in SHAPES:
            np.testing.assert_allclose(vars_[r][path].numpy(), ref_vars[0][path].numpy(),
                                       rtol=1e-5, atol=1e-6, err_msg=f'{path} replica {r}')
    for path, names in _slot_names(opt_params).items():
        assert names, path
        for slot in names:
            np.testing.assert_allclose(_slot(opt, path, slot), _slot(ref_opt, path, slot),
                                       rtol=1e-5, atol=1e-6, err_msg=f'{path}/{slot}')
    # The weights moved: the comparison is not between two untouched copies.
    assert not np.allclose(vars_[0]['pipe/fc0/w'].numpy(), _replica_variables(1)[0][
        'pipe/fc0/w'].numpy())


def test_each_replica_holds_only_its_part_of_the_elementwise_slots():
    opt = ShardedOptimizer(optimizers.Adam.Params(), _replica_variables(4))
    parts = opt.SlotParts('pipe/fc1/w', 'm')  # 30 elements: parts of 8, 8, 8, 6
    assert [int(tf.size(p)) for p in parts] == [8, 8, 8, 6]
    assert [p.device.rsplit('/', 1)[-1] for p in parts] == [f'device:CPU:{r}'
                                                            for r in range(4)]
    factored = ShardedOptimizer(optimizers.Adafactor.Params(), _replica_variables(2))
    # Adafactor's row and column means are whole on every replica (3 + 5 numbers)...
    assert [tuple(p.shape) for p in factored.SlotParts('pipe/fc0/w', 'vr')] == [(3,), (3,)]
    # ...its unfactored second moment is sharded.
    assert [tuple(p.shape) for p in factored.SlotParts('pipe/fc0/b', 'v')] == [(3,), (2,)]


@pytest.mark.parametrize('name', ['adam', 'adafactor'])
def test_checkpoints_move_between_sharded_and_unsharded_under_any_r(tmp_path, name):
    """Two steps at one (R, sharded), two more after a restore into another: equal to four
    steps unsharded, with the slots."""
    opt_params = OPTIMIZERS[name]
    ref_vars, ref_opt = _train(opt_params, 1, sharded=False, steps=STEPS + 2)
    for i, (first, second) in enumerate([((2, True), (1, False)), ((1, False), (4, True)),
                                         ((4, True), (2, True))]):
        vars_a, opt_a = _train(opt_params, first[0], sharded=first[1], steps=2)
        saved = checkpoints.make(vars_a[0], optimizer=opt_a if first[1] else opt_a[0]).write(
            str(tmp_path / f'ckpt_{i}'))
        keys = {k for k, _ in tf.train.list_variables(saved)}
        assert 'optimizer/_slots/pipe-fc0-w/m/.ATTRIBUTES/VARIABLE_VALUE' in keys

        vars_b = _replica_variables(second[0], seed=7)  # other values: the restore must land
        if second[1]:
            opt_b = ShardedOptimizer(opt_params, vars_b)
            restored_opt = opt_b
        else:
            opt_b = [opt_params.Instantiate() for _ in vars_b]
            for opt, v in zip(opt_b, vars_b):
                opt.CreateSlots(v)
            restored_opt = opt_b[0]
        checkpoints.make(vars_b[0], optimizer=restored_opt).read(saved).assert_consumed()
        replicas.sync(vars_b)  # as pipe.SyncReplicas() and the trainer do
        if not second[1]:
            replicas.sync_slots(opt_b, vars_b)

        vars_b, opt_b = _train(opt_params, second[0], sharded=second[1], steps=STEPS,
                               replica_variables=vars_b, optimizer=opt_b, first_step=2)
        for path in SHAPES:
            for r in range(second[0]):
                np.testing.assert_allclose(vars_b[r][path].numpy(), ref_vars[0][path].numpy(),
                                           rtol=1e-5, atol=1e-6,
                                           err_msg=f'{first} -> {second}: {path} replica {r}')
        for path, names in _slot_names(opt_params).items():
            for slot in names:
                np.testing.assert_allclose(_slot(opt_b, path, slot),
                                           _slot(ref_opt, path, slot), rtol=1e-5, atol=1e-6,
                                           err_msg=f'{first} -> {second}: {path}/{slot}')


def test_a_trainer_client_holds_its_part_and_restores_it_from_a_whole_checkpoint(tmp_path):
    """Client r of 2 (no collectives needed to build or restore): its parts of a whole
    checkpoint's slots, and on the chief the whole slots kept for the other clients."""
    from tfpipe.pipeline.across_clients import Peers
    ref_vars, ref_opt = _train(OPTIMIZERS['adam'], 1, sharded=False, steps=2)
    saved = checkpoints.make(ref_vars[0], optimizer=ref_opt[0]).write(str(tmp_path / 'whole'))
    whole = {(path, name): _slot(ref_opt, path, name).reshape(-1)
             for path in SHAPES for name in ('m', 'v')}
    held = []
    for r in range(2):
        opt = ShardedOptimizer(OPTIMIZERS['adam'], _replica_variables(1, seed=7),
                               peers=Peers(2, r))
        assert opt.spans_clients
        checkpoints.make(_replica_variables(1, seed=7)[0], optimizer=opt).read(
            saved).assert_consumed()
        for (path, name), value in whole.items():
            start, stop = shard_bounds(value.size, 2)[r]
            part, = opt.SlotParts(path, name)
            np.testing.assert_array_equal(part.numpy(), value[start:stop])
        sent = opt.ChiefSlots()  # sorted by path, then m before v
        expected = [whole[(path, name)] for path in sorted(SHAPES) for name in ('m', 'v')]
        for got, want in zip(sent, expected):
            np.testing.assert_array_equal(got.numpy().reshape(-1),
                                          want if r == 0 else np.zeros_like(want))
        held.append(opt.SlotBytes())
        if r == 1:  # saved without GatherSlots(): empty slots that no restore accepts
            bad = checkpoints.make(_replica_variables(1)[0], optimizer=opt).write(
                str(tmp_path / 'bad'))
            with pytest.raises(ValueError, match=r'incompatible tensor with shape \(0,\)'):
                checkpoints.make(_replica_variables(1)[0], optimizer=_train(
                    OPTIMIZERS['adam'], 1, sharded=False, steps=0)[1][0]).read(bad)
    # A cluster of one client holds (and saves) whole slots.
    alone = ShardedOptimizer(OPTIMIZERS['adam'], _replica_variables(1), peers=Peers(1, 0))
    assert not alone.spans_clients
    assert alone.GetSlot('pipe/fc1/w', 'm').shape == SHAPES['pipe/fc1/w']
    # Each client holds half of the slots: 15 + 5 + 30 + 1 elements, m and v, 4 bytes each.
    assert [h for h, _ in held] == [4 * 2 * (8 + 3 + 15 + 1), 4 * 2 * (7 + 2 + 15 + 0)]
    assert held[0][1] == held[1][1] == 4 * 2 * 51


@pytest.mark.parametrize('size,count,expert_parallel,expected', [
    (10, 4, 1, [(0, 3), (3, 6), (6, 9), (9, 10)]),
    (16, 4, 2, [(0, 4), (8, 12), (4, 8), (12, 16)]),  # client c: part c // 2 of rank c % 2
    (12, 2, 2, [(0, 6), (6, 12)]),  # one client per rank: its experts' slot unsharded
    (10, 4, 2, [(0, 3), (5, 8), (3, 5), (8, 10)])])
def test_client_bounds_give_every_element_of_a_whole_slot_to_one_client(
        size, count, expert_parallel, expected):
    bounds = client_bounds(size, count, expert_parallel)
    assert bounds == expected
    whole = np.arange(size, dtype=np.float32)
    width = max(stop - start for start, stop in bounds)
    rows = np.stack([np.pad(whole[start:stop], [0, width - (stop - start)])
                     for start, stop in bounds])
    np.testing.assert_array_equal(join_rows(tf.constant(rows), bounds).numpy(), whole)


def test_expert_clients_restore_their_part_of_the_whole_expert_slots(tmp_path):
    """4 clients at P=2 (no collectives needed to build or restore): client c's part of an
    expert weight's Adam slots, saved whole over all 4 experts, is part c // 2 of its
    rank's rows, its non-expert slots 1/4; the chief keeps the whole for the others."""
    from tfpipe.pipeline import expert_parallel
    from tfpipe.pipeline.across_clients import Peers
    rng = np.random.default_rng(3)
    shapes = {'pipe/moe/wi': (4, 3), 'pipe/fc/b': (5,)}  # 4 experts; 2 per client
    whole_vars = {path: tf.Variable(rng.normal(size=shape).astype(np.float32))
                  for path, shape in shapes.items()}
    ref = optimizers.Adam.Params().Instantiate()
    ref.CreateSlots(whole_vars)
    whole = {}
    for path, shape in shapes.items():
        for name in ('m', 'v'):
            whole[(path, name)] = rng.normal(size=shape).astype(np.float32)
            ref.GetSlot(path, name).assign(whole[(path, name)])
    saved = checkpoints.make(whole_vars, optimizer=ref).write(str(tmp_path / 'whole'))
    for c in range(4):
        peers = Peers(4, c, expert_parallel=2)
        local = {'pipe/moe/wi': tf.Variable(tf.zeros([2, 3])), 'pipe/fc/b': tf.Variable(
            tf.zeros([5]))}
        expert_parallel.mark_expert_variable(local['pipe/moe/wi'])
        experts = expert_parallel.ClientExperts(peers, local)
        opt = ShardedOptimizer(OPTIMIZERS['adam'], [local], peers=peers, expert_parallel=2)
        checkpoints.make(local, optimizer=opt).read(saved).assert_consumed()
        np.testing.assert_array_equal(local['pipe/moe/wi'].numpy(),
                                      whole_vars['pipe/moe/wi'].numpy()[2 * (c % 2):][:2])
        for (path, name), value in whole.items():
            start, stop = (client_bounds(12, 4, 2) if path == 'pipe/moe/wi'
                           else shard_bounds(5, 4))[c]
            part, = opt.SlotParts(path, name)
            np.testing.assert_array_equal(part.numpy(), value.reshape(-1)[start:stop])
        sent = opt.ChiefSlots()  # sorted by path, then m before v
        for got, (path, name) in zip(sent, sorted(whole)):
            np.testing.assert_array_equal(got.numpy(), whole[(path, name)] if c == 0
                                          else np.zeros(shapes[path], np.float32))
        # Half of its 2 experts' 6 elements and its part of fc/b's 5, m and v, of the
        # 6 + 5 elements an unsharded client holds.
        held, unsharded = opt.SlotBytes()
        assert (held, unsharded) == (4 * 2 * (3 + [2, 2, 1, 0][c]), 4 * 2 * (6 + 5))
        # Only the weight travels as the client's rows: its slots save whole by themselves.
        assert [part.path for part in experts.parts] == ['pipe/moe/wi']
