"""ZeRO stages 2 and 3 across 2 trainer clients on AmoebaNetPipe (BatchNorm), with Adam
in float32 and with Adafactor in float64.

Two trainer clients (real processes on loopback), each one replica of
image.shapes.AmoebaNetPipe (the default model, shrunk to K=2 and M=2 for time), at
task.train.sharding='gradients' (each keeps half of every gradient sum and updates its
half of the weights) and at 'weights' (each also holds only half of every weight between
steps). AmoebaNetPipe has BatchNorm, whose moving statistics are state outside the
optimizer. Each pair must train as one process with R=2 unsharded replicas does (the
same global batch of 32): loss at every step and the chief's checkpoint key by key
(weights, Adam's slots, BatchNorm moving statistics) within 1e-5 (measured: the
checkpoint bit for bit, losses within 1.2e-7, one float32 ulp). The learning rate warms
up in one step, so the weights move by ~lr = 3e-3 a step, far above the tolerance.

With Adafactor in float32 the pairs miss 1e-5: at stages 2 and 3 its whole-weight
statistics (row and column means, RMS) are summed over the parts in another order, 1.5e-8
off the unsharded weights after one step; at step 3 a ReLU or max-pool kink is crossed
(the gradient norm jumps 2.2e-5 of itself while the loss agrees to 1e-9), and the
normalised updates carry it on, up to 1.1% of a moment after 4 steps, in one process
alike (docs/optimizer_sharding.md, "Across trainer clients"). So Adafactor is checked in
float64 (tests/amoebanet64.py), where that reordering is 1e-16 apart: the same runs, the
same 1e-5 (measured: losses equal, checkpoints within 7.9e-15 of each value's largest).
oneDNN is off in every process; each is stopped by its PID in teardown (the `processes`
fixture).
"""
import os

import numpy as np
import pytest

from tests import trainer_helpers as th
from tests.test_clients import client_command, spec_of

MODEL = 'image.shapes.AmoebaNetPipe'
MODEL_64 = 'tests.amoebanet64.AmoebaNetPipe64Adafactor'
STEPS = 4
EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}
SMALL = {'task.pipeline.num_cells': 2, 'task.pipeline.num_micro_batches': 2,
         'task.train.lr_schedule.warmup_steps': 1, 'task.train.lr_schedule.total_steps': 8}
STAGES = ('gradients', 'weights')


def _flags(**overrides) -> list[str]:
    return [*th.fast_flags(STEPS, STEPS), th.overrides(**SMALL, **overrides)]


def _start_runs(root, data_dir, processes, model: str) -> tuple[dict, list]:
    """The unsharded R=2 reference and a pair of clients per stage, all started."""
    d = {'reference': str(root / 'reference')}
    started = [processes.start(th.command(model, d['reference'], data_dir, *_flags(
        **{'task.pipeline.num_replicas': 2})), environ=EXACT)]
    for stage in STAGES:
        spec = spec_of(2)
        d[stage] = [str(root / f'{stage}_{who}') for who in ('chief', 'other')]
        flags = _flags(**{'task.train.sharding': stage})
        started += [processes.start(client_command(logdir, data_dir, spec, task, *flags,
                                                   model=model), environ=EXACT)
                    for task, logdir in enumerate(d[stage])]
    return d, started


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir, processes):
    """{model: {'reference': logdir, stage: [the chief's logdir, the other's]}} for Adam in
    float32 and Adafactor in float64, run one model after the other (5 processes each)."""
    root = tmp_path_factory.mktemp('sharded_clients_amoebanet')
    logdirs = {}
    for model in (MODEL, MODEL_64):
        logdirs[model], started = _start_runs(root / model, data_dir, processes, model)
        th.finish(started)
    return logdirs


@pytest.mark.parametrize('stage', STAGES)
def test_two_sharded_clients_train_amoebanet_as_one_unsharded_process(runs, stage):
    chief, other = runs[MODEL][stage]
    saved, expected = th.same_run(chief, runs[MODEL]['reference'], STEPS)
    moving = [key for key in expected if '.Smoving_' in key]
    slots = [key for key in expected if key.startswith('optimizer/_slots/')]
    assert len(moving) == 2 * len([k for k in expected if k.endswith('.Sgamma/.ATTRIBUTES/'
                                                                     'VARIABLE_VALUE')])
    assert len(slots) == 2 * len([k for k in expected if k.startswith('model/')
                                  and '.Smoving_' not in k])  # Adam: m, v
    for key, value in expected.items():
        np.testing.assert_allclose(saved[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    # The statistics moved from their start (mean 0, variance 1), and so did the slots.
    assert all(np.abs(expected[key]).max() > 0 for key in moving if 'moving_mean' in key)
    assert any(np.abs(expected[key]).max() > 0 for key in slots)
    assert not os.path.exists(other) or os.listdir(other) == []  # the chief saves alone


@pytest.mark.parametrize('stage', STAGES)
def test_two_sharded_clients_train_amoebanet_in_float64_with_adafactor_as_one_process(
        runs, stage):
    """Adafactor's whole-weight statistics (row and column means of the factored second
    moments, each update's RMS) are sums over the parts at these stages: float64 shows
    them exact where float32's reordering crosses a kink (tests/amoebanet64.py)."""
    chief, _ = runs[MODEL_64][stage]
    saved, expected = th.same_run(chief, runs[MODEL_64]['reference'], STEPS)
    factored = [key for key in expected if key.endswith(('/vr/.ATTRIBUTES/VARIABLE_VALUE',
                                                         '/vc/.ATTRIBUTES/VARIABLE_VALUE'))]
    assert factored, 'Adafactor factored no moment: the test would not see row/column means'
    for key, value in expected.items():
        if hasattr(value, 'dtype') and value.dtype.kind == 'f':
            assert value.dtype == np.float64, key
        np.testing.assert_allclose(saved[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
