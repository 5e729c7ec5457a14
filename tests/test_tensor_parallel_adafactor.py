"""Adafactor with tensor-parallel cells: the T=1 update, shard by shard.

Adafactor reads statistics of the whole weight (row and column means of g^2,
the RMS of the update and of the weight); with a weight split over a cell's T
devices they are reduced over the shards (tfpipe/split_statistics.py). The
pipeline of tests/test_tensor_parallel_optimizers.py (column-parallel fc0, the
ParallelMLP pair, row-parallel fc3: both split axes, split and whole biases)
in float64 is trained 3 steps by the trainer's update (guarded_update) with
Adafactor at T=2 and T=4, also with `shard_optimizer_states` over R=2
replicas, and must save the T=1 run's checkpoint key by key within 1e-5
relative: weights, and the slots whole under the whole weight's key (`vr`,
`vc` of the whole shape), for beta1 0 and > 0, factored and not, fixed beta2
or the decay schedule, multiply_by_parameter_scale on. Checkpoints move
between T=1, 2 and 4 (sharded or not) exactly and continue as the T=1 run.
One LM step at T=4 (an embedding and a vocabulary-parallel softmax split by
rows, unevenly, attention and MLP weights by rows and columns) equals T=1's. Only partial
sums cross devices in the traced update; inspect_model's prediction places each
device's slot bytes exactly.

Each Run (rule, T, K, R, sharded) is built, traced and trained once per module
(`runs`); the restore tests restore into Runs trained there, which is also a check
that a restore overwrites every value (the restored checkpoint is saved back
exactly).
"""
import numpy as np
import pytest
import tensorflow as tf

from tests import tensor_parallel_lm_task as lmt
from tests import tensor_parallel_mlp as mlp
from tests.test_tensor_parallel_optimizers import LR, Run, assert_same, contents, pipeline
from tfpipe import fprop_context, optimizers
from tfpipe.base_layer import flatten_by_path
from tfpipe.pipeline import partition
from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
from tfpipe.tuning import memory_model, tensor_parallel_memory
from tfpipe.tuning.profile import Affine, LayerProfile, slot_bytes_of

CONFIGS = {'plain': {},  # beta1 0, factored, beta2 from the decay schedule
           'momentum': {'beta1': 0.9, 'beta2': 0.99},
           'unfactored': {'beta1': 0.5, 'factored': False}}
SLOTS = 'optimizer/_slots/{}/{}/.ATTRIBUTES/VARIABLE_VALUE'


def adafactor(config):
    return optimizers.Adafactor.Params().Set(name='adafactor', **CONFIGS[config])


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """runs(config, t, k, r, sharded): (that Run, {2: its checkpoint after 2 steps, 3: after
    3}), trained once per module. Tracing a Run's step is most of its cost, so the tests
    that restore a checkpoint restore it into a Run already trained here (which must then
    overwrite every value) rather than build and trace another."""
    directory, out = tmp_path_factory.mktemp('tp_adafactor'), {}

    def get(config, t, k, r, sharded):
        key = (config, t, k, r, sharded)
        if key not in out:
            run = Run(t=t, k=k, r=r, sharded=sharded, rule=adafactor(config))
            name = '_'.join(map(str, key))
            run.train(2)
            step2 = run.save(directory / f'{name}_2')
            run.train(1)
            out[key] = run, {2: step2, 3: run.save(directory / f'{name}_3')}
        return out[key]
    return get


def t1(runs, config):
    """The T=1 unsharded run's checkpoints after 2 and 3 steps."""
    return runs(config, 1, 1, 1, False)[1]


# Every pair of values of two of config, T, K and (R, sharded) that the tests ever covered:
# each (T, sharded) with beta1 0 and > 0, each config at T=2 (momentum's in the restore
# test's source) and each T at K=1 and 2. The restores below go into the Runs these train.
THREE_STEPS = [('plain', 4, 1, 1, False), ('plain', 2, 2, 2, True),
               ('momentum', 4, 2, 1, False), ('momentum', 4, 1, 2, True),
               ('unfactored', 2, 1, 1, False)]


@pytest.mark.parametrize('config,t,k,r,sharded', THREE_STEPS)
def test_three_steps_save_the_t1_checkpoint(runs, config, t, k, r, sharded):
    saved = contents(runs(config, t, k, r, sharded)[1][3])
    assert not any('shard' in key for key in saved), sorted(saved)
    if config != 'unfactored':  # factored moments of the whole shapes, under whole keys
        assert saved[SLOTS.format('pipe-fc0-w', 'vr')].shape == (6,)
        assert saved[SLOTS.format('pipe-fc0-w', 'vc')].shape == (8,)
        assert saved[SLOTS.format('pipe-fc3-w', 'vr')].shape == (8,)
    assert_same(saved, contents(t1(runs, config)[3]), rtol=1e-5)


def test_factored_slots_split_like_the_weight_or_held_by_every_shard():
    """Column-split fc0/w [6, 8]: vr [6] on both devices, vc and m halved; row-split
    fc3/w [8, 5]: vr halved, vc [5] on both; each on its shard's device."""
    pipe = pipeline(t=2, k=1, r=1)
    variables = {p: v for p, v in pipe.VariablesByPath().items() if v.trainable}
    optimizer = adafactor('momentum').Instantiate()
    optimizer.CreateSlots(variables)
    expected = {'fc0/w': {'vr': [6], 'vc': [4], 'm': [6, 4]},
                'fc3/w': {'vr': [4], 'vc': [5], 'm': [4, 5]}}
    for layer, shapes in expected.items():
        for t in range(2):
            path = f'pipe/{layer}_shard{t}'
            for name, shape in shapes.items():
                slot = optimizer.GetSlot(path, name)
                assert slot.shape.as_list() == shape, (path, name)
                assert slot.device == variables[path].device, (path, name)
    assert variables['pipe/fc0/w_shard0'].device != variables['pipe/fc0/w_shard1'].device


@pytest.mark.parametrize('t,k,r,sharded', [(1, 1, 1, False), (4, 2, 1, False),
                                           (4, 1, 2, True)])
def test_t2_checkpoint_restores_exactly_and_continues_as_t1(runs, tmp_path, t, k, r, sharded):
    """A T=2 (K=2, unsharded) run's checkpoint after 2 'momentum' steps (the T=1 run's)."""
    t2_step2 = runs('momentum', 2, 2, 1, False)[1][2]
    assert_same(contents(t2_step2), contents(t1(runs, 'momentum')[2]), rtol=1e-5)
    target = runs('momentum', t, k, r, sharded)[0].restore(t2_step2)
    assert_same(contents(target.save(tmp_path / 'restored')), contents(t2_step2), rtol=0)
    target.train(1)
    assert_same(contents(target.save(tmp_path / 'next')), contents(t1(runs, 'momentum')[3]),
                rtol=1e-5)


def test_t1_checkpoint_continues_at_t4(runs, tmp_path):
    target = runs('plain', 4, 1, 1, False)[0].restore(t1(runs, 'plain')[2])
    target.train(1)
    assert_same(contents(target.save(tmp_path / 'next')), contents(t1(runs, 'plain')[3]),
                rtol=1e-5)


def adafactor_lm_step(t):
    """(loss, whole weights) after one Adafactor step of the LM at T=t. The attention's key
    bias has no gradient but rounding noise (~1e-17), which Adafactor's g / sqrt(g^2 +
    epsilon1) scales up to an update: epsilon1 1e-20 keeps noise a noise-sized update."""
    task = lmt.lm_task(t)
    batch = lmt.lm.generated_batch()
    variables = {p: v for p, v in task.VariablesByPath().items() if v.trainable}
    optimizer = adafactor('momentum').Set(epsilon1=1e-20).Instantiate()
    optimizer.CreateSlots(variables)

    @tf.function(autograph=False)
    def step():
        with fprop_context.training(step=lmt.STEP):
            loss, grads = task.pipe.ForwardBackward(
                task.theta['pipe'], task.PipelineInputs(batch), task.PerExampleLoss,
                task.PipelineTargets(batch))
        optimizer.Apply(tf.constant(0.01, tf.float64),
                        flatten_by_path({'pipe': grads}, task.path), variables)
        return loss

    loss = step().numpy()
    return loss, lmt.whole(task, task.VariablesByPath())


def test_lm_step_at_t4_equals_t1():
    """T=4 splits the vocabulary (258) unevenly: 65, 65, 64, 64 rows per shard."""
    (loss, weights), (ref_loss, ref_weights) = adafactor_lm_step(4), adafactor_lm_step(1)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-9)
    assert sorted(weights) == sorted(ref_weights)
    for path in ref_weights:
        np.testing.assert_allclose(weights[path], ref_weights[path], rtol=1e-7, atol=1e-10,
                                   err_msg=path)


def test_some_shards_of_a_split_weight_are_refused_sharded_or_not():
    """Statistics over the shards given: without every shard the update would not be the
    T=1 one."""
    pipe = pipeline(t=2, k=1, r=2)
    variables = [{p: v for p, v in copy.items() if v.trainable and p != 'pipe/fc3/w_shard1'}
                 for copy in pipe.ReplicaVariablesByPath()]
    message = (r'^Adafactor needs statistics of whole weights and pipe/fc3/w is split over 2 '
               r'devices of which only some shards are given: pass every shard variable')
    with pytest.raises(ValueError, match=message):
        adafactor('plain').Instantiate().CreateSlots(variables[0])
    with pytest.raises(ValueError, match=message):
        ShardedOptimizer(adafactor('plain'), variables)
    optimizers.Adam.Params().Set(name='adam').Instantiate().CreateSlots(variables[0])


def test_memory_prediction_places_each_devices_adafactor_slots():
    """inspect_model's prediction (tensor_parallel_memory.predict with the trainer's
    optimizer) of each device's slot bytes at T=2 and T=4, from the T=1 layers' slot
    bytes, equals the slots the optimizer creates there; the variables' shares alone
    would miss the factored moment every shard of a weight holds whole."""
    rule = adafactor('plain')
    whole = mlp.tp_pipeline(1, 2)
    zero = Affine(0.0, 0.0)
    profiles = [LayerProfile(layer.params.name, zero, zero, 0.0,
                             slot_bytes_of(rule, layer.trainable_variables), 0.0, 0.0)
                for cell in whole.cells for layer in cell.layers]
    for t in (2, 4):
        pipe = mlp.tp_pipeline(t, 2)
        optimizer = rule.Instantiate()
        optimizer.CreateSlots({p: v for p, v in pipe.VariablesByPath().items() if v.trainable})
        measured = {}
        for slot in optimizer.slot_variables:
            measured[slot.device] = (measured.get(slot.device, 0)
                                     + slot.shape.num_elements() * slot.dtype.size)
        layouts = [memory_model.CellLayout(cell.device, start, stop, cell.recompute)
                   for cell, (start, stop) in zip(pipe.cells,
                                                  partition.cell_ranges(pipe.balance))]
        predicted = {d.device: d.slots for d in tensor_parallel_memory.predict(
            pipe, profiles, [layouts], 1.0, optimizer=rule).devices[0]}
        assert predicted == pytest.approx(measured, rel=1e-9), t
        by_weights = {d.device: d.slots for d in tensor_parallel_memory.predict(
            pipe, profiles, [layouts], 1.0).devices[0]}
        shard = pipe.cells[0].shard_devices[-1]
        if t == 4:  # 372 bytes of 608: factored moments are not 1/T of the layer's
            assert by_weights[shard] < 0.85 * measured[shard]


def test_only_vectors_and_scalars_cross_devices_in_the_update():
    """The traced update at T=2 computes each shard's arithmetic on its own device: an op
    placed on one device reads from another only partial sums (rank <= 1: a row or column
    mean, an RMS), never a gradient, weight or slot of a shard."""
    pipe = pipeline(t=2, k=1, r=1)
    variables = {p: v for p, v in pipe.VariablesByPath().items() if v.trainable}
    optimizer = adafactor('momentum').Instantiate()
    optimizer.CreateSlots(variables)

    @tf.function(autograph=False)
    def update():
        grads = {}
        for path, var in variables.items():
            with tf.device(var.device):
                grads[path] = tf.sin(var.read_value())
        optimizer.Apply(tf.constant(LR, tf.float64), grads, variables)

    graph = update.get_concrete_function().graph
    index = lambda op: tf.DeviceSpec.from_string(op.device).device_index  # noqa: E731
    crossings = [(op.name, x.shape.rank) for op in graph.get_operations() if op.device
                 for x in op.inputs if x.op.device and index(x.op) != index(op)]
    assert crossings, 'the shards share no statistics'
    assert all(rank is not None and rank <= 1 for _, rank in crossings), crossings
    assert {index(op) for op in graph.get_operations() if op.type == 'Rsqrt'} == {0, 1}
