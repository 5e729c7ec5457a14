"""The trainer with sharded replicas (R=2 x K=2 on 4 logical CPUs, Adam): ZeRO stage 1
(task.train.shard_optimizer_states), stage 2 (task.train.sharding='gradients') and stage 3
('weights').

Resumed from the session's unsharded R=2 run at step 2 and trained sharded to
step 4, the trainer must log the same losses and save the same weights, Adam
slots and step as that run did, under the same checkpoint keys: so a sharded
checkpoint is the unsharded one (tests/test_sharded_optimizer.py restores each
into the other under other R).
"""
import os

import numpy as np
import pytest
import tensorflow as tf

from tests import trainer_helpers as th

STEPS = 4
SHARDED = {'task.pipeline.num_replicas': 2, 'task.train.shard_optimizer_states': True}
# ZeRO stage 2: each replica's own gradient sums, reduce-scattered, clipped, updated.
STAGE2 = {'task.pipeline.num_replicas': 2, 'task.train.sharding': 'gradients'}
# ZeRO stage 3: also 1/R of each weight between steps, gathered once per step.
STAGE3 = {'task.pipeline.num_replicas': 2, 'task.train.sharding': 'weights'}


def _state(logdir, step):
    """Every saved value of ckpt-`step` (model, Adam slots, step) but the input position."""
    prefix = os.path.join(logdir, 'train', f'ckpt-{step}')
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(prefix)
            if name.startswith(('model/', 'optimizer/', 'step/'))}


def _assert_same_state(a, b, step, first_step):
    state_a, state_b = _state(a, step), _state(b, step)
    assert state_a.keys() == state_b.keys()
    assert any('/_slots/' in name for name in state_a)  # the slots are compared too
    for name in state_a:
        np.testing.assert_allclose(state_a[name], state_b[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    losses_a = th.losses_by_step(os.path.join(a, 'train'))
    losses_b = th.losses_by_step(os.path.join(b, 'train'))
    assert sorted(losses_a) == list(range(first_step, step + 1)), losses_a
    for s in losses_a:
        np.testing.assert_allclose(losses_a[s], losses_b[s], rtol=1e-5, err_msg=f'step {s}')


@pytest.mark.parametrize('sharded', [SHARDED, STAGE2, STAGE3],
                         ids=['optimizer_states', 'gradients', 'weights'])
def test_sharded_trainer_resumes_an_unsharded_run_and_saves_what_it_would_have(
        tmp_path, data_dir, trained_4_steps_two_replicas, sharded):
    unsharded = trained_4_steps_two_replicas.logdir  # R=2, M=2 per replica, Adam
    overrides = sharded
    sharded = trained_4_steps_two_replicas.copy_to(tmp_path / 'sharded')
    th.rewind(sharded, STEPS // 2, keep_events=False)  # only the sharded trainer's losses
    result = th.run(th.FAST, sharded, data_dir, *th.fast_flags(STEPS, 2),
                    th.overrides(**overrides))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'at step {STEPS // 2}' in result.stderr  # resumed, not restarted
    _assert_same_state(sharded, unsharded, STEPS, first_step=STEPS // 2 + 1)
