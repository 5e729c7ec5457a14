"""The trainer with data-parallel replicas (R=2 x K=2 on 4 logical CPUs).

R=2 replicas with M=2 micro-batches each run the micro-batches of one R=1
pipeline with M=4, so the trainer's losses and weights must match that run,
and checkpoints (one copy of each variable, plus optimizer slots) must move
between R=1 and R=2 in both directions.
"""
import os
import shutil

import numpy as np
import pytest

from tests import trainer_helpers as th
from tfpipe import checkpoints
from trainer import batch_split

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


@pytest.fixture(scope='module')
def one_pipeline(tmp_path_factory, data_dir):
    """R=1 with M=4: the micro-batches of trained_4_steps_two_replicas (R=2 x M=2)."""
    one = str(tmp_path_factory.mktemp('one') / 'run')
    result = th.run(th.FAST, one, data_dir, *_flags(STEPS, **{
        'task.pipeline.num_micro_batches': 4}))
    assert result.returncode == 0, result.stderr[-3000:]
    return one


def test_two_replicas_train_like_one_pipeline_and_checkpoints_move_between_them(
        tmp_path, data_dir, one_pipeline, trained_4_steps_two_replicas):
    one = one_pipeline

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


def test_the_same_replicas_resume_with_the_users_micro_batches(tmp_path, data_dir,
                                                               one_pipeline,
                                                               trained_4_steps_two_replicas):
    """Only another R keeps the checkpoint's G = R*M; with the same R the params' M is the
    user's choice and must be used. The step-2 states of R=1 x M=4 and R=2 x M=2 are the
    same run's, so resuming them as R=1 x M=2 and R=2 x M=1 (G=2 both) trains steps 3..4
    alike; each new checkpoint records the M that ran."""
    resumed = {}
    for name, run, replicas, micro in (('r1', one_pipeline, 1, 2),
                                       ('r2', trained_4_steps_two_replicas.logdir, 2, 1)):
        logdir = str(tmp_path / name)
        shutil.copytree(run, logdir)
        th.rewind(logdir, STEPS // 2, keep_events=False)
        result = th.run(th.FAST, logdir, data_dir, *_flags(STEPS, **{
            'task.pipeline.num_replicas': replicas,
            'task.pipeline.num_micro_batches': micro}))
        assert result.returncode == 0, th.failure(result)
        assert f'at step {STEPS // 2}' in result.stderr  # resumed, not restarted
        assert (f'with {micro} micro-batches per replica (the checkpoint ran {2 * micro}): '
                f'{replicas * micro} per global batch instead of {2 * replicas * micro}'
                ) in result.stderr
        assert batch_split.saved(os.path.join(logdir, 'train')) == batch_split.Split(
            replicas, micro)
        resumed[name] = logdir
    losses = [th.losses_by_step(os.path.join(resumed[n], 'train')) for n in ('r1', 'r2')]
    assert sorted(losses[0]) == sorted(losses[1]) == [3, 4], losses
    for step in (3, 4):
        np.testing.assert_allclose(losses[0][step], losses[1][step], rtol=1e-5,
                                   err_msg=f'loss at step {step}')
    values_a, values_b = _final(resumed['r1']), _final(resumed['r2'])
    assert values_a.keys() == values_b.keys()
    for name in values_a:
        np.testing.assert_allclose(values_a[name], values_b[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
