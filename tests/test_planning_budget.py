"""--plan_seconds: planning measures only what fits its budget, says what it left out, and
still recommends (planning.MeasuringBudget).

The measuring function here plays each configuration's step through the simulator (the
calibration tests' `_measured_timeline`) and advances a clock the budget reads: a first
call of a configuration costs FIRST seconds (its trace), a later one AGAIN. So which
calls fit a budget is exact, not the load's.
"""
import os

import pytest

from tests.test_planner import _independent, _inspect_pipeline, _layers, _measured_timeline
from tfpipe.tuning import planner, planning
from tfpipe.tuning.calibration import Calibration, MeasuredRun

FIRST, AGAIN = 10.0, 2.0
BATCH = 16
TRUTH = Calibration(forward_scale=0.5, backward_scale=2.0, task_overhead=1e-4)


class _Clocked:
    """A measuring function on a clock of its own: (measure, clock, calls)."""

    def __init__(self):
        self.now, self.calls, self._seen = 0.0, [], set()
        self.layers = _layers()

    def clock(self) -> float:
        return self.now

    def __call__(self, config, steps, record):
        key = config.describe()
        self.now += AGAIN if key in self._seen else FIRST
        self._seen.add(key)
        self.calls.append((config, record))
        line, result = _measured_timeline(self.layers, config.balance, config.num_micro_batches,
                                          BATCH, TRUTH, recompute=config.recompute)
        wall = float(result.step_time) + 1e-3
        return MeasuredRun(list(config.balance), config.num_micro_batches,
                           [line] * (steps if record else 0), [wall] * steps,
                           recompute=config.recompute)


def _plan(seconds):
    measure = _Clocked()
    configured = planner.Config(2, [4, 4], 2, 'always', 'fill_drain', 0.0, 0.0, [0.0], True)
    plan = planning.plan(measure.layers, BATCH, 2, _independent(), configured, measure,
                         calibration_steps=2, candidates=2, rounds=2, steps=1,
                         micro_batches=(1, 2, 4), budget_seconds=seconds, start=0.0,
                         clock=measure.clock)
    return plan, measure


def test_no_budget_measures_everything_and_says_nothing():
    plan, measure = _plan(None)
    assert len(measure.calls) == 4 + 2 * 2 and plan.budget_note == ''
    assert len(plan.candidates) == 2 and all(len(s) == 2 for s in plan.step_seconds)


def test_a_budget_cuts_calibration_and_candidates_and_says_so():
    # 0, 10, 20 and 30 s start the four calibration runs (each then ends by 40 s);
    # at 40 s a first candidate call (10 s) fits 55 s, at 50 s the second does not.
    plan, measure = _plan(55.0)
    assert [record for _, record in measure.calls] == [True] * 4 + [False]
    assert measure.now <= 55.0
    assert len(plan.candidates) == 1 and plan.best is plan.candidates[0]
    assert plan.budget_note == (
        'planning budget 55 s (--plan_seconds): measured 4 of 4 calibration runs and 1 of 2 '
        'candidates in 1 of 2 rounds (a first measurement took up to 10 s); the pick is the '
        'best measured candidate. Raise it, or drop it, to measure more.')


def test_a_budget_too_short_for_any_candidate_picks_the_calibrated_prediction():
    plan, measure = _plan(35.0)  # calibration runs at 0, 10, 20; the fourth would end at 40
    assert len(measure.calls) == 3 and measure.now == 30.0
    assert not plan.candidates and plan.calibration.source.startswith('2 steps each of')
    assert plan.best is planner.best_fitting(plan.configs, None)
    assert 'measured 3 of 4 calibration runs and 0 of 2 candidates' in plan.budget_note
    assert 'the calibrated prediction, not measured' in plan.budget_note


@pytest.mark.parametrize('seconds', [0.0, -1.0])  # none; already over (e.g. by the profile)
def test_a_budget_spent_before_measuring_leaves_the_profile_to_decide(seconds):
    plan, measure = _plan(seconds)
    assert measure.calls == [] and plan.calibration.source == 'profiled only'
    assert plan.best is planner.best_fitting(plan.configs, None)
    assert "the profile's prediction: nothing was measured" in plan.budget_note
    assert plan.budget_note.endswith('Raise it, or drop it, to measure more.')


def test_a_budget_that_fits_everything_says_all_was_measured():
    plan, measure = _plan(1e6)
    assert len(measure.calls) == 8
    assert plan.budget_note.endswith('the pick is the best measured candidate.')
    assert 'measured 4 of 4 calibration runs and 2 of 2 candidates in 2 of 2 rounds' \
        in plan.budget_note


def test_the_trainer_plans_within_plan_seconds_and_says_what_it_measured(tmp_path, data_dir):
    """--plan_seconds=0: the profile alone decides (nothing can be measured in no time), the
    recommendation is still written, and both outputs say why it was not measured."""
    stdout, report = _inspect_pipeline(tmp_path, data_dir, '--plan_seconds=0')
    assert report['calibration']['source'] == 'profiled only' and report['measured'] == []
    assert report['budget_note'].startswith('planning budget 0 s (--plan_seconds): measured 0 '
                                            'of 4 calibration runs')
    assert report['budget_note'] in stdout and report['params_override'] in stdout
    assert os.path.exists(tmp_path / 'plan' / 'inspect_pipeline.gin')

