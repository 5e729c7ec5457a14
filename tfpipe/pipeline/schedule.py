"""The pipeline schedule as plain data.

A schedule is a list of clock ticks; each tick is a list of tasks that may run
at the same time because each sits on its own device. Keeping the schedule as
data, with no TensorFlow in sight, lets the executor turn it into control
dependencies mechanically, and lets tests and docs check and draw it without
building a graph.

A task names a *cell* (a stage of consecutive layers). Usually cell k runs on
device k; with virtual stages (interleaved 1F1B) there are K*v cells and cell
j runs on device j mod K. Phases:

- FORWARD (F): the cell's forward on one micro-batch;
- BACKWARD (B): its whole backward, input and weight gradients together;
- BACKWARD_INPUT (B) and BACKWARD_WEIGHT (W): the backward split in two, as
  zero-bubble schedules do. The previous cell waits only for B (the gradient
  with respect to the cell's input); W (the weight gradients) waits for the
  cell's own B and nobody waits for it, so W can fill idle time.

Builders: `fill_drain` (GPipe), `one_f_one_b` (PipeDream-flush),
`interleaved_one_f_one_b` (Megatron's virtual stages), `zb_h1` and `zb_h2`
(Qi et al., ICLR 2024). With unit costs (every F, B and W one tick; a fused B
also one tick) their step lengths are, for K devices and M micro-batches:
fill-drain and 1F1B 2(M+K-1), interleaved 2(vM+K-1) (M a multiple of K), and
ZB-H1 and ZB-H2 3M+K-1 (M >= K), against 3M+3(K-1) for 1F1B with its backward
counted as B plus W.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

FORWARD = 'forward'
BACKWARD = 'backward'
BACKWARD_INPUT = 'backward_input'
BACKWARD_WEIGHT = 'backward_weight'
# Not a task of any schedule: a recomputing cell replays its forward at the start of its
# backward task; the recorder and the simulator name that part of the backward RECOMPUTE.
RECOMPUTE = 'recompute'
_PHASES = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
_FUSED = (FORWARD, BACKWARD)
_SPLIT = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
_LABELS = {FORWARD: 'F', BACKWARD: 'B', BACKWARD_INPUT: 'B', BACKWARD_WEIGHT: 'W'}


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


def dependencies(task: Task, num_cells: int) -> list[Task]:
    """Tasks that must have finished (in an earlier tick) before ``task`` runs.

    F(k, m) needs F(k-1, m); a backward of cell k (fused B, or the input part of
    a split one) needs F(k, m) and the backward of cell k+1 that produces its
    incoming gradient; W(k, m) needs B(k, m) of its own cell only.
    """
    k, m = task.cell, task.micro_batch
    if task.phase == FORWARD:
        return [Task(k - 1, m, FORWARD)] if k > 0 else []
    if task.phase == BACKWARD_WEIGHT:
        return [Task(k, m, BACKWARD_INPUT)]
    deps = [Task(k, m, FORWARD)]
    if k + 1 < num_cells:
        deps.append(Task(k + 1, m, task.phase))
    return deps


def simulate(orders: list[list[Task]], num_cells: int) -> Schedule:
    """Ticks of a unit-time run of per-device task orders.

    At every tick each device starts the next task of its order if all of that
    task's dependencies finished in an earlier tick. An order that can never
    finish (a task waits on one that comes later on the same device) is an
    error, not a hang.
    """
    cursor = [0] * len(orders)
    done: set[Task] = set()
    remaining = sum(len(o) for o in orders)
    ticks: Schedule = []
    while remaining:
        tick = [order[cursor[d]] for d, order in enumerate(orders)
                if cursor[d] < len(order) and
                all(dep in done for dep in dependencies(order[cursor[d]], num_cells))]
        if not tick:
            stuck = [order[cursor[d]] for d, order in enumerate(orders) if cursor[d] < len(order)]
            raise ValueError(f'the per-device orders deadlock: {stuck} wait on tasks that never '
                             'run first; fix the order')
        for d, order in enumerate(orders):
            if cursor[d] < len(order) and order[cursor[d]] in tick:
                cursor[d] += 1
        done.update(tick)
        remaining -= len(tick)
        ticks.append(sorted(tick))
    return ticks


def one_f_one_b(num_cells: int, num_micro_batches: int) -> Schedule:
    """PipeDream-flush (1F1B) schedule.

    Cell k runs ``min(K-k, M)`` warm-up forwards, then alternates one backward
    and one forward, then drains the remaining backwards (backward
    micro-batches in increasing order). Compared with fill-drain it has the
    same bubble but holds at most ``K-k`` micro-batches of activations on cell
    k instead of M, which is why it exists.
    """
    _check_sizes(num_cells, num_micro_batches)
    return simulate([_one_f_one_b_order(k, num_cells, num_micro_batches)
                     for k in range(num_cells)], num_cells)


def interleaved_one_f_one_b(num_devices: int, num_micro_batches: int,
                            virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: K*v cells, cell j on device j mod K.

    Each device holds v non-adjacent chunks of the model, so a micro-batch
    crosses every device v times and the fill and drain are v times shorter:
    the bubble falls from (K-1)/(M+K-1) to (K-1)/(vM+K-1) of the step. Device
    d runs forwards in groups of K micro-batches per chunk (chunk 0 of micro-
    batches 0..K-1, then chunk 1 of them, ...), (K-d-1)*2 + (v-1)*K of them as
    warm-up, then alternates forward and backward; backwards take the chunks in
    reverse. Groups of K need M to be a multiple of K (as in Megatron).
    """
    _check_sizes(num_devices, num_micro_batches)
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or \
            virtual_stages < 1:
        raise ValueError(f'virtual_stages is {virtual_stages!r}: use an int >= 1 (1 is plain '
                         '1F1B)')
    k_, m_, v = num_devices, num_micro_batches, virtual_stages
    if v > 1 and m_ % k_:
        raise ValueError(f'interleaved_1f1b runs micro-batches in groups of K={k_}, but M='
                         f'{m_} is not a multiple of {k_}: set num_micro_batches to a multiple '
                         f'of {k_} (e.g. {k_ * -(-m_ // k_)}), or virtual_stages=1')
    if v == 1:
        return one_f_one_b(k_, m_)

    def task(i: int, d: int, phase: str) -> Task:
        group, within = divmod(i, k_ * v)
        chunk = within // k_ if phase == FORWARD else v - 1 - within // k_
        return Task(chunk * k_ + d, group * k_ + within % k_, phase)

    orders = []
    total = m_ * v
    for d in range(k_):
        warmup = min(total, (k_ - d - 1) * 2 + (v - 1) * k_)
        order = [task(i, d, FORWARD) for i in range(warmup)]
        for i in range(total - warmup):
            order += [task(warmup + i, d, FORWARD), task(i, d, BACKWARD)]
        order += [task(i, d, BACKWARD) for i in range(total - warmup, total)]
        orders.append(order)
    return simulate(orders, k_ * v)


def zb_h1(num_cells: int, num_micro_batches: int) -> Schedule:
    """Zero-bubble ZB-H1: 1F1B's peak memory, a third of its bubble (Qi et al.).

    The backward is split into B and W. Cell k runs K-k-1 warm-up forwards,
    then k (F, B) pairs whose W it postpones, then (F, B, W) triples, then the
    remaining (B, W) pairs and finally the postponed Ws: the Ws fill what would
    be idle ticks, while at most K micro-batches await their W on any cell, the
    number 1F1B holds on its first cell. On unit costs a step takes 3M+K-1
    ticks (M >= K) instead of 1F1B's 3M+3(K-1).
    """
    _check_sizes(num_cells, num_micro_batches)
    orders = []
    for k in range(num_cells):
        m_ = num_micro_batches
        warmup = min(num_cells - k - 1, m_)
        postponed = min(k, m_ - warmup)  # (F, B) pairs whose W waits
        f = warmup + postponed
        order = [Task(k, m, FORWARD) for m in range(warmup)]
        for i in range(postponed):
            order += [Task(k, warmup + i, FORWARD), Task(k, i, BACKWARD_INPUT)]
        for i in range(m_ - f):  # (F, B, W) triples
            order += [Task(k, f + i, FORWARD), Task(k, postponed + i, BACKWARD_INPUT),
                      Task(k, i, BACKWARD_WEIGHT)]
        b, w = postponed + m_ - f, m_ - f
        for i in range(m_ - b):
            order += [Task(k, b + i, BACKWARD_INPUT), Task(k, w + i, BACKWARD_WEIGHT)]
        order += [Task(k, m, BACKWARD_WEIGHT) for m in range(w + m_ - b, m_)]
        orders.append(order)
    return simulate(orders, num_cells)


def zb_h2(num_cells: int, num_micro_batches: int) -> Schedule:
    """Zero-bubble ZB-H2: more memory (2K-1 micro-batches awaiting W), no idle in between.

    List scheduling on unit costs: each tick a cell runs a ready B if it has
    one, else its next forward while fewer than 2K-1 micro-batches await their
    W, else its oldest pending W. The extra warm-up forwards fill the head of
    the step and the Ws fill its tail, so every cell is busy from its first to
    its last task (the paper's parallelogram); the step takes 3M+K-1 ticks.
    """
    _check_sizes(num_cells, num_micro_batches)
    k_, m_ = num_cells, num_micro_batches
    limit = 2 * k_ - 1
    finish: dict[Task, int] = {}
    next_f, next_b, pending_w = [0] * k_, [0] * k_, [[] for _ in range(k_)]
    in_flight = [0] * k_
    ticks: Schedule = []
    while len(finish) < 3 * k_ * m_:
        t = len(ticks)
        tick = []
        for k in range(k_):
            ready = [task for task in (
                Task(k, next_b[k], BACKWARD_INPUT) if next_b[k] < m_ else None,
                Task(k, next_f[k], FORWARD) if next_f[k] < m_ and in_flight[k] < limit
                else None,
                Task(k, pending_w[k][0], BACKWARD_WEIGHT) if pending_w[k] else None)
                if task is not None and
                all(finish.get(dep, t + 1) <= t for dep in dependencies(task, k_))]
            if ready:
                tick.append(ready[0])
        if not tick and ticks and not ticks[-1]:  # unit costs: nothing is still running
            raise RuntimeError('zb_h2 list scheduling made no progress; this is a bug')
        for task in tick:
            finish[task] = t + 1
            k = task.cell
            if task.phase == FORWARD:
                next_f[k] += 1
                in_flight[k] += 1
            elif task.phase == BACKWARD_INPUT:
                next_b[k] += 1
                pending_w[k].append(task.micro_batch)
            else:
                pending_w[k].pop(0)
                in_flight[k] -= 1
        ticks.append(tick)
    return ticks


def cell_order(schedule: Schedule, cell: int) -> list[Task]:
    """The tasks of ``cell`` in the order its device runs them.

    The executor chains each device's tasks with control dependencies, so this
    (or `device_order` with virtual stages) is the per-device program that a
    schedule stands for.
    """
    return [task for tick in schedule for task in tick if task.cell == cell]


def device_order(schedule: Schedule, device: int, num_devices: int) -> list[Task]:
    """The tasks of every cell on ``device`` (cells j with j mod K == device), in order."""
    return [task for tick in schedule for task in tick if task.cell % num_devices == device]


def phases_of(schedule: Schedule) -> tuple[str, ...]:
    """(F, B) for a fused backward, (F, B, W) for a split one."""
    split = any(getattr(task, 'phase', None) in (BACKWARD_INPUT, BACKWARD_WEIGHT)
                for tick in schedule for task in tick)
    return _SPLIT if split else _FUSED


def validate(schedule: Schedule, num_cells: int, num_micro_batches: int,
             num_devices: int | None = None) -> None:
    """Check that ``schedule`` is a legal pipeline schedule; raise ValueError if not.

    Rules: every task names a real cell, micro-batch and phase; every phase of
    every (cell, micro-batch) occurs exactly once, either as F and B or as F, B
    and W; at most one task per device per tick (cell j on device j mod
    ``num_devices``, default one device per cell); and each task runs after its
    `dependencies`. "After" means in a strictly later tick, since tasks in one
    tick run concurrently.
    """
    _check_sizes(num_cells, num_micro_batches)
    num_devices = num_devices or num_cells
    phases = phases_of(schedule)
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
                    f'{task} at tick {t} has unknown phase {task.phase!r}: use one of '
                    f'{list(_PHASES)}.')
            if task.phase not in phases:
                raise ValueError(
                    f'{task} at tick {t} has phase {task.phase!r}: a schedule uses either '
                    f'{list(_FUSED)} or {list(_SPLIT)}, not a mix.')
            if not 0 <= task.cell < num_cells:
                raise ValueError(
                    f'{task} at tick {t} names cell {task.cell} but there are '
                    f'{num_cells} cells: use cells 0..{num_cells - 1}.')
            if not 0 <= task.micro_batch < num_micro_batches:
                raise ValueError(
                    f'{task} at tick {t} names micro-batch {task.micro_batch} but there '
                    f'are {num_micro_batches}: use micro-batches 0..{num_micro_batches - 1}.')
            device = task.cell % num_devices
            if device in busy:
                raise ValueError(
                    f'device {device} runs two tasks at tick {t}: a device runs one task '
                    'per tick; move one of them to another tick.')
            busy.add(device)
            if task in tick_of:
                raise ValueError(
                    f'{task} runs twice (ticks {tick_of[task]} and {t}): every task '
                    'must run exactly once; remove the duplicate.')
            tick_of[task] = t
    for k in range(num_cells):
        for m in range(num_micro_batches):
            for phase in phases:
                if Task(k, m, phase) not in tick_of:
                    raise ValueError(
                        f'{Task(k, m, phase)} is missing: every task must run exactly '
                        'once; add it to a tick.')
    for task, t in tick_of.items():
        for dep in dependencies(task, num_cells):
            if tick_of[dep] >= t:
                raise ValueError(
                    f'{task} at tick {t} must run after {dep} (tick {tick_of[dep]}): '
                    f'move it to a tick after {tick_of[dep]}.')


def idle_slots(schedule: Schedule, num_devices: int) -> int:
    """Device-ticks with nothing to run over the schedule's whole length (unit costs)."""
    busy = sum(len(tick) for tick in schedule)
    return len(schedule) * num_devices - busy


def bubble_fraction(num_cells: int, num_micro_batches: int) -> float:
    """Idle fraction of fill-drain, ``(K-1) / (M+K-1)`` (GPipe paper, section 2.2).

    It is why M should be several times K: with M >= 4K the bubble is small.
    """
    _check_sizes(num_cells, num_micro_batches)
    return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def render(schedule: Schedule, num_devices: int | None = None) -> str:
    """ASCII chart: one row per device, one column per tick ('F0', 'B3', 'W1', '..' idle).

    With virtual stages (more cells than devices) labels carry the cell
    ('F0:2' is micro-batch 0 on cell 2). Meant for docs and for eyeballing a
    schedule while debugging.
    """
    num_cells = 1 + max((task.cell for tick in schedule for task in tick), default=-1)
    num_devices = num_devices or num_cells
    virtual = num_cells > num_devices

    def label(task: Task) -> str:
        text = f'{_LABELS[task.phase]}{task.micro_batch}'
        return f'{text}:{task.cell}' if virtual else text

    labels = [[label(task) for task in tick] for tick in schedule]
    width = max((len(text) for tick in labels for text in tick), default=2)
    rows = [['.' * width] * len(schedule) for _ in range(num_devices)]
    for t, tick in enumerate(schedule):
        for task, text in zip(tick, labels[t]):
            rows[task.cell % num_devices][t] = text.rjust(width)
    name = 'device' if virtual else 'cell'
    name_width = len(str(max(num_devices - 1, 0)))
    return '\n'.join(f'{name} {k:>{name_width}}: ' + ' '.join(row)
                      for k, row in enumerate(rows))


# -- The schedules PipeliningLayer runs, by name ------------------------------------

@dataclasses.dataclass(frozen=True)
class ScheduleEntry:
    """A schedule the layer can run, and whether FProp under an outer tape can run it.

    Under an outer `tf.GradientTape` the backward tasks are only issued when the
    tape calls the pipeline's custom gradient, i.e. after every forward task has
    been built: a schedule that interleaves a cell's backwards with its forwards
    (1F1B) cannot be followed there, so FProp refuses it rather than silently
    running another order. `tests/test_pipeline_knobs.py` checks each flag against
    the schedule's data, so a new schedule cannot claim it wrongly.
    """

    # (num_devices K, num_micro_batches M, virtual_stages v) -> the schedule's data
    build: Callable[[int, int, int], Schedule]
    forwards_first: bool  # every cell runs all its forwards before any backward


SCHEDULES = {
    'fill_drain': ScheduleEntry(lambda k, m, v: fill_drain(k * v, m), True),
    '1f1b': ScheduleEntry(lambda k, m, v: one_f_one_b(k, m), False),
    'interleaved_1f1b': ScheduleEntry(interleaved_one_f_one_b, False),
    'zb_h1': ScheduleEntry(lambda k, m, v: zb_h1(k, m), False),
    'zb_h2': ScheduleEntry(lambda k, m, v: zb_h2(k, m), False),
}
