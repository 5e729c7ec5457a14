"""A configuration's costs: layer profiles turned into per-cell costs, calibrated on measured steps.

`cell_costs` turns per-layer profiles (`profile.py`) into what each cell of one
configuration (balance, M, recompute) costs per micro-batch, and `simulate`
plays that configuration's schedule with them. Profiles alone mispredict small
CPU steps: a layer timed alone pays overheads the pipeline does not, timings
move with the machine's load, logical CPUs share cores, and a step has costs no
layer has (dispatching each task, handing results between devices, the loss,
gradient norm and optimizer update). `calibrate` measures them on the timelines
of a few real steps, and `Calibration` carries them into every prediction.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from tfpipe.pipeline import partition, schedule
from tfpipe.tuning import expert_parallel_memory, simulator
from tfpipe.pipeline.cell import recompute_flags
from tfpipe.tuning.profile import LayerProfile
from tfpipe.pipeline.schedule import BACKWARD, FORWARD

SCHEDULES = {'fill_drain': schedule.fill_drain, '1f1b': schedule.one_f_one_b}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What measured steps add to the profiles; the defaults leave them as profiled.

    forward_scale / backward_scale: measured over profiled compute of the
    forward and of the backward (its recompute included) tasks;
    forward_fixed_scale / backward_fixed_scale: a further factor on the
    per-call part of that compute (`profile.Affine.fixed`). A layer timed alone
    pays a fixed cost per call that a task of several layers pays otherwise, and
    that cost is what makes small micro-batches dear, so it has its own factor,
    which two measured micro-batch sizes tell apart from the per-example part;
    keep_scale: a further factor on the forward and backward of a cell that
    keeps its activations instead of recomputing (its forward records a tape
    and its backward reads what it kept, neither of which the profile times),
    told apart by one configuration measured under both policies;
    task_overhead: seconds a device spends between two of its tasks (dispatch,
    the timeline's own stamps); latency: seconds from a task's end to its result
    being usable on another device; step_overhead: seconds of the step outside
    the pipeline (input split, loss, gradient norm, optimizer update, the call
    itself); parallelism: how many tasks of this host's logical CPUs progress at
    full speed at once, as measured (None: the device model's). `source` says
    where the figures come from, for the report.
    """

    forward_scale: float = 1.0
    backward_scale: float = 1.0
    forward_fixed_scale: float = 1.0
    backward_fixed_scale: float = 1.0
    keep_scale: float = 1.0
    task_overhead: float = 0.0
    latency: float = 0.0
    step_overhead: float = 0.0
    parallelism: Optional[float] = None
    source: str = 'profiled only'

    def describe(self) -> str:
        """Which costs are measured and which profiled, in one line."""
        if self.source == 'profiled only':
            return ('costs: per-layer compute profiled; no per-task, hand-over or per-step '
                    f'costs measured (step overhead {1e3 * self.step_overhead:.2f} ms)')
        return (f'costs: measured on {self.source}: compute x{self.forward_scale:.2f} forward, '
                f'x{self.backward_scale:.2f} backward of the profile, their per-call parts '
                f'x{self.forward_fixed_scale:.2f} / x{self.backward_fixed_scale:.2f} more, '
                f'x{self.keep_scale:.2f} for a cell that keeps its activations, '
                f'per-task overhead '
                f'{1e3 * self.task_overhead:.3f} ms, hand-over latency '
                f'{1e3 * self.latency:.3f} ms, step overhead {1e3 * self.step_overhead:.2f} ms '
                '(input split, loss, norm, update)'
                + ('' if self.parallelism is None else
                   f', {self.parallelism:.2f} tasks at full speed at once')
                + '; per-layer shares of a cell: profiled')

    def forward_time(self, per_example: float, fixed: float) -> float:
        """Seconds of a forward whose profile gives these per-example and per-call parts."""
        return self.forward_scale * (per_example + self.forward_fixed_scale * fixed)

    def backward_time(self, per_example: float, fixed: float) -> float:
        """Seconds of a backward (or of the recompute inside it), likewise."""
        return self.backward_scale * (per_example + self.backward_fixed_scale * fixed)

    def device(self, model: simulator.DeviceModel) -> simulator.DeviceModel:
        """`model` with the measured hand-over latency added to its own and the measured
        parallelism, if any, instead of its own."""
        parallelism = model.parallelism if self.parallelism is None else self.parallelism
        return dataclasses.replace(model, latency=model.latency + self.latency,
                                   parallelism=parallelism)


@dataclasses.dataclass
class MeasuredRun:
    """Measured steps of one configuration: `timeline.Timeline`s of recorded steps and
    wall seconds of as many unrecorded ones (the whole training step)."""

    balance: list[int]
    num_micro_batches: int
    timelines: Sequence[Any]
    step_seconds: Sequence[float]
    schedule: str = 'fill_drain'
    recompute: str = 'always'


def cell_costs(profiles: Sequence[LayerProfile], balance: Sequence[int],
               num_micro_batches: int, batch_size: int, recompute: str,
               calibration: Calibration = Calibration(),
               tensor_parallel: int = 1, expert_parallel: int = 1,
               buffers: Optional[Sequence[float]] = None) -> list[simulator.CellCosts]:
    """Per-micro-batch costs of each cell of one configuration.

    Memory (bytes, an estimate from the layer profiles): static = weights,
    optimizer slots and the gradient sums; stash = the cell input when
    recomputing, else what its layers' forwards keep for the backward
    (`LayerProfile.kept_per_example`); working = that of one forward (recompute)
    plus one set of weight gradients.

    With `tensor_parallel` T, the split share of each layer's per-example
    compute, weights and slots is divided by T (`LayerProfile.per_device`: the
    cell's home device, which also keeps every layer that is not split and the
    activations between layers), and every forward and backward runs the split
    units' all-reduces of their outputs among the T devices.

    With `expert_parallel` P > 1 (`profiles` already cut to a member's experts:
    `expert_parallel_memory.cut`), every MoE layer runs two all-to-alls (dispatch and
    combine) of its buffer (`buffers`, per layer at this micro-batch) per forward and as
    many per backward, and a cell's working set holds its layers' exchange buffers
    (`expert_parallel_memory.exchange_working_bytes`). Compute is P=1's: a member's E/P
    experts take P members' tokens, [E/P, P x C] slots, as many as [E, C].
    """
    b = batch_size / num_micro_batches
    t = tensor_parallel
    flags = recompute_flags(recompute, len(balance))
    exchanged = [0.0] * len(profiles) if expert_parallel == 1 or buffers is None else buffers
    exchange = expert_parallel_memory.exchange_working_bytes(exchanged, balance)
    cells = []
    for (start, stop), recomputes, held in zip(partition.cell_ranges(balance), flags, exchange):
        layers = profiles[start:stop]
        forward = sum(p.forward.per_example * b * p.per_device(t) for p in layers)
        forward_fixed = sum(p.forward.fixed for p in layers)
        backward = sum(p.backward.per_example * b * p.per_device(t) for p in layers)
        backward_fixed = sum(p.backward.fixed for p in layers)
        params = sum(p.param_bytes * p.per_device(t) for p in layers)
        # What the backward needs of one micro-batch's forward: held from forward to
        # backward without recompute, rebuilt inside the backward task with it.
        kept = b * sum(p.kept_per_example() for p in layers)
        cell_input = b * layers[0].input_bytes_per_example
        overhead = calibration.task_overhead
        keep = 1.0 if recomputes else calibration.keep_scale
        time = {FORWARD: keep * calibration.forward_time(forward, forward_fixed) + overhead,
                BACKWARD: keep * calibration.backward_time(backward, backward_fixed) + overhead}
        if recomputes:  # runs inside the backward task, calibrated with it
            time[schedule.RECOMPUTE] = calibration.backward_time(forward, forward_fixed)
        cells.append(simulator.CellCosts(
            time=time,
            static_bytes=2 * params + sum(p.slot_bytes * p.per_device(t) for p in layers),
            stash_bytes=cell_input if recomputes else kept,
            working_bytes=(kept if recomputes else 0.0) + params + held,
            output_bytes=b * layers[-1].output_bytes_per_example, devices=t,
            width=_width(layers, t),
            collectives=sum(p.all_reduces for p in layers),
            collective_bytes=b * sum(p.all_reduces * p.output_bytes_per_example
                                     for p in layers),
            members=expert_parallel,
            exchanges=2 * sum(1 for x in exchanged[start:stop] if x > 0),
            exchange_bytes=2 * sum(exchanged[start:stop])))
    return cells


def _width(layers: Sequence[LayerProfile], tensor_parallel: int) -> float:
    """The cores a cell of T devices keeps busy on average: its compute on all T devices
    over its compute on the home device (T for split layers alone, 1 for none)."""
    whole = sum(p.forward.per_example + p.backward.per_example for p in layers)
    home = sum((p.forward.per_example + p.backward.per_example) * p.per_device(tensor_parallel)
               for p in layers)
    return whole / home if home > 0 else 1.0


def balance_for(profiles: Sequence[LayerProfile], num_cells: int, micro: float,
                calibration: Calibration = Calibration(), tensor_parallel: int = 1
                ) -> list[int]:
    """The balance the planner uses: solve_balance on calibrated time at micro-batch `micro`
    (at T, split compute divided by T)."""
    t = tensor_parallel
    costs = [calibration.forward_time(p.forward.per_example * micro * p.per_device(t),
                                      p.forward.fixed)
             + calibration.backward_time(p.backward.per_example * micro * p.per_device(t),
                                         p.backward.fixed)
             for p in profiles]
    return partition.solve_balance(costs, num_cells)


def _undisturbed(values: Sequence[float]) -> float:
    """The lower quartile: a task other processes did not delay. Load only adds time, so
    the median of a loaded machine is too high; the lower quartile of many tasks still
    ignores the odd fast outlier."""
    ordered = sorted(values)
    return ordered[len(ordered) // 4]


def _parts(profiles: Sequence[LayerProfile], run: MeasuredRun,
           batch_size: int) -> dict[str, np.ndarray]:
    """Per phase, the profile's [per-example, per-call] seconds of the run's tasks summed
    over cells (per micro-batch); the backward includes the recompute it runs."""
    b = batch_size / run.num_micro_batches
    flags = recompute_flags(run.recompute, len(run.balance))
    parts = {FORWARD: np.zeros(2), BACKWARD: np.zeros(2)}
    for (start, stop), recomputes in zip(partition.cell_ranges(run.balance), flags):
        for p in profiles[start:stop]:
            parts[FORWARD] += (p.forward.per_example * b, p.forward.fixed)
            parts[BACKWARD] += (p.backward.per_example * b, p.backward.fixed)
            if recomputes:
                parts[BACKWARD] += (p.forward.per_example * b, p.forward.fixed)
    return parts


def _scales(parts: list[np.ndarray], measured: list[float]) -> tuple[float, float]:
    """(scale, per-call factor) with measured = scale * (per_example + factor * fixed).

    One run fixes the scale alone (factor 1); two micro-batch sizes solve for
    both. A negative part (noise) falls back to the single scale."""
    a = np.array(parts)
    y = np.array(measured)
    total = float(a.sum(axis=1) @ y / max(float(a.sum(axis=1) @ a.sum(axis=1)), 1e-300))
    if len(parts) > 1 and np.linalg.matrix_rank(a) == 2:
        per_example, fixed = np.linalg.lstsq(a, y, rcond=None)[0]
        if per_example > 0 and fixed >= 0:
            return float(per_example), float(fixed / per_example)
    return (total, 1.0) if total > 0 else (1.0, 1.0)


def _task_fit(profiles: Sequence[LayerProfile], runs: Sequence[MeasuredRun], batch_size: int,
              parallelism: Optional[float]) -> Calibration:
    """Compute scales, per-task overhead and latency read off the runs' tasks.

    Per phase, the undisturbed forward and backward tasks (recompute included)
    of every cell, as work with the contention between the pipeline's own
    tasks taken out (`parallelism`, as the simulator puts it back), against the
    profile's per-example and per-call parts give the scales (`_scales`); the
    per-task overhead is a device's wait between its own tasks and the latency
    the extra wait for an input from another device (both from the first run).
    Only runs under the first run's recompute policy count: the others' cells
    that keep their activations are what the spans fit `keep_scale` on.
    """
    parts: dict[str, list[np.ndarray]] = {FORWARD: [], BACKWARD: []}
    measured: dict[str, list[float]] = {FORWARD: [], BACKWARD: []}
    local, remote = [], []
    for index, run in enumerate(r for r in runs if r.recompute == runs[0].recompute):
        tasks: dict[tuple[int, str], dict[tuple[int, int], float]] = {}  # (cell, F|B) -> work
        for step, line in enumerate(run.timelines):
            for event, seconds in zip(line.events,
                                      simulator.measured_work(line.events, parallelism)):
                phase = FORWARD if event.label.phase == FORWARD else BACKWARD  # recompute: in B
                per_task = tasks.setdefault((event.label.cell, phase), {})
                key = (step, event.label.micro_batch)
                per_task[key] = per_task.get(key, 0.0) + seconds
            if index == 0:
                gaps = simulator.measured_gaps(line.events)
                local += gaps[0]
                remote += gaps[1]
        profiled = _parts(profiles, run, batch_size)
        for phase in (FORWARD, BACKWARD):
            parts[phase].append(profiled[phase])
            measured[phase].append(sum(_undisturbed(list(work.values()))
                                       for (_, p), work in tasks.items() if p == phase))
    forward = _scales(parts[FORWARD], measured[FORWARD])
    backward = _scales(parts[BACKWARD], measured[BACKWARD])
    task_overhead = max(_undisturbed(local), 0.0) if local else 0.0
    latency = max(_undisturbed(remote) - task_overhead, 0.0) if remote else 0.0
    return Calibration(forward_scale=forward[0], forward_fixed_scale=forward[1],
                       backward_scale=backward[0], backward_fixed_scale=backward[1],
                       task_overhead=task_overhead, latency=latency)


def _simulated_spans(profiles: Sequence[LayerProfile], runs: Sequence[MeasuredRun],
                     batch_size: int, device: simulator.DeviceModel,
                     calibration: Calibration) -> np.ndarray:
    return np.array([float(simulate(profiles, run.balance, run.num_micro_batches, batch_size,
                                    run.recompute, run.schedule, device,
                                    calibration).step_time)
                     for run in runs])


def _fit_spans(profiles: Sequence[LayerProfile], runs: Sequence[MeasuredRun], batch_size: int,
               device: simulator.DeviceModel, start: Calibration,
               targets: np.ndarray) -> Calibration:
    """Fits the simulated pipelines' spans to the measured ones: a factor on the compute
    (both phases alike), with two micro-batch sizes a factor on its per-call part, and with
    a one-device run beside a pipelined one the parallelism of logical CPUs, and with
    cells that keep their activations beside recomputing ones the keep factor.

    The tasks' undisturbed times leave out what a real step also pays: stalls
    when the devices' threads compete for the cores, caches refilled between
    tasks. Those grow with the compute, so scaling it to the measured span keeps
    the configuration measured right and carries the proportion to the others.
    A task alone can spread its independent ops over both cores, which tasks of
    several devices at once cannot: that is the parallelism (at most the device
    model's, at least 1), visible only against a run with one device. Newton
    steps on the (almost linear) simulated spans; a direction the runs cannot
    tell apart stays as it is.
    """
    upper = device.parallelism
    # per-example factor, per-call factor, parallelism, keep factor
    x = np.array([1.0, 1.0, start.parallelism or upper or 1.0, start.keep_scale])
    low = np.array([0.02, 0.02, 1.0, 0.1])
    high = np.array([50.0, 50.0, upper or 1.0, 10.0])

    def fitted(x: np.ndarray) -> Calibration:
        relative = x[1] / x[0]
        return dataclasses.replace(
            start, forward_scale=start.forward_scale * x[0],
            backward_scale=start.backward_scale * x[0],
            forward_fixed_scale=start.forward_fixed_scale * relative,
            backward_fixed_scale=start.backward_fixed_scale * relative,
            parallelism=float(x[2]) if upper else None, keep_scale=float(x[3]))

    def spans(x: np.ndarray) -> np.ndarray:
        return _simulated_spans(profiles, runs, batch_size, device, fitted(x))

    cells = {len(run.balance) for run in runs}
    flags = {flag for run in runs for flag in recompute_flags(run.recompute, len(run.balance))}
    free = [0] + ([1] if len({run.num_micro_batches for run in runs}) > 1 else []) + (
        [2] if upper and upper > 1 and 1 in cells and len(cells) > 1 else []) + (
        [3] if len(flags) > 1 else [])
    for _ in range(8):
        now = spans(x)
        residual = now - targets
        if np.all(np.abs(residual) <= 1e-9 + 1e-6 * targets):
            break
        jacobian = np.zeros((len(runs), len(free)))
        for j, index in enumerate(free):
            probe = x.copy()
            step = 0.01 * x[index] * (1 if x[index] * 1.01 <= high[index] else -1)
            probe[index] += step
            jacobian[:, j] = (spans(probe) - now) / step
        delta = np.linalg.lstsq(jacobian, -residual, rcond=None)[0]
        for j, index in enumerate(free):
            x[index] = float(np.clip(x[index] + delta[j], low[index], high[index]))
    return fitted(x)


def calibrate(profiles: Sequence[LayerProfile], runs: Sequence[MeasuredRun], batch_size: int,
              parallelism: Optional[float], source: str) -> Calibration:
    """Fits a Calibration to measured steps of one or more configurations.

    The first run is the model's configured pipeline; one with another number
    of micro-batches separates the per-call part of the compute from the
    per-example part, and one on a single device (with `parallelism`, the most
    tasks the host can run at full speed) measures how many really do; one under
    the other recompute policy measures what keeping activations costs. On a
    shared machine other processes' load only ever slows a step down, often by
    descheduling one task for a whole time slice, so the fit reads undisturbed
    tasks (`_undisturbed`) and the fastest step of each run: the tasks give the
    forward/backward split and the per-call parts, the per-task overhead and the
    hand-over latency (`_task_fit`); the spans of the fastest steps scale the
    compute and fit the parallelism and the keep factor (`_fit_spans`); the
    step overhead is the median over runs of the fastest wall time beyond the
    shortest span.
    """
    fitted = Calibration(parallelism=parallelism)
    for _ in range(3):  # the tasks' work depends on the parallelism the spans fit
        tasks_only = dataclasses.replace(
            _task_fit(profiles, runs, batch_size, fitted.parallelism),
            parallelism=fitted.parallelism, source=source)
        # The simulated pipeline also counts the first task's overhead, which the span
        # does not.
        spans = np.array([min(line.span for line in run.timelines) + tasks_only.task_overhead
                          for run in runs])
        fitted = _fit_spans(profiles, runs, batch_size,
                            simulator.DeviceModel(parallelism=parallelism), tasks_only, spans)
    overheads = [min(run.step_seconds) - span for run, span in zip(runs, spans)]
    return dataclasses.replace(fitted, step_overhead=max(float(np.median(overheads)), 0.0))


def simulate(profiles: Sequence[LayerProfile], balance: Sequence[int], num_micro_batches: int,
             batch_size: int, recompute: str, schedule_name: str,
             device: simulator.DeviceModel,
             calibration: Calibration = Calibration(),
             tensor_parallel: int = 1, expert_parallel: int = 1,
             buffers: Optional[Sequence[float]] = None) -> simulator.Result:
    """One configuration's pipeline played by the simulator (without the step overhead)."""
    costs = cell_costs(profiles, balance, num_micro_batches, batch_size, recompute, calibration,
                       tensor_parallel, expert_parallel, buffers)
    return simulator.simulate(SCHEDULES[schedule_name](len(balance), num_micro_batches), costs,
                              calibration.device(device))
