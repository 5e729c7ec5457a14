"""Recommends K, balance, M, recompute and schedule from measured per-layer costs.

Every candidate configuration is turned into per-(cell, phase) costs from the
layer profiles (`profile.py`) and played by the simulator on the schedule the
executor would run, so the prediction includes the bubble, imbalance between
cells, the per-micro-batch overhead of small micro-batches and, for logical
CPUs, the cores the devices share. Configurations whose predicted peak memory
on some device exceeds the budget are kept in the report but marked.

Profiles alone mispredict small CPU steps: a layer timed alone pays overheads
the pipeline does not, timings move with the machine's load, and a step has
costs no layer has (dispatching each task, handing results between devices,
the loss, gradient norm and optimizer update). `calibrate` measures them on
the timelines of a few real steps: `Calibration` scales the profiled compute to what the
tasks really took and adds the per-task, per-hand-over and per-step costs.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional, Sequence

from tfpipe.pipeline import partition, schedule, simulator
from tfpipe.pipeline.cell import RECOMPUTE_POLICIES, recompute_flags
from tfpipe.pipeline.profile import LayerProfile
from tfpipe.pipeline.schedule import BACKWARD, FORWARD

SCHEDULES = {'fill_drain': schedule.fill_drain, '1f1b': schedule.one_f_one_b}
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
_UNITS = {'': 1, 'b': 1, 'k': 1e3, 'kb': 1e3, 'kib': 2**10, 'm': 1e6, 'mb': 1e6, 'mib': 2**20,
          'g': 1e9, 'gb': 1e9, 'gib': 2**30, 't': 1e12, 'tb': 1e12, 'tib': 2**40}


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """The devices planned for: `model` for the simulator plus a memory budget in bytes."""

    model: simulator.DeviceModel
    memory: Optional[float] = None


@dataclasses.dataclass
class Config:
    """One candidate and its prediction."""

    num_cells: int
    balance: list[int]
    num_micro_batches: int
    recompute: str
    schedule: str
    step_time: float
    bubble: float
    peak_bytes: list[float]
    fits: bool = True

    def params_override(self, prefix: str = 'task.pipeline') -> str:
        """The --params_override text that applies this configuration to a model."""
        return (f'{prefix}.num_cells={self.num_cells},{prefix}.balance={self.balance},'
                f'{prefix}.num_micro_batches={self.num_micro_batches},'
                f"{prefix}.recompute='{self.recompute}',{prefix}.schedule='{self.schedule}'")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def parse_bytes(text: str) -> float:
    """'16GiB', '512MB', '1e9' -> bytes; a clear ValueError otherwise."""
    match = re.fullmatch(r'\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*', str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f'{text!r} is not a size: write bytes as a number with an optional '
                         'unit, e.g. 1e9, 512MiB or 16GiB')
    try:
        return float(match.group(1)) * _UNITS[unit]
    except ValueError:
        raise ValueError(f'{text!r} is not a size: write e.g. 1e9, 512MiB or 16GiB') from None


def parse_device_profile(text: str) -> DeviceProfile:
    """'speed=8,memory=16GiB,bandwidth=10e9[,parallelism=4]' -> DeviceProfile.

    speed: compute relative to the device the layers were profiled on;
    memory: bytes per device; bandwidth: bytes/s between neighbouring devices;
    parallelism: devices that really compute at once (default: all of them).
    """
    fields = {'speed': 1.0, 'memory': None, 'bandwidth': None, 'parallelism': None}
    for item in filter(None, (s.strip() for s in text.split(','))):
        key, sep, value = item.partition('=')
        if not sep or key not in fields:
            raise ValueError(f'--device_profile item {item!r}: use key=value with keys '
                             f'{sorted(fields)}, e.g. speed=8,memory=16GiB,bandwidth=10e9')
        number = parse_bytes(value) if key in ('memory', 'bandwidth') else float(value)
        if number <= 0:
            raise ValueError(f'--device_profile {key}={value} must be > 0')
        fields[key] = number
    return DeviceProfile(simulator.DeviceModel(fields['speed'], fields['parallelism'],
                                               fields['bandwidth']), fields['memory'])


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a measured step adds to the profiles; the defaults leave them as profiled.

    forward_scale / backward_scale: measured over profiled compute of the
    forward and of the backward (its recompute included) tasks; task_overhead:
    seconds a device spends between two of its tasks (dispatch, the timeline's
    own stamps); latency: seconds from a task's end to its result being usable
    on another device; step_overhead: seconds of the step outside the pipeline
    (input split, loss, gradient norm, optimizer update, the call itself).
    `source` says where the figures come from, for the report.
    """

    forward_scale: float = 1.0
    backward_scale: float = 1.0
    task_overhead: float = 0.0
    latency: float = 0.0
    step_overhead: float = 0.0
    source: str = 'profiled only'

    def describe(self) -> str:
        """Which costs are measured and which profiled, in one line."""
        if self.source == 'profiled only':
            return ('costs: per-layer compute profiled; no per-task, hand-over or per-step '
                    f'costs measured (step overhead {1e3 * self.step_overhead:.2f} ms)')
        return (f'costs: measured on {self.source}: compute x{self.forward_scale:.2f} forward, '
                f'x{self.backward_scale:.2f} backward of the profile, per-task overhead '
                f'{1e3 * self.task_overhead:.3f} ms, hand-over latency '
                f'{1e3 * self.latency:.3f} ms, step overhead {1e3 * self.step_overhead:.2f} ms '
                '(input split, loss, norm, update); per-layer shares of a cell and their '
                'change with micro-batch size: profiled')

    def device(self, model: simulator.DeviceModel) -> simulator.DeviceModel:
        """`model` with the measured hand-over latency added to its own."""
        return dataclasses.replace(model, latency=model.latency + self.latency)


def cell_costs(profiles: Sequence[LayerProfile], balance: Sequence[int],
               num_micro_batches: int, batch_size: int, recompute: str,
               calibration: Calibration = Calibration()) -> list[simulator.CellCosts]:
    """Per-micro-batch costs of each cell of one configuration.

    Memory (bytes, an estimate from layer inputs and outputs): static = weights,
    optimizer slots and the gradient sums; stash = the cell input when
    recomputing, else every layer's input and output; working = the
    activations of one forward (recompute) plus one set of weight gradients.
    """
    b = batch_size / num_micro_batches
    flags = recompute_flags(recompute, len(balance))
    cells = []
    for (start, stop), recomputes in zip(partition.cell_ranges(balance), flags):
        layers = profiles[start:stop]
        forward = sum(p.forward(b) for p in layers)
        backward = sum(p.backward(b) for p in layers)
        params = sum(p.param_bytes for p in layers)
        activations = b * sum(p.input_bytes_per_example + p.output_bytes_per_example
                              for p in layers)
        cell_input = b * layers[0].input_bytes_per_example
        overhead = calibration.task_overhead
        time = {FORWARD: calibration.forward_scale * forward + overhead,
                BACKWARD: calibration.backward_scale * backward + overhead}
        if recomputes:  # runs inside the backward task, calibrated with it
            time[simulator.RECOMPUTE] = calibration.backward_scale * forward
        cells.append(simulator.CellCosts(
            time=time, static_bytes=2 * params + sum(p.slot_bytes for p in layers),
            stash_bytes=cell_input if recomputes else activations,
            working_bytes=(activations if recomputes else 0.0) + params,
            output_bytes=b * layers[-1].output_bytes_per_example))
    return cells


def balance_for(profiles: Sequence[LayerProfile], num_cells: int, micro: float,
                calibration: Calibration = Calibration()) -> list[int]:
    """The balance the planner uses: solve_balance on calibrated time at micro-batch `micro`."""
    costs = [calibration.forward_scale * p.forward(micro) +
             calibration.backward_scale * p.backward(micro) for p in profiles]
    return partition.solve_balance(costs, num_cells)


def _undisturbed(values: Sequence[float]) -> float:
    """The lower quartile: a task other processes did not delay. Load only adds time, so
    the median of a loaded machine is too high; the lower quartile of many tasks still
    ignores the odd fast outlier."""
    ordered = sorted(values)
    return ordered[len(ordered) // 4]


def calibrate(profiles: Sequence[LayerProfile], balance: Sequence[int],
              num_micro_batches: int, batch_size: int, recompute: str,
              timelines: Sequence[Any], step_seconds: Sequence[float],
              parallelism: Optional[float], source: str) -> Calibration:
    """Fits a Calibration to measured steps of one configuration.

    `timelines` are `timeline.Timeline`s of recorded steps of that configuration
    and `step_seconds` wall times of the same step unrecorded. On a shared
    machine other processes' load only ever slows a step down, often by
    descheduling one task for a whole time slice, so the fit reads undisturbed
    tasks (`_undisturbed`) and the fastest step: per cell, the forward and the
    backward task (recompute included) over micro-batches and steps, as work
    with the contention between the pipeline's own tasks taken out
    (`parallelism`, as the simulator puts it back), over the profiled work
    gives the compute scales; the per-task overhead is a device's wait between
    its own tasks; the latency the extra wait for an input from another device;
    the step overhead the fastest wall time beyond the shortest span.
    """
    profiled = cell_costs(profiles, balance, num_micro_batches, batch_size, recompute)
    tasks: dict[tuple[int, str], dict[tuple[int, int], float]] = {}  # (cell, F|B) -> work
    local, remote = [], []
    for step, line in enumerate(timelines):
        for event, seconds in zip(line.events, simulator.measured_work(line.events, parallelism)):
            phase = FORWARD if event.label.phase == FORWARD else BACKWARD  # recompute: in B
            per_task = tasks.setdefault((event.label.cell, phase), {})
            key = (step, event.label.micro_batch)
            per_task[key] = per_task.get(key, 0.0) + seconds
        gaps = simulator.measured_gaps(line.events)
        local += gaps[0]
        remote += gaps[1]
    scales = {}
    for phase in (FORWARD, BACKWARD):
        measured = sum(_undisturbed(list(work.values()))
                       for (_, p), work in tasks.items() if p == phase)
        expected = sum(c.time[phase] + (c.time.get(simulator.RECOMPUTE, 0.0)
                                        if phase == BACKWARD else 0.0) for c in profiled)
        scales[phase] = measured / expected if expected > 0 and measured > 0 else 1.0
    task_overhead = max(_undisturbed(local), 0.0) if local else 0.0
    latency = max(_undisturbed(remote) - task_overhead, 0.0) if remote else 0.0
    # The simulated pipeline also counts the first task's overhead, which the span does not.
    pipeline = min(line.span for line in timelines) + task_overhead
    return Calibration(
        forward_scale=scales[FORWARD], backward_scale=scales[BACKWARD],
        task_overhead=task_overhead, latency=latency,
        step_overhead=max(min(step_seconds) - pipeline, 0.0), source=source)


def simulate(profiles: Sequence[LayerProfile], balance: Sequence[int], num_micro_batches: int,
             batch_size: int, recompute: str, schedule_name: str,
             device: simulator.DeviceModel,
             calibration: Calibration = Calibration()) -> simulator.Result:
    """One configuration's pipeline played by the simulator (without the step overhead)."""
    costs = cell_costs(profiles, balance, num_micro_batches, batch_size, recompute, calibration)
    return simulator.simulate(SCHEDULES[schedule_name](len(balance), num_micro_batches), costs,
                              calibration.device(device))


def search(profiles: Sequence[LayerProfile], batch_size: int, num_devices: int,
           device: DeviceProfile, micro_batches: Sequence[int] = MICRO_BATCHES,
           recompute: Sequence[str] = RECOMPUTE_POLICIES,
           schedules: Sequence[str] = tuple(SCHEDULES),
           calibration: Calibration = Calibration(),
           cells: Optional[Sequence[int]] = None) -> list[Config]:
    """Every configuration with K <= num_devices cells, sorted: fitting ones first, then by time.

    Balance comes from partition.solve_balance on the (calibrated) profiled
    time at the micro-batch size, so cells are balanced by what they will
    really cost. A step's time is the simulated pipeline plus the calibration's
    step overhead.
    """
    results = []
    ks = cells or range(1, min(num_devices, len(profiles)) + 1)
    for k in ks:
        for m in sorted({min(m, batch_size) for m in micro_batches}):
            balance = balance_for(profiles, k, batch_size / m, calibration)
            for policy in recompute:
                for name in schedules:
                    r = simulate(profiles, balance, m, batch_size, policy, name, device.model,
                                 calibration)
                    peak = [float(p) for p in r.peak_bytes]
                    fits = device.memory is None or max(peak) <= device.memory
                    results.append(Config(k, balance, m, policy, name,
                                          float(r.step_time) + calibration.step_overhead,
                                          float(r.bubble), peak, fits))
    # Ties (equal to the microsecond) go to fewer devices, fewer micro-batches, less memory.
    results.sort(key=lambda c: (not c.fits, round(c.step_time, 6), c.num_cells,
                                c.num_micro_batches, max(c.peak_bytes)))
    return results


def best_fitting(configs: Sequence[Config], budget: Optional[float]) -> Config:
    """The fastest configuration within the budget; ValueError naming the fix if none fits."""
    for config in configs:
        if config.fits:
            return config
    least = min(configs, key=lambda c: max(c.peak_bytes))
    raise ValueError(
        f'no configuration fits --device_memory={budget:.4g} bytes: the smallest predicted peak '
        f'is {max(least.peak_bytes):.4g} bytes (K={least.num_cells}, '
        f'M={least.num_micro_batches}, recompute={least.recompute}); raise --device_memory, '
        'allow more devices (--num_devices) or shrink the batch')


def format_table(configs: Sequence[Config], limit: int = 8) -> str:
    """The best few configurations as a text table (step time in ms, peak in MiB)."""
    lines = [f'{"K":>2} {"M":>3} {"recompute":<11} {"schedule":<10} {"step ms":>8} '
             f'{"bubble":>6} {"peak MiB/device":<24} fits  balance']
    for c in configs[:limit]:
        peaks = '/'.join(f'{p / 2**20:.0f}' for p in c.peak_bytes)
        lines.append(f'{c.num_cells:>2} {c.num_micro_batches:>3} {c.recompute:<11} '
                     f'{c.schedule:<10} {1e3 * c.step_time:>8.2f} {c.bubble:>6.2f} '
                     f'{peaks:<24} {"yes" if c.fits else "NO":<5} {c.balance}')
    return '\n'.join(lines)


def local_parallelism(intra_op_threads: int) -> float:
    """How many logical-CPU tasks run at full speed at once on this host.

    With `intra_op_threads` = n each op may use n cores, so cores / n tasks fit
    side by side. TensorFlow's default pool (0) is shared by all logical
    devices and the ops of one micro-batch are mostly too small to spread over
    several cores, so tasks of different cells overlap up to the core count;
    benchmarks/planner_benchmark.py checks this against measured steps.
    """
    cores = os.cpu_count() or 1
    threads = intra_op_threads if intra_op_threads > 0 else 1
    return max(1.0, cores / min(threads, cores))


def throughput_table(profiles: Sequence[LayerProfile], batch_size: int,
                     device: DeviceProfile, ks: Sequence[int], ms: Sequence[int],
                     recompute: str = 'always') -> dict[tuple[int, int], float]:
    """Examples/s of each (K, M) under fill-drain, normalised to the first (K, M): Table 2's shape."""
    out = {}
    for k in ks:
        for m in ms:
            balance = balance_for(profiles, k, batch_size / m)
            costs = cell_costs(profiles, balance, m, batch_size, recompute)
            out[(k, m)] = batch_size / float(
                simulator.simulate(schedule.fill_drain(k, m), costs, device.model).step_time)
    base = out[(ks[0], ms[0])]
    return {key: value / base for key, value in out.items()}


