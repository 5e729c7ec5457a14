"""The pipeline simulator: textbook bubble, dependencies, memory, shared devices."""
from fractions import Fraction

import pytest

from tfpipe.pipeline import schedule
from tfpipe.tuning import simulator
from tfpipe.pipeline.schedule import BACKWARD, FORWARD, Task

SCHEDULES = [schedule.fill_drain, schedule.one_f_one_b]


@pytest.mark.parametrize('make', SCHEDULES)
@pytest.mark.parametrize('k,m', [(1, 1), (2, 1), (2, 2), (2, 4), (2, 8), (3, 5), (4, 4),
                                 (4, 16), (8, 32)])
def test_unit_costs_give_the_analytical_bubble_exactly(make, k, m):
    result = simulator.simulate(make(k, m), simulator.unit_costs(k))
    assert result.bubble == Fraction(k - 1, m + k - 1)
    assert result.step_time == 2 * (m + k - 1)
    assert result.busy == [2 * m] * k


@pytest.mark.parametrize('make', SCHEDULES)
def test_tasks_respect_dependencies_and_device_order(make):
    k, m = 3, 4
    costs = [simulator.CellCosts(time={FORWARD: Fraction(c), BACKWARD: Fraction(2 * c)})
             for c in (1, 3, 2)]
    result = simulator.simulate(make(k, m), costs)
    for c in range(k):
        order = schedule.cell_order(make(k, m), c)
        for a, b in zip(order, order[1:]):
            assert result.end[a] <= result.start[b]
        for mb in range(m):
            if c > 0:
                assert result.end[Task(c - 1, mb, FORWARD)] <= result.start[Task(c, mb, FORWARD)]
            if c + 1 < k:
                assert (result.end[Task(c + 1, mb, BACKWARD)]
                        <= result.start[Task(c, mb, BACKWARD)])
    # The slowest cell bounds the step: M forwards and backwards of cell 1 at least.
    assert result.step_time >= m * 9


def test_fill_drain_stashes_every_micro_batch_1f1b_at_most_k_minus_k():
    k, m = 4, 8
    cells = [simulator.CellCosts(time={FORWARD: 1, BACKWARD: 1}, static_bytes=100,
                                 stash_bytes=10, working_bytes=1) for _ in range(k)]
    fill = simulator.simulate(schedule.fill_drain(k, m), cells)
    one = simulator.simulate(schedule.one_f_one_b(k, m), cells)
    assert fill.peak_bytes == [100 + 10 * m + 1] * k
    assert one.peak_bytes == [100 + 10 * (k - c) + 1 for c in range(k)]


def test_shared_cores_serialise_the_work():
    k, m = 2, 4
    alone = simulator.simulate(schedule.fill_drain(k, m), simulator.unit_costs(k),
                               simulator.DeviceModel(parallelism=1))
    assert alone.step_time == 2 * m * k  # one core: the total work, no overlap
    faster = simulator.simulate(schedule.fill_drain(k, m), simulator.unit_costs(k),
                                simulator.DeviceModel(speed=2.0))
    assert faster.step_time == pytest.approx((m + k - 1))


def test_link_time_delays_the_next_cell():
    cells = [simulator.CellCosts(time={FORWARD: 1.0, BACKWARD: 1.0}, output_bytes=1e6)
             for _ in range(2)]
    free = simulator.simulate(schedule.fill_drain(2, 1), cells)
    slow = simulator.simulate(schedule.fill_drain(2, 1), cells,
                              simulator.DeviceModel(bandwidth=1e6))
    assert slow.step_time == pytest.approx(free.step_time + 2.0)  # one second each way


def test_measured_recompute_is_charged_to_the_backward_task():
    measured = {(0, FORWARD): 1.0, (0, 'recompute'): 1.0, (0, BACKWARD): 2.0,
                (1, FORWARD): 1.0, (1, BACKWARD): 2.0}
    cells = simulator.costs_from_measurements(measured, 2)
    result = simulator.simulate(schedule.fill_drain(2, 1), cells)
    assert result.end[Task(0, 0, BACKWARD)] - result.start[Task(0, 0, BACKWARD)] == 3.0
    assert result.step_time == 1 + 1 + 2 + 3


def test_a_deadlocking_order_is_reported():
    bad = [[Task(0, 0, BACKWARD)], [Task(0, 0, FORWARD)]]
    with pytest.raises(RuntimeError, match='deadlocks'):
        simulator.simulate(bad, simulator.unit_costs(1))


def _split_backward(sched):
    """Fill-drain with every backward split into input (B) and weight (W) parts, W next tick."""
    out = []
    for tick in sched:
        out.append([Task(t.cell, t.micro_batch, simulator.BACKWARD_INPUT)
                    if t.phase == BACKWARD else t for t in tick])
        weights = [Task(t.cell, t.micro_batch, simulator.BACKWARD_WEIGHT)
                   for t in tick if t.phase == BACKWARD]
        if weights:
            out.append(weights)
    return out


def test_split_backward_phases_play_with_their_own_dependencies():
    k, m = 3, 4
    sched = _split_backward(schedule.fill_drain(k, m))
    split = [simulator.CellCosts(time={FORWARD: 1, simulator.BACKWARD_INPUT: 1,
                                       simulator.BACKWARD_WEIGHT: 1}) for _ in range(k)]
    fused = [simulator.CellCosts(time={FORWARD: 1, BACKWARD: 2}) for _ in range(k)]
    r = simulator.simulate(sched, split)
    for c in range(k):
        for mb in range(m):
            b_in = Task(c, mb, simulator.BACKWARD_INPUT)
            assert r.end[b_in] <= r.start[Task(c, mb, simulator.BACKWARD_WEIGHT)]
            if c + 1 < k:
                assert r.end[Task(c + 1, mb, simulator.BACKWARD_INPUT)] <= r.start[b_in]
    assert r.busy == [3 * m] * k
    # Nobody waits for W, so the split backward is never slower than the fused one.
    assert r.step_time <= simulator.simulate(schedule.fill_drain(k, m), fused).step_time
    # Without split costs each part gets half of the fused backward.
    halves = simulator.simulate(sched, fused)
    assert halves.busy == [3 * m] * k


def test_several_cells_per_device_run_in_order_on_that_device():
    k, m = 4, 2
    result = simulator.simulate(schedule.fill_drain(k, m), simulator.unit_costs(k),
                                num_devices=2)
    assert len(result.busy) == 2 and result.busy == [2 * m * 2] * 2
    for d in range(2):
        spans = sorted((result.start[t], result.end[t]) for t in result.start
                       if t.cell % 2 == d)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one task at a time


def _events(result, num_devices, gap=0.0):
    """The simulated tasks as measured timeline events; each task's first `gap` seconds
    (a per-task overhead) show as idle time before its event, as dispatch does."""
    from tfpipe.pipeline.recorder import Label
    from tfpipe.tuning.timeline import Event
    return [Event(Label(f'CPU:{t.cell % num_devices}', t.cell, t.micro_batch, t.phase),
                  float(result.start[t]) + gap, float(result.end[t])) for t in result.start]


def test_latency_delays_only_results_that_cross_devices():
    k, m = 2, 2
    base = simulator.simulate(schedule.fill_drain(k, m), simulator.unit_costs(k))
    late = simulator.simulate(schedule.fill_drain(k, m), simulator.unit_costs(k),
                              simulator.DeviceModel(latency=Fraction(1, 2)))
    # Fill-drain K=2: the first forward reaches cell 1 and the last backward returns.
    assert late.step_time == base.step_time + 1
    same = simulator.simulate(schedule.fill_drain(k, m), simulator.unit_costs(k),
                              simulator.DeviceModel(latency=Fraction(1, 2)), num_devices=1)
    assert same.step_time == 2 * m * k  # one device: nothing crosses


@pytest.mark.parametrize('parallelism', [None, 1, 2])
def test_measured_work_takes_out_the_sharing_the_simulator_puts_in(parallelism):
    k, m = 4, 4
    costs = [simulator.CellCosts(time={FORWARD: 1.0 + c, BACKWARD: 2.0 + c}) for c in range(k)]
    result = simulator.simulate(schedule.fill_drain(k, m), costs,
                                simulator.DeviceModel(parallelism=parallelism))
    events = _events(result, k)
    work = simulator.measured_work(events, parallelism)
    for event, w in zip(events, work):
        assert w == pytest.approx(costs[event.label.cell].time[event.label.phase])
    if parallelism == 1:  # the wall time of overlapping tasks is not their work
        assert any(e.duration > w + 1e-9 for e, w in zip(events, work))


def test_measured_gaps_separate_dispatch_from_hand_over():
    k, m = 3, 4
    gap, latency = 0.25, 0.5
    costs = [simulator.CellCosts(time={FORWARD: 1.0 + gap, BACKWARD: 2.0 + gap})
             for _ in range(k)]
    result = simulator.simulate(schedule.fill_drain(k, m), costs,
                                simulator.DeviceModel(latency=latency))
    local, remote = simulator.measured_gaps(_events(result, k, gap))
    assert local and remote
    assert local == pytest.approx([gap] * len(local))
    assert remote == pytest.approx([gap + latency] * len(remote))
