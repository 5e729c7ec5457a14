"""A checkpoint moves between ZeRO stages and replica counts (task.train.sharding).

Every stage saves the same whole checkpoint (weights, whole optimizer slots, step), so
a run may stop at one stage and R and resume at another. One chain of runs shows it:
each segment restores the previous segment's checkpoint, trains at its own stage and R
and saves; together they take the steps of one uninterrupted unsharded run. Every
handoff is covered: 'gradients' -> 'none' (R=2 -> 4), 'none' -> 'gradients' (R=4),
'gradients' -> 'optimizer_states' (R=4 -> 2), 'optimizer_states' -> 'gradients'
(R=2 -> 4), 'gradients' -> 'gradients' (R=4 -> 2), and for stage 3 'gradients' ->
'weights' (R=2 -> 4), 'weights' -> 'none' (R=4 -> 2), 'none' -> 'weights' (R=2) and
'weights' -> 'gradients' (R=2 -> 4), with K=2 at R=2 and K=1 at R=4.
The model is tests/test_sharded_gradients.py's float64 pipeline (Dropout, a bias that
neither R divides) with the trainer's update (clipping included) and Adam: the loss of every
step and every value of every checkpoint (weights, Adam's m and v, the step) within
1e-5 of the uninterrupted run's. (With an absolute 1e-8 as well, as in
tests/test_sharded_gradients.py: the clipping norm is summed in float32 by every stage,
over the parts at stage 2, so a clipped gradient agrees to float32's rounding, which an
element of Adam's m that cancels to 1e-6 shows relatively.)
"""
import numpy as np
import pytest

from tests import test_tensor_parallel_optimizers as tp_optimizers
from tests.test_sharded_gradients import PipelineRun
from tests.test_sharded_optimizer import OPTIMIZERS
from tfpipe.pipeline import sharding

# (stage, R, K, steps) of each segment of the chain; the first starts from scratch.
CHAIN = [(sharding.GRADIENTS, 2, 2, 2), (sharding.NONE, 4, 1, 1), (sharding.GRADIENTS, 4, 1, 1),
         (sharding.OPTIMIZER_STATES, 2, 2, 1), (sharding.GRADIENTS, 4, 1, 1),
         (sharding.GRADIENTS, 2, 2, 1), (sharding.WEIGHTS, 4, 1, 1), (sharding.NONE, 2, 2, 1),
         (sharding.WEIGHTS, 2, 2, 1), (sharding.GRADIENTS, 4, 1, 1)]
STEPS = sum(steps for *_, steps in CHAIN)
RULE = OPTIMIZERS['adam'].Copy().Set(name='adam')


@pytest.fixture(scope='module')
def chain(tmp_path_factory):
    """The uninterrupted run's losses and checkpoint after every step, and the chain's
    losses and checkpoint after every segment, by step."""
    directory = tmp_path_factory.mktemp('stage_resume')
    reference = PipelineRun(1, 2, 2, sharding.NONE, RULE)
    want_losses, want_saved = [], {}
    for step in range(1, STEPS + 1):
        want_losses += reference.train(1)
        want_saved[step] = reference.save(directory / f'reference_{step}')
    got_losses, got_saved, previous = [], {}, None
    for i, (stage, r, k, steps) in enumerate(CHAIN):
        run = PipelineRun(1, k, r, stage, RULE)
        if previous is not None:
            run.restore(previous)
        got_losses += run.train(steps)
        previous = run.save(directory / f'segment_{i}_{stage}_r{r}')
        got_saved[len(got_losses)] = previous
    return want_losses, want_saved, got_losses, got_saved


def test_a_chain_of_stages_and_replica_counts_takes_the_uninterrupted_runs_steps(chain):
    want_losses, _, got_losses, _ = chain
    assert len(got_losses) == STEPS
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)


def test_every_handoffs_checkpoint_equals_the_uninterrupted_runs(chain):
    _, want_saved, _, got_saved = chain
    assert sorted(got_saved) == list(range(2, STEPS + 1))
    for step, path in got_saved.items():
        got, want = tp_optimizers.contents(path), tp_optimizers.contents(want_saved[step])
        slots = [key for key in want if '/_slots/' in key]
        assert slots and all(key.endswith(('/m/.ATTRIBUTES/VARIABLE_VALUE',
                                            '/v/.ATTRIBUTES/VARIABLE_VALUE')) for key in slots)
        assert sorted(got) == sorted(want)
        for key in want:  # atol: see the module's docstring
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-8,
                                       err_msg=f'step {step}: {key}')
        assert int(got['step/.ATTRIBUTES/VARIABLE_VALUE']) == step
    first, last = (tp_optimizers.contents(got_saved[s]) for s in (2, STEPS))
    weights = [key for key in first if key.startswith('model/')]
    assert weights and all(not np.allclose(first[key], last[key]) for key in weights)
