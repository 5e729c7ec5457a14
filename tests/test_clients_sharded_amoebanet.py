"""ZeRO stages 2 and 3 across 2 trainer clients on AmoebaNetPipe (BatchNorm), with Adam.

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

Adafactor is not here: at stages 2 and 3 its whole-weight statistics (row and column
means, RMS) are summed over the parts in another order, 1.5e-8 off the unsharded weights
after one step; at step 3 the gradient norm is 2.2e-5 of itself off while the loss agrees to
1e-9 (a jump of the gradient, not of the loss: a ReLU or max-pool kink crossed, our
reading), which Adafactor's normalised updates carry into the weights: after 4 steps 115
of 211 checkpoint values are off by more than 1e-5, up to 1.1% of a moment. One process
at R=2 and stage 2 gives the same numbers bit for bit, so it is not the clients'
(docs/optimizer_sharding.md, "Across trainer clients").
oneDNN is off in every process; each is stopped by its PID in teardown (the `processes`
fixture).
"""
import os

import numpy as np
import pytest

from tests import trainer_helpers as th
from tests.test_clients import client_command, spec_of

MODEL = 'image.shapes.AmoebaNetPipe'
STEPS = 4
EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}
SMALL = {'task.pipeline.num_cells': 2, 'task.pipeline.num_micro_batches': 2,
         'task.train.lr_schedule.warmup_steps': 1, 'task.train.lr_schedule.total_steps': 8}
STAGES = ('gradients', 'weights')


def _flags(**overrides) -> list[str]:
    return [*th.fast_flags(STEPS, STEPS), th.overrides(**SMALL, **overrides)]


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir, processes):
    """{'reference': logdir, stage: [the chief's logdir, the other's]}."""
    root = tmp_path_factory.mktemp('sharded_clients_amoebanet')
    d = {'reference': str(root / 'reference')}
    started = [processes.start(th.command(MODEL, d['reference'], data_dir, *_flags(
        **{'task.pipeline.num_replicas': 2})), environ=EXACT)]
    for stage in STAGES:
        spec = spec_of(2)
        d[stage] = [str(root / f'{stage}_{who}') for who in ('chief', 'other')]
        flags = _flags(**{'task.train.sharding': stage})
        started += [processes.start(client_command(logdir, data_dir, spec, task, *flags,
                                                   model=MODEL), environ=EXACT)
                    for task, logdir in enumerate(d[stage])]
    th.finish(started)
    return d


@pytest.mark.parametrize('stage', STAGES)
def test_two_sharded_clients_train_amoebanet_as_one_unsharded_process(runs, stage):
    chief, other = runs[stage]
    saved, expected = th.same_run(chief, runs['reference'], STEPS)
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
