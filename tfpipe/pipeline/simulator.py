"""Plays a pipeline schedule with per-(cell, phase) costs: step time, bubble, peak memory.

The executor runs each device's tasks in the order `schedule.cell_order` gives,
and a task starts once the tasks it depends on are done. The simulator does
exactly that with numbers instead of ops, so a prediction uses the same
schedule data as the executor and any schedule (fill-drain, 1F1B, a custom
one) can be evaluated without building a graph.

Costs are per (cell, phase) and per micro-batch: profiled by the planner, or
measured from a traced step (a phase the schedule does not run as its own task,
such as 'recompute', is charged to the backward task that runs it). A device
model says how fast devices are and whether they really run in parallel:
logical CPUs of one host share its cores, which `parallelism` captures as
processor sharing (at most that many tasks progress at full speed at once).
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Mapping, Optional, Union

from tfpipe.pipeline import schedule as schedule_lib
from tfpipe.pipeline.schedule import BACKWARD, FORWARD, Schedule, Task

Number = Union[float, Fraction]
RECOMPUTE = 'recompute'


@dataclasses.dataclass
class CellCosts:
    """What one cell costs, per micro-batch unless said otherwise.

    `time[phase]` is seconds (or any unit) on a reference device. Memory in
    bytes: `static_bytes` lives all step (weights, optimizer slots, gradient
    sums); `stash_bytes` is held from a micro-batch's forward to its backward
    (the cell input when recomputing, all saved activations otherwise);
    `working_bytes` is held only while one of the cell's tasks runs.
    `output_bytes` is what goes to the next cell (activation forward, its
    gradient backward), for link time.
    """

    time: dict[str, Number]
    static_bytes: float = 0.0
    stash_bytes: float = 0.0
    working_bytes: float = 0.0
    output_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """How the simulated devices behave.

    speed: relative compute speed (costs are divided by it); parallelism: how
    many tasks progress at full speed at the same time (None: every device is
    independent, as with GPUs/TPUs; logical CPUs of one host share its cores);
    bandwidth: bytes/s between neighbouring devices (None: free transfers).
    """

    speed: float = 1.0
    parallelism: Optional[float] = None
    bandwidth: Optional[float] = None


@dataclasses.dataclass
class Result:
    """Per-device busy time and peak memory, the step time and the bubble."""

    step_time: Number
    busy: list[Number]
    peak_bytes: list[float]
    start: dict[Task, Number]
    end: dict[Task, Number]

    @property
    def idle(self) -> list[Number]:
        return [self.step_time - b for b in self.busy]

    @property
    def bubble(self) -> Number:
        """Idle fraction over all devices: 1 - busy / (devices * step time)."""
        return 1 - sum(self.busy) / (len(self.busy) * self.step_time)


def _dependencies(task: Task, num_cells: int) -> list[Task]:
    k, m = task.cell, task.micro_batch
    if task.phase == FORWARD:
        return [Task(k - 1, m, FORWARD)] if k > 0 else []
    deps = [Task(k, m, FORWARD)]
    if k + 1 < num_cells:
        deps.append(Task(k + 1, m, BACKWARD))
    return deps


def _task_time(task: Task, cells: list[CellCosts], phases: set[str]) -> Number:
    time = cells[task.cell].time
    cost = time.get(task.phase, 0)
    if task.phase == BACKWARD and RECOMPUTE not in phases:
        cost = cost + time.get(RECOMPUTE, 0)  # the executor recomputes inside the backward
    return cost


def _share(parallelism: Optional[Number], running: int) -> Number:
    """The speed of each of `running` tasks under processor sharing (1: full speed)."""
    if parallelism is None or parallelism >= running:
        return 1
    if isinstance(parallelism, int):
        return Fraction(parallelism, running)  # exact for the textbook tests
    return parallelism / running


def simulate(sched: Schedule, cells: list[CellCosts],
             device: DeviceModel = DeviceModel()) -> Result:
    """Plays `sched` with `cells[k]`'s costs on one device per cell.

    Each device runs its tasks in schedule order; a task starts when its device
    is free and its inputs have arrived (previous cell's forward, next cell's
    backward, plus link time). With `device.parallelism` set, running tasks
    share that much compute (processor sharing); exact with Fraction costs.
    """
    num_cells = len(cells)
    orders = [schedule_lib.cell_order(sched, k) for k in range(num_cells)]
    phases = {task.phase for order in orders for task in order}
    speed = 1 if device.speed == 1 else device.speed  # keeps Fraction costs exact
    work = {task: _task_time(task, cells, phases) / speed
            for order in orders for task in order}
    cursor = [0] * num_cells
    start: dict[Task, Number] = {}
    end: dict[Task, Number] = {}
    remaining: dict[Task, Number] = {}
    busy = [0] * num_cells
    now: Number = 0
    stash = [0.0] * num_cells
    peak = [c.static_bytes for c in cells]
    total = sum(len(o) for o in orders)

    def ready_time(task: Task) -> Optional[Number]:
        times = [now]
        for dep in _dependencies(task, num_cells):
            if dep not in end:
                return None
            link = 0
            if dep.cell != task.cell and device.bandwidth:
                link = cells[min(dep.cell, task.cell)].output_bytes / device.bandwidth
            times.append(end[dep] + link)
        return max(times)

    while len(end) < total:
        # Start every device's next task whose inputs are there by `now`.
        waiting = []
        for k in range(num_cells):
            if cursor[k] >= len(orders[k]) or orders[k][cursor[k]] in remaining:
                continue
            task = orders[k][cursor[k]]
            at = ready_time(task)
            if at is None:
                continue
            if at > now:
                waiting.append(at)
                continue
            start[task] = now
            remaining[task] = work[task]
            peak[k] = max(peak[k], cells[k].static_bytes + stash[k] + cells[k].working_bytes)
        if not remaining:
            if not waiting:
                raise RuntimeError('the schedule deadlocks: a device waits for a task that '
                                   'another device runs later; check it with schedule.validate')
            now = min(waiting)
            continue
        rate = _share(device.parallelism, len(remaining))
        step = min([min(remaining.values()) / rate] + [w - now for w in waiting])
        now = now + step
        for task in list(remaining):
            remaining[task] -= step * rate
            busy[task.cell] += step
            if remaining[task] <= 1e-12:
                del remaining[task]
                end[task] = now
                cursor[task.cell] += 1
                k = task.cell
                if task.phase == FORWARD:
                    stash[k] += cells[k].stash_bytes
                elif task.phase == BACKWARD:
                    stash[k] -= cells[k].stash_bytes
                peak[k] = max(peak[k], cells[k].static_bytes + stash[k])
    return Result(step_time=now, busy=busy, peak_bytes=peak, start=start, end=end)


def unit_costs(num_cells: int, forward: Number = Fraction(1),
               backward: Number = Fraction(1)) -> list[CellCosts]:
    """Every cell costs `forward` and `backward` per micro-batch: the textbook pipeline."""
    return [CellCosts(time={FORWARD: forward, BACKWARD: backward}) for _ in range(num_cells)]


def costs_from_measurements(measured: Mapping[tuple[int, str], Number],
                            num_cells: int) -> list[CellCosts]:
    """Per-(cell, phase) durations (e.g. means over a traced step's micro-batches) as costs."""
    cells = [CellCosts(time={}) for _ in range(num_cells)]
    for (k, phase), value in measured.items():
        cells[k].time[phase] = value
    return cells
