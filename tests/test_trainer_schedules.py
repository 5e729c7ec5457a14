"""The trainer with every schedule, resuming one schedule's checkpoint under another.

All schedules compute the same step, so a run that changes schedule at every
restart must match a straight fill-drain run: loss at every step and final weights.
"""
import os

import numpy as np

from tests import trainer_helpers as th
from tfpipe import checkpoints

LEGS = [  # (last step, overrides): each leg resumes the previous leg's checkpoint
    (2, {'task.pipeline.schedule': 'zb_h1'}),
    (4, {'task.pipeline.schedule': 'interleaved_1f1b', 'task.pipeline.virtual_stages': 2,
         'task.pipeline.balance': [2, 1, 1, 1]}),
    (6, {'task.pipeline.schedule': 'zb_h2', 'task.pipeline.recompute': 'never'}),
    (8, {'task.pipeline.schedule': '1f1b'}),
]


def test_every_schedule_trains_and_resumes_under_another(tmp_path, data_dir):
    steps = LEGS[-1][0]
    straight = str(tmp_path / 'straight')
    result = th.run(th.FAST, straight, data_dir, *th.fast_flags(steps, 2))
    assert result.returncode == 0, result.stderr[-3000:]

    changing = str(tmp_path / 'changing')
    for last, overrides in LEGS:
        result = th.run(th.FAST, changing, data_dir, *th.fast_flags(last, 2),
                        th.overrides(**overrides))
        assert result.returncode == 0, result.stderr[-3000:]
        assert checkpoints.step_of(checkpoints.latest(os.path.join(changing, 'train'))) == last

    want = th.losses_by_step(os.path.join(straight, 'train'))
    got = th.losses_by_step(os.path.join(changing, 'train'))
    assert sorted(got) == list(range(1, steps + 1))
    for step in want:
        np.testing.assert_allclose(got[step], want[step], rtol=1e-5, err_msg=f'step {step}')
    expected = th.model_values(checkpoints.latest(os.path.join(straight, 'train')))
    actual = th.model_values(checkpoints.latest(os.path.join(changing, 'train')))
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
