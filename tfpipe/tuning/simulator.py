"""Plays a pipeline schedule with per-(cell, phase) costs: step time, bubble, peak memory.

The executor runs each device's tasks in the order `schedule.cell_order` gives,
and a task starts once the tasks it depends on are done. The simulator does
exactly that with numbers instead of ops, so a prediction uses the same
schedule data as the executor and any schedule (fill-drain, 1F1B, virtual
stages with several cells per device, split input/weight backward phases of
zero-bubble schedules, a custom one) can be evaluated without building a graph.

Costs are per (cell, phase) and per micro-batch: profiled by the planner, or
measured from a traced step (a phase the schedule does not run as its own task,
such as 'recompute', is charged to the backward task that runs it). A device
model says how fast devices are and whether they really run in parallel:
logical CPUs of one host share its cores, which `parallelism` captures as
processor sharing (at most that many tasks progress at full speed at once), and
a result crossing devices arrives `latency` seconds after its task ends.

`measured_work` and `measured_gaps` run that model backwards on a measured
timeline: how much work each task did once the sharing of cores is taken out,
and how long devices waited between tasks. The planner fits its costs to them.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, Mapping, Optional, Sequence, Union

from tfpipe.pipeline import schedule as schedule_lib
from tfpipe.pipeline.schedule import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                                      RECOMPUTE, Schedule, Task)

Number = Union[float, Fraction]


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

    Tensor parallelism: the cell spans `devices` (T) devices, memory is that of
    its home device (the fullest), and each forward and each backward task runs
    `collectives` all-reduces of `collective_bytes` bytes in all among the T
    (`collective_time`). Under shared cores a running task of the cell counts
    as `width` tasks: the cores it keeps busy on average (T while it computes a
    split layer, 1 while it computes one that is not split).

    Expert parallelism: the cell is one of `members` (P) that hold its MoE layers'
    experts together, and each forward and each backward task runs `exchanges`
    all-to-alls of `exchange_bytes` bytes in all with the other members
    (`exchange_time`).
    """

    time: dict[str, Number]
    static_bytes: float = 0.0
    stash_bytes: float = 0.0
    working_bytes: float = 0.0
    output_bytes: float = 0.0
    devices: int = 1
    collectives: int = 0
    collective_bytes: float = 0.0
    width: float = 1.0
    members: int = 1
    exchanges: int = 0
    exchange_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """How the simulated devices behave.

    speed: relative compute speed (costs are divided by it); parallelism: how
    many tasks progress at full speed at the same time (None: every device is
    independent, as with GPUs/TPUs; logical CPUs of one host share its cores);
    bandwidth: bytes/s between neighbouring devices (None: free transfers);
    latency: seconds from the end of a task to its result being usable on
    another device (a copy's fixed cost and the runtime's hand-over).
    """

    speed: float = 1.0
    parallelism: Optional[float] = None
    bandwidth: Optional[float] = None
    latency: float = 0.0


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


def collective_time(cell: CellCosts, device: DeviceModel) -> float:
    """Seconds of one task's all-reduces among the cell's T devices: each pays the hand-over
    `latency`, and a ring all-reduce sends and receives 2 (T-1)/T of the bytes on every
    device's link (`bandwidth`; None: free)."""
    if cell.devices == 1 or not cell.collectives:
        return 0.0
    seconds = cell.collectives * device.latency
    if device.bandwidth:
        seconds += 2 * (cell.devices - 1) / cell.devices * cell.collective_bytes / device.bandwidth
    return seconds


def exchange_time(cell: CellCosts, device: DeviceModel) -> float:
    """Seconds of one task's all-to-alls among the cell's P members: each pays the hand-over
    `latency`, and an all-to-all sends and receives the (P-1)/P of its buffer that other
    members' experts take on every device's link (`bandwidth`; None: free)."""
    if cell.members == 1 or not cell.exchanges:
        return 0.0
    seconds = cell.exchanges * device.latency
    if device.bandwidth:
        seconds += (cell.members - 1) / cell.members * cell.exchange_bytes / device.bandwidth
    return seconds


def _collective_calls(task: Task, cell: CellCosts, phases: set[str]) -> int:
    """How many times a task runs its cell's forward (or backward) all-reduces and
    all-to-alls: a recompute runs the forward's again, inside the backward unless it is
    its own task; the weight half of a split backward runs none."""
    if (cell.devices == 1 and cell.members == 1) or task.phase == BACKWARD_WEIGHT:
        return 0
    inside = (task.phase in (BACKWARD, BACKWARD_INPUT) and RECOMPUTE not in phases
              and RECOMPUTE in cell.time)
    return 2 if inside else 1


def _task_time(task: Task, cells: list[CellCosts], phases: set[str]) -> Number:
    """A task's cost; a recompute the schedule does not run as its own task is charged
    to the backward that runs it, and a split backward without its own costs gets half
    of the fused backward for each part."""
    time = cells[task.cell].time
    if task.phase in (BACKWARD_INPUT, BACKWARD_WEIGHT) and task.phase not in time:
        cost = time.get(BACKWARD, 0) / 2
    else:
        cost = time.get(task.phase, 0)
    if task.phase in (BACKWARD, BACKWARD_INPUT) and RECOMPUTE not in phases:
        cost = cost + time.get(RECOMPUTE, 0)  # the executor recomputes inside the backward
    return cost


def _share(parallelism: Optional[Number], running: Number) -> Number:
    """The speed of each of `running` tasks (counted by the cores each keeps busy) under
    processor sharing (1: full speed)."""
    if parallelism is None or parallelism >= running:
        return 1
    if isinstance(parallelism, int):
        return Fraction(parallelism, running)  # exact for the textbook tests
    return parallelism / running


def simulate(sched: Schedule, cells: list[CellCosts], device: DeviceModel = DeviceModel(),
             num_devices: Optional[int] = None) -> Result:
    """Plays `sched` with `cells[k]`'s costs; cell k runs on device k mod `num_devices`.

    `num_devices` defaults to one device per cell (with virtual stages there are
    more cells than devices). Each device runs its tasks in schedule order; a
    task starts when its device is free and its inputs have arrived (previous
    cell's forward, next cell's backward, plus link time). With
    `device.parallelism` set, running tasks share that much compute (processor
    sharing). Exact with Fraction costs. Busy time and peak memory are per device.
    """
    num_cells = len(cells)
    num_devices = num_devices or num_cells
    orders = [[task for tick in sched for task in tick if task.cell % num_devices == d]
              for d in range(num_devices)]
    phases = {task.phase for order in orders for task in order}
    last_backward = BACKWARD_WEIGHT if BACKWARD_WEIGHT in phases else BACKWARD
    speed = 1 if device.speed == 1 else device.speed  # keeps Fraction costs exact
    work = {}
    for order in orders:
        for task in order:
            work[task] = _task_time(task, cells, phases) / speed
            calls = _collective_calls(task, cells[task.cell], phases)
            if calls:  # (only then: 0.0 would turn exact Fraction costs into floats)
                work[task] += calls * (collective_time(cells[task.cell], device)
                                       + exchange_time(cells[task.cell], device))
    cursor = [0] * num_devices
    start: dict[Task, Number] = {}
    end: dict[Task, Number] = {}
    remaining: dict[Task, Number] = {}
    busy = [0] * num_devices
    now: Number = 0
    static = [sum(c.static_bytes for j, c in enumerate(cells) if j % num_devices == d)
              for d in range(num_devices)]
    stash = [0.0] * num_devices
    peak = list(static)
    total = sum(len(o) for o in orders)

    def ready_time(task: Task) -> Optional[Number]:
        times = [now]
        for dep in schedule_lib.dependencies(task, num_cells):
            if dep not in end:
                return None
            link = 0
            if dep.cell % num_devices != task.cell % num_devices:
                link = device.latency or 0
                if device.bandwidth:
                    link = link + cells[min(dep.cell, task.cell)].output_bytes / device.bandwidth
            times.append(end[dep] + link)
        return max(times)

    while len(end) < total:
        # Start every device's next task whose inputs are there by `now`.
        waiting = []
        for d in range(num_devices):
            if cursor[d] >= len(orders[d]) or orders[d][cursor[d]] in remaining:
                continue
            task = orders[d][cursor[d]]
            at = ready_time(task)
            if at is None:
                continue
            if at > now:
                waiting.append(at)
                continue
            start[task] = now
            remaining[task] = work[task]
            peak[d] = max(peak[d], static[d] + stash[d] + cells[task.cell].working_bytes)
        if not remaining:
            if not waiting:
                raise RuntimeError('the schedule deadlocks: a device waits for a task that '
                                   'another device runs later; check it with schedule.validate')
            now = min(waiting)
            continue
        running = sum(cells[t.cell].width for t in remaining)
        # (a whole number as an int: keeps Fraction costs exact)
        rate = _share(device.parallelism, int(running) if running == int(running) else running)
        step = min([min(remaining.values()) / rate] + [w - now for w in waiting])
        now = now + step
        for task in list(remaining):
            d = task.cell % num_devices
            remaining[task] -= step * rate
            busy[d] += step
            if remaining[task] <= 1e-12:
                del remaining[task]
                end[task] = now
                cursor[d] += 1
                if task.phase == FORWARD:
                    stash[d] += cells[task.cell].stash_bytes
                elif task.phase == last_backward:
                    stash[d] -= cells[task.cell].stash_bytes
                peak[d] = max(peak[d], static[d] + stash[d])
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


def measured_work(events: Sequence[Any], parallelism: Optional[float]) -> list[float]:
    """The work (seconds at full speed) of each measured event under processor sharing.

    `events` have `.start` and `.end` (a `timeline.Timeline`'s events). While n
    events run at once on a host with `parallelism` P < n, each progresses at
    P / n of full speed, as `simulate` assumes; this integrates that rate over
    each event, so work measured under contention can be played again under
    another contention.
    """
    bounds = sorted({t for e in events for t in (e.start, e.end)})
    work = [0.0] * len(events)
    for lo, hi in zip(bounds, bounds[1:]):
        running = [i for i, e in enumerate(events) if e.start <= lo and e.end >= hi]
        rate = float(_share(parallelism, len(running)))
        for i in running:
            work[i] += (hi - lo) * rate
    return work


def measured_gaps(events: Sequence[Any]) -> tuple[list[float], list[float]]:
    """Idle seconds before each measured task: (after the device's previous task,
    after an input from another device).

    `events` carry `.label` (device, cell, micro_batch, phase), `.start`, `.end`.
    A 'recompute' event and the 'backward' that follows it at the same stamp are
    one task. A gap counts as local when the device's previous task ended after
    the task's inputs arrived (the device itself was the wait: per-task dispatch
    cost), else as remote (a hand-over between devices).
    """
    tasks = [e for e in events if e.label.phase != BACKWARD or not any(
        r.label.phase == RECOMPUTE and r.label.cell == e.label.cell
        and r.label.micro_batch == e.label.micro_batch for r in events)]
    end: dict[tuple[int, int, str], float] = {}
    for e in events:
        phase = BACKWARD if e.label.phase == RECOMPUTE else e.label.phase
        key = (e.label.cell, e.label.micro_batch, phase)
        end[key] = max(end.get(key, e.end), e.end)
    num_cells = 1 + max(e.label.cell for e in events)
    device_of = {e.label.cell: e.label.device for e in events}
    local, remote = [], []
    previous: dict[str, float] = {}
    for e in sorted(tasks, key=lambda e: e.start):
        label = e.label
        phase = BACKWARD if label.phase == RECOMPUTE else label.phase
        deps = schedule_lib.dependencies(Task(label.cell, label.micro_batch, phase), num_cells)
        arrivals = [end[(d.cell, d.micro_batch, d.phase)] for d in deps
                    if device_of[d.cell] != label.device
                    and (d.cell, d.micro_batch, d.phase) in end]
        own = previous.get(label.device)
        if arrivals and (own is None or max(arrivals) > own):
            remote.append(e.start - max(arrivals))
        elif own is not None:
            local.append(e.start - own)
        previous[label.device] = max(previous.get(label.device, e.end), end[
            (label.cell, label.micro_batch, phase)])
    return local, remote
