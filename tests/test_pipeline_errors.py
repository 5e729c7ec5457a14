"""Every bad input to the pipeline gets one clear ValueError naming the fix."""
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tfpipe import fprop_context


def build(**overrides):
    p = tfpipe.PipeliningLayer.Params().Set(name='pipe', body=mz.mlp_body(), balance=[3, 3])
    return p.Set(**overrides).Instantiate()


@pytest.mark.parametrize('overrides,message', [
    (dict(balance=[2, 2]), r'covers 4 layers but the body has 6.*e\.g\. \[3, 3\]'),
    (dict(balance=[3, 3, 0]), r'balance\[2\] is 0.*at least one layer'),
    (dict(balance=[2, 2, 2, 1, 1, 1, 1]), r'has 7 cells but the body has only 6 layers.*at most 6 cells'),
    (dict(balance=None), r'num_cells=K'),
    (dict(balance=None, num_cells=2, partition_by='flops'), r'needs p.input_shape'),
    (dict(balance=None, num_cells=2, partition_by='speed'), r"unknown partition_by 'speed'"),
    (dict(balance=[3, 3], num_cells=3), r'num_cells=3 disagrees with balance'),
    (dict(body=[]), r'body is empty'),
    (dict(num_micro_batches=0), r'num_micro_batches=0 must be an int >= 1'),
    (dict(recompute='sometimes'), r"unknown recompute policy 'sometimes'.*'always'"),
    (dict(schedule='zero_bubble'), r"unknown schedule 'zero_bubble'"),
    (dict(devices=['/CPU:0']), r'2 cells but devices lists 1'),
    (dict(devices=['/CPU:0', '/CPU:9']), r"unknown device '/CPU:9'.*configure_logical_cpus"),
    (dict(devices=['/CPU:1', '/cpu:1']), r'lists a device twice'),
    (dict(devices=['/CPU:0', 'nonsense']), r'device'),
    (dict(balance=[1] * 6, body=mz.mlp_body() + mz.mlp_body()[:3]), r'covers 6 layers'),
])
def test_bad_params(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        build(**overrides)
    assert '\n' not in str(info.value)
    assert str(info.value).startswith('pipe')  # names the layer


def test_too_many_cells_for_the_devices():
    body = [p for _ in range(2) for p in mz.mlp_body()]
    for i, p in enumerate(body):
        p.name = f'{p.name}_{i}'
    with pytest.raises(ValueError, match=r'12 cells but this process has only 8 .*fewer cells'):
        tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body, balance=[1] * 12).Instantiate()


def test_duplicate_layer_names():
    body = mz.mlp_body()
    body[1].name = 'fc0'
    with pytest.raises(ValueError, match=r"already has a variable or child named 'fc0'"):
        build(body=body)


def test_nested_inputs_that_disagree_on_batch():
    pipe = build(num_micro_batches=2)
    x = {'x': tf.zeros([8, 12], tf.float64), 'mask': tf.zeros([6], tf.float64)}
    with pytest.raises(ValueError, match=r"disagree on the batch dimension.*\['mask'\]=6"):
        with fprop_context.training(step=0):
            pipe(x)


def test_loss_fn_must_return_per_example_losses():
    pipe = build(num_micro_batches=2)
    x, y = mz.inputs_for(mz.mlp_body())

    def mean_loss(logits, labels):
        return tf.reduce_mean(mz.loss_fn(logits, labels))

    with pytest.raises(ValueError, match=r'one loss per example, shape \[5\]'):
        with fprop_context.training(step=0):
            pipe.ForwardBackward(pipe.theta, x, mean_loss, y)


def test_targets_must_match_the_batch():
    pipe = build()
    x, y = mz.inputs_for(mz.mlp_body())
    with pytest.raises(ValueError, match=r'batch size 10 but targets have 9'):
        with fprop_context.training(step=0):
            pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y[:9])


def test_dropout_without_a_step_says_how_to_give_one():
    pipe = build()
    x, _ = mz.inputs_for(mz.mlp_body())
    with pytest.raises(ValueError, match=r'fprop_context.training\(step=global_step\)'):
        pipe(x)


def test_input_width_mismatch_names_the_param():
    pipe = build()
    with pytest.raises(ValueError, match=r'pipe/fc0: input has last dimension 7 but '
                                         r'p.input_dim is 12'):
        with fprop_context.evaluation():
            pipe(tf.constant(np.zeros([4, 7])))
