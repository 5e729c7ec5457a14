"""The pipeline schedule as plain data.

A schedule is a list of clock ticks; each tick is a list of tasks that may run
at the same time because each sits on its own cell (device). Keeping the
schedule as data, with no TensorFlow in sight, lets the executor turn it into
control dependencies mechanically, and lets tests and docs check and draw it
without building a graph.
"""
from __future__ import annotations

import dataclasses

FORWARD = 'forward'
BACKWARD = 'backward'
_PHASES = (FORWARD, BACKWARD)


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One unit of work: run ``phase`` of cell ``cell`` on micro-batch ``micro_batch``.

    Frozen and ordered so tasks can be set members, dict keys and sorted
    deterministically (by cell first, which is how ticks are laid out).
    """

    cell: int
    micro_batch: int
    phase: str


Schedule = list[list[Task]]


def _check_sizes(num_cells: int, num_micro_batches: int) -> None:
    """Reject sizes that cannot form a pipeline, before any arithmetic on them."""
    if not isinstance(num_cells, int) or isinstance(num_cells, bool) or num_cells < 1:
        raise ValueError(
            f'num_cells is {num_cells!r}: a pipeline needs at least one cell; '
            'pass num_cells >= 1.')
    if (not isinstance(num_micro_batches, int) or isinstance(num_micro_batches, bool)
            or num_micro_batches < 1):
        raise ValueError(
            f'num_micro_batches is {num_micro_batches!r}: a pipeline needs at least '
            'one micro-batch; pass num_micro_batches >= 1.')


def fill_drain(num_cells: int, num_micro_batches: int) -> Schedule:
    """GPipe's fill-drain schedule: all forwards, then all backwards.

    Forward tick ``t`` runs F(k, m) for every ``k + m == t``, so micro-batch m
    enters cell k as soon as cell k-1 has produced it. The backward pass
    mirrors it: B(k, m) runs at ``(K-1-k) + (M-1-m)`` ticks after the last
    forward tick, i.e. the last micro-batch's gradient leaves the last cell
    first, which is the order in which gradients become available when the
    backward graph is the reverse of the forward graph. Total length is
    ``2 * (M + K - 1)`` ticks.
    """
    _check_sizes(num_cells, num_micro_batches)
    k_, m_ = num_cells, num_micro_batches
    span = m_ + k_ - 1
    ticks: Schedule = [[] for _ in range(2 * span)]
    for k in range(k_):
        for m in range(m_):
            ticks[k + m].append(Task(k, m, FORWARD))
            ticks[span + (k_ - 1 - k) + (m_ - 1 - m)].append(Task(k, m, BACKWARD))
    for tick in ticks:
        tick.sort()
    return ticks


def _one_f_one_b_order(cell: int, num_cells: int, num_micro_batches: int) -> list[Task]:
    """Per-cell task order of 1F1B: warm-up forwards, alternate B/F, drain Bs."""
    warmup = min(num_cells - cell, num_micro_batches)
    order = [Task(cell, m, FORWARD) for m in range(warmup)]
    for i in range(num_micro_batches - warmup):
        order.append(Task(cell, i, BACKWARD))
        order.append(Task(cell, warmup + i, FORWARD))
    for m in range(num_micro_batches - warmup, num_micro_batches):
        order.append(Task(cell, m, BACKWARD))
    return order


def _dependencies(task: Task, num_cells: int) -> list[Task]:
    """Tasks that must have finished (in an earlier tick) before ``task`` runs."""
    k, m = task.cell, task.micro_batch
    if task.phase == FORWARD:
        return [Task(k - 1, m, FORWARD)] if k > 0 else []
    deps = [Task(k, m, FORWARD)]
    if k + 1 < num_cells:
        deps.append(Task(k + 1, m, BACKWARD))
    return deps


def one_f_one_b(num_cells: int, num_micro_batches: int) -> Schedule:
    """PipeDream-flush (1F1B) schedule.

    Cell k runs ``min(K-k, M)`` warm-up forwards, then alternates one backward
    and one forward, then drains the remaining backwards (backward
    micro-batches in increasing order). Compared with fill-drain it has the
    same bubble but holds at most ``K-k`` micro-batches of activations on cell
    k instead of M, which is why it exists.

    Ticks come from a unit-time event simulation: at every tick each cell runs
    the next task in its order if all of that task's dependencies finished in
    an earlier tick.
    """
    _check_sizes(num_cells, num_micro_batches)
    orders = [_one_f_one_b_order(k, num_cells, num_micro_batches)
              for k in range(num_cells)]
    cursor = [0] * num_cells
    done: set[Task] = set()
    remaining = sum(len(o) for o in orders)
    ticks: Schedule = []
    while remaining:
        tick = []
        for k in range(num_cells):
            if cursor[k] < len(orders[k]):
                task = orders[k][cursor[k]]
                if all(dep in done for dep in _dependencies(task, num_cells)):
                    tick.append(task)
        if not tick:  # Unreachable for this order; guards future edits.
            raise RuntimeError('1F1B simulation deadlocked; the per-cell order is wrong.')
        for task in tick:
            cursor[task.cell] += 1
        done.update(tick)
        remaining -= len(tick)
        ticks.append(tick)
    return ticks


def cell_order(schedule: Schedule, cell: int) -> list[Task]:
    """The tasks of ``cell`` in the order its device runs them.

    The executor chains these with control dependencies, so this is the
    per-device program that a schedule stands for.
    """
    return [task for tick in schedule for task in tick if task.cell == cell]


def validate(schedule: Schedule, num_cells: int, num_micro_batches: int) -> None:
    """Check that ``schedule`` is a legal pipeline schedule; raise ValueError if not.

    Rules: every task names a real cell, micro-batch and phase; every F and B
    occurs exactly once; at most one task per cell per tick; F(k, m) after
    F(k-1, m); B(k, m) after F(k, m) and after B(k+1, m). "After" means in a
    strictly later tick, since tasks in one tick run concurrently.
    """
    _check_sizes(num_cells, num_micro_batches)
    tick_of: dict[Task, int] = {}
    for t, tick in enumerate(schedule):
        busy: set[int] = set()
        for task in tick:
            if not isinstance(task, Task):
                raise ValueError(
                    f'tick {t} holds {task!r}, which is not a Task: build schedules '
                    'from schedule.Task objects.')
            if task.phase not in _PHASES:
                raise ValueError(
                    f'{task} at tick {t} has unknown phase {task.phase!r}: use '
                    f'schedule.FORWARD or schedule.BACKWARD.')
            if not 0 <= task.cell < num_cells:
                raise ValueError(
                    f'{task} at tick {t} names cell {task.cell} but there are '
                    f'{num_cells} cells: use cells 0..{num_cells - 1}.')
            if not 0 <= task.micro_batch < num_micro_batches:
                raise ValueError(
                    f'{task} at tick {t} names micro-batch {task.micro_batch} but there '
                    f'are {num_micro_batches}: use micro-batches 0..{num_micro_batches - 1}.')
            if task.cell in busy:
                raise ValueError(
                    f'cell {task.cell} runs two tasks at tick {t}: a cell runs one task '
                    'per tick; move one of them to another tick.')
            busy.add(task.cell)
            if task in tick_of:
                raise ValueError(
                    f'{task} runs twice (ticks {tick_of[task]} and {t}): every forward and '
                    'backward must run exactly once; remove the duplicate.')
            tick_of[task] = t
    for k in range(num_cells):
        for m in range(num_micro_batches):
            for phase in _PHASES:
                if Task(k, m, phase) not in tick_of:
                    raise ValueError(
                        f'{Task(k, m, phase)} is missing: every forward and backward '
                        'must run exactly once; add it to a tick.')
    for task, t in tick_of.items():
        for dep in _dependencies(task, num_cells):
            if tick_of[dep] >= t:
                raise ValueError(
                    f'{task} at tick {t} must run after {dep} (tick {tick_of[dep]}): '
                    f'move it to a tick after {tick_of[dep]}.')


def bubble_fraction(num_cells: int, num_micro_batches: int) -> float:
    """Idle fraction of fill-drain, ``(K-1) / (M+K-1)`` (GPipe paper, section 2.2).

    It is why M should be several times K: with M >= 4K the bubble is small.
    """
    _check_sizes(num_cells, num_micro_batches)
    return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def render(schedule: Schedule) -> str:
    """ASCII chart: one row per cell, one column per tick ('F0', 'B3', '..' idle).

    Meant for docs and for eyeballing a schedule while debugging.
    """
    num_cells = 1 + max((task.cell for tick in schedule for task in tick), default=-1)
    labels = [[('F' if task.phase == FORWARD else 'B') + str(task.micro_batch)
               for task in tick] for tick in schedule]
    width = max((len(label) for tick in labels for label in tick), default=2)
    rows = [['.' * width] * len(schedule) for _ in range(num_cells)]
    for t, tick in enumerate(schedule):
        for task, label in zip(tick, labels[t]):
            rows[task.cell][t] = label.rjust(width)
    name_width = len(str(max(num_cells - 1, 0)))
    return '\n'.join(f'cell {k:>{name_width}}: ' + ' '.join(row)
                     for k, row in enumerate(rows))
