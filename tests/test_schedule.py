"""Tests for tfpipe.pipeline.schedule: schedules as data, checked rule by rule."""
import itertools

import pytest

from tfpipe.pipeline import schedule as sch
from tfpipe.pipeline.schedule import BACKWARD, FORWARD, Task

SIZES = [(1, 1), (1, 3), (3, 1), (3, 3), (4, 2)]


def F(k, m):
    return Task(k, m, FORWARD)


def B(k, m):
    return Task(k, m, BACKWARD)


def test_fill_drain_1x1():
    assert sch.fill_drain(1, 1) == [[F(0, 0)], [B(0, 0)]]


def test_fill_drain_3x1():
    assert sch.fill_drain(3, 1) == [
        [F(0, 0)], [F(1, 0)], [F(2, 0)],
        [B(2, 0)], [B(1, 0)], [B(0, 0)],
    ]


def test_fill_drain_4x2():
    assert sch.fill_drain(4, 2) == [
        [F(0, 0)],
        [F(0, 1), F(1, 0)],
        [F(1, 1), F(2, 0)],
        [F(2, 1), F(3, 0)],
        [F(3, 1)],
        [B(3, 1)],
        [B(2, 1), B(3, 0)],
        [B(1, 1), B(2, 0)],
        [B(0, 1), B(1, 0)],
        [B(0, 0)],
    ]


def test_fill_drain_1x3():
    assert sch.fill_drain(1, 3) == [
        [F(0, 0)], [F(0, 1)], [F(0, 2)],
        [B(0, 2)], [B(0, 1)], [B(0, 0)],
    ]


@pytest.mark.parametrize('k,m', SIZES)
def test_fill_drain_structure(k, m):
    schedule = sch.fill_drain(k, m)
    assert len(schedule) == 2 * (m + k - 1)
    sch.validate(schedule, k, m)
    for tick in schedule:
        assert tick == sorted(tick)
        assert tick, 'fill-drain has no empty ticks'
    for cell in range(k):
        expected = ([F(cell, i) for i in range(m)]
                    + [B(cell, i) for i in reversed(range(m))])
        assert sch.cell_order(schedule, cell) == expected


@pytest.mark.parametrize('builder', [sch.fill_drain, sch.one_f_one_b])
@pytest.mark.parametrize('k,m,bad', [(0, 2, 'num_cells is 0'),
                                     (2, 0, 'num_micro_batches is 0'),
                                     (-1, 2, 'num_cells is -1')])
def test_builders_reject_bad_sizes(builder, k, m, bad):
    with pytest.raises(ValueError, match=bad + '.*>= 1'):
        builder(k, m)


@pytest.mark.parametrize('k,m', list(itertools.product(range(1, 7), range(1, 7))))
def test_one_f_one_b_valid_and_bounded(k, m):
    schedule = sch.one_f_one_b(k, m)
    sch.validate(schedule, k, m)
    for cell in range(k):
        order = sch.cell_order(schedule, cell)
        in_flight = 0
        for task in order:
            in_flight += 1 if task.phase == FORWARD else -1
            assert 0 <= in_flight <= k - cell
        backwards = [t.micro_batch for t in order if t.phase == BACKWARD]
        assert backwards == list(range(m))
        warmup = min(k - cell, m)
        assert [t.phase for t in order[:warmup]] == [FORWARD] * warmup


def test_one_f_one_b_order_4x4():
    schedule = sch.one_f_one_b(4, 4)
    assert sch.cell_order(schedule, 3) == [F(3, 0), B(3, 0), F(3, 1), B(3, 1),
                                           F(3, 2), B(3, 2), F(3, 3), B(3, 3)]
    assert sch.cell_order(schedule, 2) == [F(2, 0), F(2, 1), B(2, 0), F(2, 2),
                                           B(2, 1), F(2, 3), B(2, 2), B(2, 3)]


def _good():
    return sch.fill_drain(2, 2)


def _without(schedule, task):
    return [[t for t in tick if t != task] for tick in schedule]


def test_validate_missing_task():
    with pytest.raises(ValueError, match=r'missing.*exactly once'):
        sch.validate(_without(_good(), B(0, 0)), 2, 2)


def test_validate_duplicate_task():
    schedule = _good() + [[F(0, 0)]]
    with pytest.raises(ValueError, match=r'runs twice.*exactly once'):
        sch.validate(schedule, 2, 2)


def test_validate_two_tasks_one_cell_one_tick():
    # F(0,1) moved into tick 0 next to F(0,0).
    schedule = _without(_good(), F(0, 1))
    schedule[0].append(F(0, 1))
    with pytest.raises(ValueError, match=r'device 0 runs two tasks at tick 0'):
        sch.validate(schedule, 2, 2)


def test_validate_forward_before_previous_cell():
    # F(1,0) in the same tick as F(0,0): concurrent is not "after".
    schedule = _without(_good(), F(1, 0))
    schedule[0].append(F(1, 0))
    with pytest.raises(ValueError, match=r'must run after Task\(cell=0, micro_batch=0, '
                                         r"phase='forward'\)"):
        sch.validate(schedule, 2, 2)


def test_validate_backward_before_own_forward():
    schedule = [[B(0, 0)], [F(0, 0)]]
    with pytest.raises(ValueError, match=r"must run after Task\(cell=0, micro_batch=0, "
                                         r"phase='forward'\)"):
        sch.validate(schedule, 1, 1)


def test_validate_backward_before_next_cell_backward():
    schedule = [[F(0, 0)], [F(1, 0)], [B(0, 0)], [B(1, 0)]]
    with pytest.raises(ValueError, match=r"must run after Task\(cell=1, micro_batch=0, "
                                         r"phase='backward'\)"):
        sch.validate(schedule, 2, 1)


@pytest.mark.parametrize('task,match', [
    (Task(2, 0, FORWARD), r'names cell 2 but there are 2 cells'),
    (Task(0, 5, FORWARD), r'names micro-batch 5 but there are 2'),
    (Task(0, 0, 'sideways'), r"unknown phase 'sideways'"),
])
def test_validate_out_of_range(task, match):
    schedule = _good() + [[task]]
    with pytest.raises(ValueError, match=match):
        sch.validate(schedule, 2, 2)


def test_validate_rejects_non_task():
    with pytest.raises(ValueError, match='not a Task'):
        sch.validate([[('F', 0)]], 1, 1)


def test_bubble_fraction():
    assert sch.bubble_fraction(1, 1) == 0.0
    assert sch.bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert sch.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert sch.bubble_fraction(4, 32) == pytest.approx(3 / 35)
    with pytest.raises(ValueError, match='num_micro_batches is 0'):
        sch.bubble_fraction(2, 0)


def test_render_2x2():
    assert sch.render(sch.fill_drain(2, 2)) == (
        'cell 0: F0 F1 .. .. B1 B0\n'
        'cell 1: .. F0 F1 B1 B0 ..')


def test_render_pads_wide_labels():
    lines = sch.render(sch.fill_drain(1, 11)).splitlines()
    assert lines == ['cell 0: ' + ' '.join(
        [f'F{m}'.rjust(3) for m in range(11)]
        + [f'B{m}'.rjust(3) for m in reversed(range(11))])]


def test_render_empty():
    assert sch.render([]) == ''


# -- Schedules past GPipe: interleaved virtual stages and zero-bubble -----------------------

BI, BW = sch.BACKWARD_INPUT, sch.BACKWARD_WEIGHT


@pytest.mark.parametrize('k,m,v', [(k, m, v) for k in (1, 2, 3, 4) for v in (1, 2, 3)
                                   for m in (k, 2 * k, 3 * k)])
def test_interleaved_valid_with_the_formula_bubble(k, m, v):
    schedule = sch.interleaved_one_f_one_b(k, m, v)
    sch.validate(schedule, k * v, m, num_devices=k)
    assert len(schedule) == 2 * (v * m + k - 1)
    assert sch.idle_slots(schedule, k) / (len(schedule) * k) == pytest.approx(
        (k - 1) / (v * m + k - 1))
    for d in range(k):
        cells = {t.cell for t in sch.device_order(schedule, d, k)}
        assert cells == {d + c * k for c in range(v)}, 'cell j runs on device j mod K'


def test_interleaved_order_on_two_devices():
    """Device 0 holds cells 0 and 2: forwards go chunk by chunk in groups of K."""
    order = sch.device_order(sch.interleaved_one_f_one_b(2, 2, 2), 0, 2)
    assert order[:4] == [F(0, 0), F(0, 1), F(2, 0), F(2, 1)]
    assert [t for t in order if t.phase == BACKWARD] == [B(2, 0), B(2, 1), B(0, 0), B(0, 1)]


@pytest.mark.parametrize('k,m,v,match', [
    (2, 3, 2, 'M=3 is not a multiple of 2'),
    (2, 4, 0, 'virtual_stages is 0'),
])
def test_interleaved_refuses_impossible_sizes(k, m, v, match):
    with pytest.raises(ValueError, match=match):
        sch.interleaved_one_f_one_b(k, m, v)


@pytest.mark.parametrize('builder', [sch.zb_h1, sch.zb_h2])
@pytest.mark.parametrize('k,m', [(k, m) for k in (1, 2, 3, 4, 6) for m in (k, k + 1, 2 * k, 13)
                                 if m >= k])
def test_zero_bubble_valid_and_at_the_lower_bound(builder, k, m):
    """Every F, B and W once, in dependency order; the step is 3M+K-1 unit ticks: the
    last cell cannot start before tick K-1 and has 3M ticks of work."""
    schedule = builder(k, m)
    sch.validate(schedule, k, m)
    assert sch.phases_of(schedule) == (FORWARD, BI, BW)
    assert len(schedule) == 3 * m + k - 1
    assert sch.idle_slots(schedule, k) == k * (k - 1)


def _awaiting_w(order):
    """Most micro-batches whose forward ran and whose W has not, along a cell's order."""
    peak = count = 0
    for task in order:
        count += {FORWARD: 1, BW: -1}.get(task.phase, 0)
        peak = max(peak, count)
    return peak


@pytest.mark.parametrize('k,m', [(2, 4), (4, 8), (4, 5), (3, 9)])
def test_zero_bubble_memory_and_bubble_against_one_f_one_b(k, m):
    """ZB-H1 holds at most K micro-batches on any cell (1F1B's peak, on its first cell)
    and idles a third of 1F1B's time with B and W counted separately; ZB-H2 holds 2K-1."""
    h1, h2 = sch.zb_h1(k, m), sch.zb_h2(k, m)
    assert max(_awaiting_w(sch.cell_order(h1, c)) for c in range(k)) == k
    assert max(_awaiting_w(sch.cell_order(h2, c)) for c in range(k)) <= 2 * k - 1
    # 1F1B with its fused backward taking two ticks: idle 3(K-1) per device.
    one_f_one_b_idle_per_device = 3 * (k - 1)
    assert sch.idle_slots(h1, k) / k * 3 == one_f_one_b_idle_per_device


def test_zb_h1_order_of_a_middle_cell():
    order = sch.cell_order(sch.zb_h1(4, 8), 1)
    assert order[:6] == [F(1, 0), F(1, 1), F(1, 2), Task(1, 0, BI), F(1, 3), Task(1, 1, BI)]
    assert order[-2:] == [Task(1, 6, BW), Task(1, 7, BW)]


def test_render_split_and_virtual():
    assert sch.render(sch.zb_h1(2, 2)).splitlines()[1] == 'cell 1: .. F0 B0 F1 B1 W0 W1'
    lines = sch.render(sch.interleaved_one_f_one_b(2, 2, 2), num_devices=2).splitlines()
    assert lines[0].startswith('device 0: F0:0 F1:0 F0:2 F1:2')


def test_validate_rejects_mixed_phases_and_w_before_b():
    schedule = sch.zb_h1(2, 2)
    mixed = [list(tick) for tick in schedule] + [[B(0, 0)]]
    with pytest.raises(ValueError, match='not a mix'):
        sch.validate(mixed, 2, 2)
    swapped = [[Task(t.cell, t.micro_batch, {BI: BW, BW: BI}.get(t.phase, t.phase))
                if t.cell == 0 and t.micro_batch == 1 else t for t in tick] for tick in schedule]
    with pytest.raises(ValueError, match='must run after'):
        sch.validate(swapped, 2, 2)


def test_simulate_reports_a_deadlocking_order():
    with pytest.raises(ValueError, match='deadlock'):
        sch.simulate([[B(0, 0), F(0, 0)]], 1)
