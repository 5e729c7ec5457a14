"""Every pipeline knob is honoured or refused: none is silently ignored or changed."""
import numpy as np
import pytest
import tensorflow as tf

import model_registry
import tfpipe
from tests import model_zoo as mz
from tfpipe import devices as devices_lib
from tfpipe import fprop_context
from tfpipe.pipeline import schedule


def forwards_first(ticks, num_cells):
    """Does every cell run all its forwards before any of its backwards (fused or split)?"""
    for k in range(num_cells):
        phases = [t.phase for t in schedule.cell_order(ticks, k)]
        first_backward = min(i for i, p in enumerate(phases) if p != schedule.FORWARD)
        if schedule.FORWARD in phases[first_backward:]:
            return False
    return True


@pytest.mark.parametrize('name', sorted(schedule.SCHEDULES))
def test_schedule_table_flag_agrees_with_the_schedule_data(name):
    """FProp under a tape trusts `forwards_first`; a new schedule cannot claim it wrongly."""
    entry = schedule.SCHEDULES[name]
    v = 2 if name == 'interleaved_1f1b' else 1  # interleaved: M a multiple of K
    grid = [(k, m * k if v > 1 else m) for k in (1, 2, 4) for m in (2, 3, 8)]
    observed = [forwards_first(entry.build(k, m, v), k * v) for k, m in grid]
    if entry.forwards_first:
        assert all(observed)
    else:
        assert not any(observed)


def tape_loss_and_grads(pipe, x, y):
    with fprop_context.training(step=1):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(mz.loss_fn(pipe.FProp(pipe.theta, x), y))
    return loss, tape.gradient(loss, pipe.trainable_variables)


def test_fprop_under_a_tape_refuses_1f1b_and_names_forward_backward():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, 2, 4, schedule='1f1b')
    with pytest.raises(ValueError, match=r"pipe: schedule='1f1b' interleaves.*ForwardBackward"):
        tape_loss_and_grads(pipe, x, y)
    # The same pipeline still evaluates (forwards only) and trains through ForwardBackward.
    with fprop_context.evaluation():
        ref = mz.sequential(body)(x).numpy()
        np.testing.assert_allclose(pipe(x).numpy(), ref, rtol=1e-12)
    loss, _ = mz.sgd_step_forward_backward(pipe, x, y, 1, lr=0.0)
    assert np.isfinite(loss)


def test_fprop_under_a_tape_runs_fill_drain():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    loss, grads = tape_loss_and_grads(mz.pipeline(body, 2, 4, schedule='fill_drain'), x, y)
    assert np.isfinite(loss.numpy()) and all(g is not None for g in grads)


def test_forward_backward_refuses_evaluation_mode():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, 2, 2)
    with pytest.raises(ValueError, match=r'pipe: ForwardBackward computes training gradients.*'
                                         r'evaluation\(\).*fprop_context.training'):
        with fprop_context.evaluation():
            pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)


def test_a_devices_list_longer_than_the_cells_is_refused_naming_k():
    with pytest.raises(ValueError, match=r'^pipe: devices lists 3 devices but the pipeline needs '
                                         r'2 device slot\(s\): list exactly 2 devices'):
        mz.pipeline(mz.mlp_body(), 2, 2, devices=['/CPU:0', '/CPU:1', '/CPU:2'])
    with pytest.raises(ValueError, match=r'lists 4 devices but the pipeline needs 3 device slot'):
        devices_lib.resolve(['/CPU:0', '/CPU:1', '/CPU:2', '/CPU:3'], 3)
    assert devices_lib.resolve(['/CPU:2', '/CPU:1'], 2) == [
        '/job:localhost/replica:0/task:0/device:CPU:2',
        '/job:localhost/replica:0/task:0/device:CPU:1']


def test_time_partition_measures_on_the_first_listed_device():
    body = [tfpipe.layers.Dense.Params().Set(name=f'fc{i}', input_dim=8, output_dim=8)
            for i in range(4)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, num_cells=2, partition_by='time', input_shape=[4, 8],
        devices=['/CPU:3', '/CPU:4']).Instantiate()
    assert [d[-5:] for d in pipe.devices] == ['CPU:3', 'CPU:4']


@pytest.mark.parametrize('model', sorted(model_registry.list_models()))
def test_micro_batches_are_set_in_one_place(model):
    params = model_registry.get_class(model)().Model()
    lines = [line.split(':')[0].strip() for line in params.ToText().splitlines()
             if 'num_micro_batches' in line]
    assert lines == ['task.pipeline.num_micro_batches']
    with pytest.raises(AttributeError, match=r'num_micro_batches'):
        params.task.train.Set(num_micro_batches=2)
