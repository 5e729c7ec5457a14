"""The trainer with data-parallel replicas (R=2 x K=2 on 4 logical CPUs).

R=2 replicas with M=2 micro-batches each run the micro-batches of one R=1
pipeline with M=4, so the trainer's losses and weights must match that run,
and checkpoints (one copy of each variable, plus optimizer slots) must move
between R=1 and R=2 in both directions.
"""
import os
import shutil

import numpy as np

from tests import trainer_helpers as th
from tfpipe import checkpoints

STEPS = 4


def _flags(steps, **overrides):
    return [*th.fast_flags(steps, 2), th.overrides(**overrides)]


def _final(logdir):
    return th.model_values(checkpoints.latest(os.path.join(logdir, 'train')))


def _assert_same_run(a, b):
    losses_a = th.losses_by_step(os.path.join(a, 'train'))
    losses_b = th.losses_by_step(os.path.join(b, 'train'))
    assert sorted(losses_a) == list(range(1, STEPS + 1)), losses_a
    assert losses_a.keys() == losses_b.keys()
    for step in losses_a:
        np.testing.assert_allclose(losses_a[step], losses_b[step], rtol=1e-5,
                                   err_msg=f'loss at step {step}')
    values_a, values_b = _final(a), _final(b)
    assert values_a.keys() == values_b.keys()
    for name in values_a:
        np.testing.assert_allclose(values_a[name], values_b[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_two_replicas_train_like_one_pipeline_and_checkpoints_move_between_them(
        tmp_path, data_dir, trained_4_steps_two_replicas):
    one = str(tmp_path / 'one')  # R=1, M=4
    result = th.run(th.FAST, one, data_dir, *_flags(STEPS, **{
        'task.pipeline.num_micro_batches': 4}))
    assert result.returncode == 0, result.stderr[-3000:]

    # R=2 x K=2, M=2 per replica: the session's run of _flags(STEPS, num_replicas=2).
    two = trained_4_steps_two_replicas.logdir
    _assert_same_run(two, one)
    assert _final(two).keys() == _final(one).keys()  # one copy of each variable

    # Half the run with R=1, the rest with R=2: the restore must reach replica 1's
    # weights and Adam slots, or its gradients (summed into every replica) go wrong. The
    # R=1 half is `one` rewound to its step-2 checkpoint: a 2-step run would train the same
    # steps (within SmallConvPipe's 50 warm-up steps the rates do not follow max_steps).
    mixed = str(tmp_path / 'mixed')
    shutil.copytree(one, mixed)
    th.rewind(mixed, STEPS // 2)
    result = th.run(th.FAST, mixed, data_dir, *_flags(STEPS, **{
        'task.pipeline.num_replicas': 2}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'at step {STEPS // 2}' in result.stderr  # resumed, not restarted
    _assert_same_run(mixed, one)
