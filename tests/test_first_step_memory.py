"""The host memory a first step still needs, predicted from params before tracing
(tfpipe/tuning/first_step_memory.py): hand-checked on a small pipeline, and the line
that says when it will not fit."""
import dataclasses

import pytest
import tensorflow as tf

import tfpipe
from tfpipe import layers
from tfpipe.tuning import first_step_memory, planner

BATCH, M = 16, 2


def _pipe(schedule: str, recompute: str, replicas: int):
    body = [layers.Dense.Params().Set(name='fc0', input_dim=6, output_dim=32),
            layers.Dense.Params().Set(name='fc1', input_dim=32, output_dim=8),
            layers.Dense.Params().Set(name='fc2', input_dim=8, output_dim=5)]
    return body, tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=[2, 1], num_micro_batches=M, schedule=schedule,
        recompute=recompute, num_replicas=replicas).Instantiate()


@pytest.mark.parametrize('schedule,recompute,replicas', [
    ('fill_drain', 'always', 1), ('1f1b', 'never', 2)])
def test_gradient_sums_held_micro_batches_and_working_sets_by_hand(schedule, recompute,
                                                                    replicas):
    body, pipe = _pipe(schedule, recompute, replicas)
    trainable = [v for copy in pipe.ReplicaVariablesByPath() for v in copy.values()]
    need = first_step_memory.predict(pipe, body, tf.zeros([BATCH, 6]), trainable)
    weights = (6 * 32 + 32 + 32 * 8 + 8 + 8 * 5 + 5) * 4
    assert need.gradient_sums == replicas * weights
    b = BATCH / (replicas * M)  # examples per micro-batch
    # cell 0 (fc0, fc1) and cell 1 (fc2), per micro-batch: input, outputs.
    inputs, outputs = [b * 6 * 4, b * 8 * 4], [b * (32 + 8) * 4, b * 5 * 4]
    in_flight = [M, M] if schedule == 'fill_drain' else [min(M, 2), min(M, 1)]
    if recompute == 'always':  # stashes its input; its backward holds its outputs again
        held, working = inputs, outputs
    else:  # stashes every output; the estimated working set adds nothing
        held, working = outputs, [0.0, 0.0]
    assert need.held == pytest.approx(replicas * sum(n * h for n, h in zip(in_flight, held)))
    at_once = int(min(M, planner.local_parallelism(
        tf.config.threading.get_intra_op_parallelism_threads())))
    largest = sorted(working * replicas, reverse=True)[:at_once]
    assert need.working == pytest.approx(sum(largest))
    assert need.held_now > 0 and need.available > 0
    assert need.total == pytest.approx(need.gradient_sums + need.held + need.working)


def test_a_step_that_will_not_fit_says_so_with_the_prediction_and_the_fix():
    body, pipe = _pipe('1f1b', 'always', 1)
    need = first_step_memory.predict(pipe, body, tf.zeros([BATCH, 6]),
                                     list(pipe.VariablesByPath().values()))
    assert not need.exceeds  # a few kB on this host
    assert need.line().startswith('host memory: the first step needs at least ')
    short = dataclasses.replace(need, available=need.total / 2)
    assert short.exceeds
    line = short.line()
    assert f'at least {first_step_memory.size(need.total)} more host memory' in line
    assert f'{first_step_memory.size(need.total / 2)} available' in line
    assert first_step_memory.size(3 * 2 ** 30) == '3 GiB'
    assert 'it will not fit' in line and 'task.pipeline.recompute=always' in line
    assert '--mode=inspect_model' in line and '\n' not in line
    unknown = dataclasses.replace(need, available=None)
    assert not unknown.exceeds and 'available memory unknown' in unknown.line()


def test_the_hosts_available_memory_is_read():
    available = first_step_memory.available_bytes()
    with open('/proc/meminfo') as f:
        total = int(next(line for line in f if line.startswith('MemTotal')).split()[1]) * 1024
    assert 0 < available <= total


def test_a_layer_without_fprop_meta_gets_no_prediction_and_no_error():
    class Opaque(layers.Dense):
        @classmethod
        def FPropMeta(cls, p, x_shape):
            raise NotImplementedError('Opaque does not implement FPropMeta')

    body = [Opaque.Params().Set(name='fc0', input_dim=6, output_dim=5)]
    pipe = tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body, balance=[1]).Instantiate()
    assert first_step_memory.predict(pipe, body, tf.zeros([4, 6]), []) is None


@pytest.mark.parametrize('overrides', [
    dict(schedule='interleaved_1f1b', virtual_stages=2, balance=[1, 1, 1, 1], num_micro_batches=2),
    dict(tensor_parallel=2, balance=[1, 1, 1], num_micro_batches=2)])
def test_interleaved_and_tensor_parallel_pipelines_are_predicted(overrides):
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=8, output_dim=8)
            for i in range(len(overrides['balance']))]
    pipe = tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body, **overrides).Instantiate()
    need = first_step_memory.predict(pipe, body, tf.zeros([8, 8]),
                                     list(pipe.VariablesByPath().values()))
    assert need.held > 0 and need.working > 0 and need.total > need.gradient_sums


def test_stage_3_counts_whole_gradient_sums_and_the_gathered_weights():
    """The trainer passes the parts (its variables at stage 3); a step still holds each
    weight gathered whole and its gradient sum whole."""
    body, pipe = _pipe('1f1b', 'always', 2)
    whole = (6 * 32 + 32 + 32 * 8 + 8 + 8 * 5 + 5) * 4
    pipe.ShardWeights()
    parts = [v for copy in pipe.ReplicaVariablesByPath() for v in copy.values() if v.trainable]
    held = sum(v.shape.num_elements() * v.dtype.size for v in parts)
    assert held < 2 * whole  # the parts
    need = first_step_memory.predict(pipe, body, tf.zeros([BATCH, 6]), parts)
    assert need.gradient_sums == 2 * whole
    assert need.gathered_weights == 2 * whole - held
    assert 'gathered weights' in need.line()
