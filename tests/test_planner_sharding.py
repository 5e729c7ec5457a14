"""The planner's ZeRO stages (tfpipe/tuning/sharding_plan.py): offered beside K, M, T with
R > 1 replicas, chosen under a memory budget, absent at R=1."""
import json

import pytest

from tests.test_planner import _layers
from tests.test_planner_tensor_parallel import _layers as tp_layers
from tfpipe.tuning import planner, sharding_plan, simulator

R = 4
DEVICE = simulator.DeviceModel(latency=1e-4, bandwidth=1e9)


def _search(memory=None, replicas=R, **options):
    return planner.search(_layers(), 16, 1, planner.DeviceProfile(DEVICE, memory),
                          micro_batches=(4,), recompute=('always',), schedules=('1f1b',),
                          replicas=replicas, **options)


def test_no_stage_is_offered_at_one_replica():
    configs = _search(replicas=1)
    assert {c.sharding for c in configs} == {'none'}
    assert not any(c.set_sharding for c in configs)
    assert 'sharding' not in configs[0].to_json()
    assert 'task.train.sharding' not in configs[0].overrides()
    assert 'sharding' not in planner.format_table(configs)


def test_every_stage_is_offered_at_r_replicas_and_none_wins_when_all_fit():
    configs = _search()
    assert [c.sharding for c in configs] == ['none', 'gradients', 'weights', 'optimizer_states']
    none, gradients, weights, states = configs
    # Slots (2 MB per layer, 8 layers on one cell) at 1/R from stage 1 on; stage 3 holds
    # its weight shards beside the gathered cell.
    assert max(none.peak_bytes) - max(states.peak_bytes) == 16e6 * (1 - 1 / R)
    assert max(gradients.peak_bytes) == max(states.peak_bytes)
    assert max(weights.peak_bytes) - max(gradients.peak_bytes) == 8e6 / R
    assert none.step_time < gradients.step_time < states.step_time
    assert configs[0].overrides()['task.train.sharding'] == 'none'


def test_a_budget_only_a_sharded_stage_fits_picks_it():
    whole = max(_search()[0].peak_bytes)
    best = planner.best_fitting(_search(memory=whole - 1), whole - 1)
    assert best.sharding == 'gradients'  # as little memory as stage 1, less traffic
    assert 'sharding=gradients' in best.describe()
    assert json.loads(json.dumps(best.to_json()))['sharding'] == 'gradients'
    assert 'gradients' in planner.format_table([best])


def test_weights_are_offered_with_tensor_parallel_cells():
    """And with expert-parallel ones (tests/test_planner_expert_parallel.py)."""
    assert 'weights' in {c.sharding for c in _search()}  # tied weights too (ties.py)
    assert sharding_plan.stages(R) == ('none', 'optimizer_states', 'gradients', 'weights')
    configs = planner.search(tp_layers(), 16, 2, planner.DeviceProfile(DEVICE),
                             micro_batches=(4,), recompute=('always',), schedules=('1f1b',),
                             replicas=R, tensor_parallel=(2,), cells=[1])
    by_stage = {c.sharding: c for c in configs}
    assert sorted(by_stage) == ['gradients', 'none', 'optimizer_states', 'weights']
    assert {c.tensor_parallel for c in configs} == {2}
    # Stage 3 holds 1/R of each device's shard of the weights (4 x 1 MB split over T=2).
    assert max(by_stage['weights'].peak_bytes) - max(by_stage['gradients'].peak_bytes) == \
        pytest.approx(4e6 / 2 / R)
