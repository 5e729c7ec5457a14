"""Tensor parallelism: a step with T devices per cell is the T=1 step.

The MLP of tests/tensor_parallel_mlp.py (Megatron's layers, float64, so that
1e-5 relative tests the mathematics). Loss, gradients and weights after an SGD
step are compared as whole weights (shards concatenated) with the same pipeline
at T=1, K=1, R=1, on the 8 logical CPUs of conftest.py: every other (T, K, R)
with T in {1, 2, 4}, K in {1, 2}, R in {1, 2} and R*K*T <= 8 (all but T=4, K=2,
R=2, which tests/test_tensor_parallel_16.py runs on 16), and every recompute policy x
schedule x executor at T=2, K=2 and T=4, K=1 as a covering design (POLICIES):
every pair of values of any two of (T and K), recompute, schedule and executor
is stepped, e.g. each (T, K) with every policy, both schedules and both
executors, and each policy with both schedules and both executors.

Tracing a step is most of a test's time, so each grid point's step is traced and
run once per process (`stepped`) and every test of that point reads it: the
equality tests, the placement test (its traced graph) and the memory test (its
gradients' devices).
"""
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tests.tensor_parallel_mlp import (STEP, assert_same, check, check_step, inputs,
                                       reference, step, tp_body, tp_pipeline, whole)
from tfpipe import checkpoints, fprop_context
from tfpipe.base_layer import flatten_by_path
from tfpipe.pipeline import partition

# T=1, K=1, R=1 is the reference itself (tests/tensor_parallel_mlp.py's `reference`).
CORNERS = [(t, k, r) for t in (1, 2, 4) for k in (1, 2) for r in (1, 2)
           if t * k * r <= 8 and (t, k, r) != (1, 1, 1)]
# (T, K, recompute, schedule, cell_functions): every pair of values of any two of the four
# axes (T, K together) in 8 steps, not the 24 of the full product: tracing a step is most
# of a test's time. T=2, K=2 takes the four fill_drain steps the placement test reads.
POLICIES = [(2, 2, 'always', 'fill_drain', True), (2, 2, 'always', 'fill_drain', False),
            (2, 2, 'never', 'fill_drain', True), (2, 2, 'never', 'fill_drain', False),
            (2, 2, 'except_last', '1f1b', False), (4, 1, 'always', '1f1b', False),
            (4, 1, 'never', '1f1b', True), (4, 1, 'except_last', 'fill_drain', True)]

_stepped = {}


def stepped(t, k, r=1, recompute='always', schedule='fill_drain', cell_functions=True):
    """(pipeline, its `step`) at one grid point, built, traced and run once per process."""
    key = (t, k, r, recompute, schedule, cell_functions)
    if key not in _stepped:
        pipe = tp_pipeline(t, k, r, recompute=recompute, schedule=schedule,
                           cell_functions=cell_functions)
        _stepped[key] = pipe, step(pipe, replica_thetas=r > 1)
    return _stepped[key]


@pytest.mark.parametrize('t,k,r', CORNERS)
def test_step_equals_t1(t, k, r):
    check_step(stepped(t, k, r)[1])


@pytest.mark.parametrize('t,k,recompute,schedule,cell_functions', POLICIES)
def test_every_policy_schedule_and_executor(t, k, recompute, schedule, cell_functions):
    check_step(stepped(t, k, recompute=recompute, schedule=schedule,
                       cell_functions=cell_functions)[1])


def train_and_save(pipe, directory):
    """One Adam step, then a checkpoint of the weights and the optimizer's slots."""
    optimizer = tfpipe.optimizers.Adam.Params().Set(name='adam').Instantiate()
    variables = {p: v for p, v in pipe.VariablesByPath().items() if v.trainable}
    optimizer.CreateSlots(variables)
    x, y = inputs()

    @tf.function(autograph=False)
    def run():
        with fprop_context.training(step=STEP):
            _, grads = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
        optimizer.Apply(tf.constant(0.01, tf.float64), flatten_by_path(grads, 'pipe'),
                        variables)
    run()
    path = checkpoints.make(pipe.VariablesByPath(), optimizer=optimizer).save(
        str(directory), options=checkpoints.io_options())
    return path, optimizer, variables


def restored(pipe, path):
    optimizer = tfpipe.optimizers.Adam.Params().Set(name='adam').Instantiate()
    variables = {p: v for p, v in pipe.VariablesByPath().items() if v.trainable}
    optimizer.CreateSlots(variables)
    checkpoints.restore(checkpoints.make(pipe.VariablesByPath(), optimizer=optimizer),
                        path)
    pipe.SyncReplicas()
    return optimizer, variables


def whole_state(pipe, optimizer, variables):
    """Weights and Adam's m, v as whole values by path."""
    state = {f'{p}': v.numpy() for p, v in pipe.VariablesByPath().items()}
    out = {f'w:{k}': v for k, v in whole(pipe, state).items()}
    for name in ('m', 'v'):
        slots = {p: optimizer.GetSlot(p, name).numpy() for p in variables}
        out.update({f'{name}:{k}': v for k, v in whole(pipe, slots).items()})
    return out


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    """saved(t, k, r): (checkpoint path, whole state) of that pipeline after one Adam step,
    trained and saved once per module (two tests restore the same source)."""
    directory, out = tmp_path_factory.mktemp('tp_checkpoints'), {}

    def get(t, k, r):
        if (t, k, r) not in out:
            source = tp_pipeline(t, k, r)
            path, *state = train_and_save(source, directory / f't{t}k{k}r{r}')
            out[t, k, r] = path, whole_state(source, *state)
        return out[t, k, r]
    return get


@pytest.mark.parametrize('source,loaded', [((2, 2, 1), (1, 1, 1)), ((2, 2, 1), (4, 1, 2)),
                                           ((1, 2, 2), (2, 2, 1)), ((4, 1, 1), (2, 2, 2))])
def test_checkpoint_restores_into_any_t_k_r(saved, source, loaded):
    path, state = saved(*source)
    target = tp_pipeline(*loaded)
    got = whole_state(target, *restored(target, path))
    assert sorted(got) == sorted(state)
    for key in state:
        np.testing.assert_array_equal(got[key], state[key], err_msg=key)
    names = {n for n, _ in tf.train.list_variables(path)}
    assert 'model/pipe.Smlp.Sfc1.Sw/.ATTRIBUTES/VARIABLE_VALUE' in names
    assert 'optimizer/_slots/pipe-mlp-fc1-w/m/.ATTRIBUTES/VARIABLE_VALUE' in names
    assert not any('shard' in n for n in names), names
    if loaded[2] > 1:  # the mirrors got replica 0's restored weights
        for path, var in target.ReplicaVariablesByPath()[1].items():
            np.testing.assert_array_equal(var.numpy(),
                                          target.VariablesByPath()[path].numpy())


@pytest.mark.parametrize('cell_functions', [True, False], ids=['functions', 'unrolled'])
@pytest.mark.parametrize('recompute', ['always', 'never'])
def test_each_shard_computes_and_sums_on_its_device(recompute, cell_functions):
    """Read from the traced step (functions included) whose numbers test_every_policy_...
    checks: every device of every cell runs forward and gradient matmuls and collectives,
    nothing the pipeline built is unplaced, and each shard's weight gradient sum comes out
    on the shard's device."""
    from tests.test_pipeline_placement import derived_gradient, phase_of, pipeline_nodes
    from tfpipe.tuning import trace
    pipe, result = stepped(2, 2, recompute=recompute, cell_functions=cell_functions)
    nodes = pipeline_nodes(result.function)
    unplaced = [n.name for n in nodes if not n.device and not derived_gradient(n)]
    assert not unplaced, unplaced[:10]
    seen = {(trace.device_index(n.device), phase_of(n.name), n.op) for n in nodes if n.device}
    for device in ('CPU:0', 'CPU:1', 'CPU:2', 'CPU:3'):
        assert (device, 'forward', 'MatMul') in seen, device
        assert (device, 'backward', 'MatMul') in seen, device
        assert any(d == device and op == 'CollectiveReduce' for d, _, op in seen), device
    shards = [(v, g) for v, g, _ in result.placed.values() if trace.device_index(v) in ('CPU:1', 'CPU:3')]
    assert len(shards) == 6  # fc0 w, b; mlp fc1 w, b; mlp fc2 w; fc3 w: one shard each
    for v, g, _ in result.placed.values():
        assert trace.device_index(g) == trace.device_index(v), (v, g)
    assert [cell.shard_devices for cell in pipe.cells] == [
        tuple(f'/job:localhost/replica:0/task:0/device:CPU:{i}' for i in pair)
        for pair in ((0, 1), (2, 3))]


def state_bytes_by_device(pipe, result):
    """Measured: the bytes of the weights, Adam's slots and the gradient sums that the
    traced step (`result`) leaves on each device (a gradient's device read from the
    graph)."""
    optimizer = tfpipe.optimizers.Adam.Params().Set(name='adam').Instantiate()
    variables = {p: v for p, v in pipe.VariablesByPath().items() if v.trainable}
    optimizer.CreateSlots(variables)
    out = {}
    for var in list(variables.values()) + optimizer.slot_variables:
        out[var.device] = out.get(var.device, 0) + var.shape.num_elements() * var.dtype.size
    for _, device, size in result.placed.values():
        out[device] += size
    return out


def predicted_state_by_device(pipe):
    """What inspect_model predicts (weights + gradient sums + slots) from T=1 profiles."""
    from tfpipe.tuning import memory_model, tensor_parallel_memory
    from tfpipe.tuning.profile import Affine, LayerProfile
    zero = Affine(0.0, 0.0)
    profiles = [LayerProfile(p.name, zero, zero, 8 * p.cls.NumParams(p), 16 * p.cls.NumParams(p),
                             0.0, 0.0) for p in pipe.params.body]  # float64, Adam: m and v
    layouts = [memory_model.CellLayout(cell.device, start, stop, cell.recompute)
               for cell, (start, stop) in zip(pipe.cells, partition.cell_ranges(pipe.balance))]
    shares = tensor_parallel_memory.shares(pipe)
    devices = memory_model.predict(tensor_parallel_memory.home_profiles(profiles, shares),
                                   layouts, 1.0, 1, 'fill_drain')
    devices += tensor_parallel_memory.shard_memory(
        profiles, shares, layouts, [cell.shard_devices for cell in pipe.cells], 1.0, 1,
        'fill_drain')
    return {d.device: d.weights + d.gradient_sums + d.slots for d in devices}


def test_split_state_falls_to_one_over_t_as_predicted():
    whole = stepped(1, 2)[0]
    t1 = state_bytes_by_device(*stepped(1, 2))
    assert predicted_state_by_device(whole) == pytest.approx(t1, rel=0.15)
    for t in (2, 4):
        pipe = stepped(t, 2)[0]
        measured = state_bytes_by_device(*stepped(t, 2))
        assert predicted_state_by_device(pipe) == pytest.approx(measured, rel=0.15)
        assert sorted(measured) == sorted(d for cell in pipe.cells for d in cell.shard_devices)
        for cell, home in zip(pipe.cells, whole.cells):
            # The split layers' state (weights, sums, m, v: 4 x 8 bytes per float64) is
            # whole on the T=1 device and 1/T of it on each of the T devices; the
            # row-parallel biases and the plain Dense stay whole on the home device.
            split = sum(32 * v.shape.num_elements() for layer in home.layers
                        for path, v in layer.VariablesByPath().items()
                        if path.split('/')[1] in ('fc0', 'mlp', 'fc3')
                        and not path.endswith(('fc2/b', 'fc3/b')))
            assert measured[cell.shard_devices[-1]] == split // t, (cell.index, t)
            assert t1[home.device] - measured[cell.device] == split - split // t


def tape_step(pipe):
    """FProp under an outer tape: outputs, loss and gradients as whole weights."""
    x, y = inputs()

    @tf.function(autograph=False)
    def run():
        with fprop_context.training(step=STEP):
            with tf.GradientTape() as tape:
                out = pipe.FProp(pipe.theta, x)
                loss = tf.reduce_sum(mz.loss_fn(out, y)) / 10
        return out, loss, tape.gradient(loss, pipe.theta)
    out, loss, grads = run()
    grads = {p: g.numpy() for p, g in flatten_by_path(grads, 'pipe').items()}
    return out.numpy(), loss.numpy(), whole(pipe, grads)


_tape_reference = {}


def tape_reference():
    """The T=1 pipeline's tape step and evaluation output, traced once per module."""
    if not _tape_reference:
        ref_pipe = tp_pipeline(1, 1)
        _tape_reference['step'] = tape_step(ref_pipe)
        x, _ = inputs()
        with fprop_context.evaluation():
            _tape_reference['eval'] = tf.function(ref_pipe.FProp)(ref_pipe.theta, x).numpy()
    return _tape_reference


@pytest.mark.parametrize('cell_functions', [True, False], ids=['functions', 'unrolled'])
@pytest.mark.parametrize('t,k,r', [(2, 2, 1), (2, 1, 2), (4, 1, 1)])
def test_fprop_under_tape_and_eval_equal_t1(t, k, r, cell_functions):
    ref = tape_reference()
    ref_out, ref_loss, ref_grads = ref['step']
    pipe = tp_pipeline(t, k, r, cell_functions=cell_functions)
    out, loss, grads = tape_step(pipe)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_same(grads, ref_grads, 'grads')
    x, _ = inputs()
    with fprop_context.evaluation():
        np.testing.assert_allclose(tf.function(pipe.FProp)(pipe.theta, x).numpy(),
                                   ref['eval'], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize('schedule', ['zb_h1', 'zb_h2', 'interleaved_1f1b'])
def test_split_backward_and_interleaved_schedules(schedule):
    """The other schedules: a split backward asks each shard for its input and its weight
    gradients in two tasks; interleaved puts two cells on each device slot's group."""
    if schedule == 'interleaved_1f1b':
        pipe = tfpipe.PipeliningLayer.Params().Set(
            name='pipe', body=tp_body(), balance=[1, 1, 1, 2], virtual_stages=2,
            num_micro_batches=4, tensor_parallel=2, schedule=schedule).Instantiate()
    else:
        pipe = tp_pipeline(2, 2, schedule=schedule)
    check(pipe)


def test_eager_forward_backward_equals_t1():
    """Outside tf.function each collective runs as a traced call of all its members."""
    ref = reference()
    pipe = tp_pipeline(2, 2)
    x, y = inputs()
    with fprop_context.training(step=STEP):
        loss, grads = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
    np.testing.assert_allclose(loss.numpy(), ref['loss'], rtol=1e-5)
    assert_same(whole(pipe, {p: g.numpy() for p, g in flatten_by_path(grads, 'pipe').items()}),
                ref['grads'], 'grads')
