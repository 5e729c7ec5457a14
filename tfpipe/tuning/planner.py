"""Recommends K, balance, M, recompute and schedule from measured per-layer costs.

Every candidate configuration is turned into per-(cell, phase) costs from the
layer profiles (`profile.py`) and played by the simulator on the schedule the
executor would run, so the prediction includes the bubble, imbalance between
cells, the per-micro-batch overhead of small micro-batches and, for logical
CPUs, the cores the devices share. Configurations whose predicted peak memory
on some device exceeds the budget are kept in the report but marked. The
costs come from `calibration.py`, which also fits them to measured steps.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import statistics
from typing import Any, Optional, Sequence

from tfpipe.pipeline import schedule
from tfpipe.pipeline.cell import RECOMPUTE_POLICIES, recompute_flags
from tfpipe.tuning import expert_parallel_memory, sharding_plan, simulator
from tfpipe.tuning.calibration import SCHEDULES, Calibration, balance_for, cell_costs, simulate
from tfpipe.tuning.profile import LayerProfile

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
    """One configuration and its prediction (step_time, bubble, peak_bytes, fits; left at
    their defaults for a configuration that is only to be measured, such as the model's
    own). A balance of None leaves the partition of num_cells to the model."""

    num_cells: int
    balance: list[int]
    num_micro_batches: int
    recompute: str
    schedule: str
    step_time: float = 0.0
    bubble: float = 0.0
    peak_bytes: list[float] = dataclasses.field(default_factory=list)
    fits: bool = True
    tensor_parallel: int = 1
    set_tensor_parallel: bool = False
    expert_parallel: int = 1
    set_expert_parallel: bool = False
    sharding: str = 'none'
    set_sharding: bool = False

    def overrides(self, prefix: str = 'task.pipeline') -> dict[str, Any]:
        """The model params this configuration sets, by path. T when it is not 1 or
        `set_tensor_parallel` (the model has T, and its own may not be 1: a T=1 plan
        that left it out would run K cells of the model's T devices each); otherwise
        not, so a plan without tensor parallelism applies to any model. P likewise
        (`set_expert_parallel`: the model sets its own P). The ZeRO stage,
        task.train.sharding, when stages were searched (`set_sharding`, R > 1)."""
        balance = None if self.balance is None else list(self.balance)
        out = {f'{prefix}.num_cells': self.num_cells, f'{prefix}.balance': balance,
               f'{prefix}.num_micro_batches': self.num_micro_batches,
               f'{prefix}.recompute': self.recompute, f'{prefix}.schedule': self.schedule}
        if self.tensor_parallel != 1 or self.set_tensor_parallel:
            out[f'{prefix}.tensor_parallel'] = self.tensor_parallel
        if self.expert_parallel != 1 or self.set_expert_parallel:
            out[f'{prefix}.expert_parallel'] = self.expert_parallel
        if self.set_sharding:
            out[f'{prefix.rpartition(".")[0]}.train.sharding'] = self.sharding
        return out

    @property
    def devices(self) -> int:
        """Devices one replica of this configuration uses: K cells of T devices each."""
        return self.num_cells * self.tensor_parallel

    def describe(self) -> str:
        """'K=2 M=4 recompute=always schedule=1f1b' (and T, P when they are not 1, the
        stage when stages were searched)."""
        tensor = f' T={self.tensor_parallel}' if self.tensor_parallel != 1 else ''
        tensor += f' P={self.expert_parallel}' if self.expert_parallel != 1 else ''
        return (f'K={self.num_cells}{tensor} M={self.num_micro_batches} '
                f'recompute={self.recompute} schedule={self.schedule}'
                + (f' sharding={self.sharding}' if self.set_sharding else ''))

    def params_override(self, prefix: str = 'task.pipeline') -> str:
        """The --params_override text that applies this configuration to a model: strings
        as bare words and lists without spaces, so it needs no inner quotes."""
        return ','.join(f'{key}={value}' if isinstance(value, str) else
                        f'{key}={value!r}'.replace(' ', '')
                        for key, value in self.overrides(prefix).items())

    def shell_flag(self, prefix: str = 'task.pipeline') -> str:
        """The --params_override flag quoted so it pastes into a POSIX shell unchanged."""
        return shlex.quote(f'--params_override={self.params_override(prefix)}')

    def gin_text(self, prefix: str = 'task.pipeline') -> str:
        """A gin file setting this configuration (`--gin_file`): model.overrides = {...}."""
        return f'model.overrides = {self.overrides(prefix)!r}\n'

    def to_json(self) -> dict:
        """The fields; the stage's only when stages were searched (an R=1 plan's report
        is as before)."""
        out = dataclasses.asdict(self)
        if not self.set_sharding:
            del out['sharding'], out['set_sharding']
        return out


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


def search(profiles: Sequence[LayerProfile], batch_size: int, num_devices: int,
           device: DeviceProfile, micro_batches: Sequence[int] = MICRO_BATCHES,
           recompute: Sequence[str] = RECOMPUTE_POLICIES,
           schedules: Sequence[str] = tuple(SCHEDULES),
           calibration: Calibration = Calibration(),
           cells: Optional[Sequence[int]] = None,
           tensor_parallel: Sequence[int] = (1,),
           set_tensor_parallel: bool = False,
           experts: Optional[expert_parallel_memory.ExpertLayers] = None,
           expert_parallel: Optional[Sequence[int]] = None,
           set_expert_parallel: bool = False, replicas: int = 1) -> list[Config]:
    """Every configuration of K cells of T devices each with K*T <= num_devices, sorted:
    fitting ones first, then by time.

    Balance comes from partition.solve_balance on the (calibrated) profiled
    time at the micro-batch size, so cells are balanced by what they will
    really cost. A step's time is the simulated pipeline plus the calibration's
    step overhead. `tensor_parallel` are the T to try (`tensor_split.
    tensor_parallel_degrees` says which the model allows); a cell of T devices
    computes the split share of its layers at 1/T, holds 1/T of their weights and
    slots on each device, and all-reduces activations among its T devices
    (`calibration.cell_costs`). `set_tensor_parallel`: every configuration's overrides
    set T, even at 1 (for a model that has T: `Config.overrides`).

    `experts` (a body with MoE layers, `expert_parallel_memory.expert_layers`): each P of
    `expert_parallel` (default: every P it allows, `ExpertLayers.degrees`; one it does not
    allow is a ValueError) is tried, a member holding 1/P of each MoE layer's experts'
    weights, gradient sums and slots plus the all-to-all buffers, and paying two
    all-to-alls per MoE layer per micro-batch forward and backward
    (`calibration.cell_costs`). `set_expert_parallel`: every configuration sets P.

    With `replicas` R > 1 each configuration is also tried at each ZeRO stage the
    trainer builds for it (`sharding_plan.stages`), its
    peak and time adjusted by `sharding_plan` (slots at 1/R, stage 3's weight shards
    beside the gathered cell, the stage's collectives over 'none''s all-reduce).
    """
    if experts is None:
        degrees = [1]
    else:
        degrees = [experts.check(p) for p in expert_parallel or experts.degrees()]
    results = []
    for t in tensor_parallel:
        ks = cells or range(1, min(num_devices // t, len(profiles)) + 1)
        for k in (k for k in ks if k * t <= num_devices):
            for m in sorted({min(m, batch_size) for m in micro_batches}):
                balance = balance_for(profiles, k, batch_size / m, calibration, t)
                for p in degrees:
                    member = (profiles if p == 1 else
                              expert_parallel_memory.cut(profiles, experts.fractions, p))
                    buffers = None if p == 1 else experts.buffers(batch_size / m)
                    for policy in recompute:
                        for name in schedules:
                            r = simulate(member, balance, m, batch_size, policy, name,
                                         device.model, calibration, t, p, buffers)
                            peak = [float(b) for b in r.peak_bytes]
                            fits = device.memory is None or max(peak) <= device.memory
                            config = Config(
                                k, balance, m, policy, name,
                                float(r.step_time) + calibration.step_overhead,
                                float(r.bubble), peak, fits, t, set_tensor_parallel, p,
                                set_expert_parallel)
                            results += _at_stages(config, member, replicas, device,
                                                  calibration, profiles)
    # Ties (equal to the microsecond) go to fewer devices, less exchange, fewer micro-batches,
    # less memory.
    results.sort(key=lambda c: (not c.fits, round(c.step_time, 6), c.devices, c.num_cells,
                                c.expert_parallel, c.num_micro_batches,
                                sharding_plan.order(c.sharding), max(c.peak_bytes)))
    return results


def _at_stages(config: Config, profiles: Sequence[LayerProfile], replicas: int,
               device: DeviceProfile, calibration: Calibration,
               whole: Sequence[LayerProfile]) -> list[Config]:
    """`config` at each ZeRO stage `sharding_plan.stages` offers it (itself alone at R=1);
    `profiles` are what one member holds at the config's P, `whole` the same at P=1."""
    offered = sharding_plan.stages(replicas)
    if not offered:
        return [config]
    t = config.tensor_parallel
    starts = [sum(config.balance[:k]) for k in range(len(config.balance))]

    def per_cell(layers: Sequence[LayerProfile], field: str) -> list[float]:
        return [sum(getattr(p, field) * p.per_device(t) for p in layers[start:start + n])
                for start, n in zip(starts, config.balance)]
    weights, slots = per_cell(profiles, 'param_bytes'), per_cell(profiles, 'slot_bytes')
    whole_weights, whole_slots = per_cell(whole, 'param_bytes'), per_cell(whole, 'slot_bytes')
    model = calibration.device(device.model)
    out = []
    for stage in offered:
        peak = [b + sharding_plan.peak_delta(stage, replicas, w, s, ws, ww)
                for b, w, s, ws, ww in zip(config.peak_bytes, weights, slots, whole_slots,
                                           whole_weights)]
        out.append(dataclasses.replace(
            config, peak_bytes=peak,
            fits=device.memory is None or max(peak) <= device.memory,
            step_time=config.step_time + sharding_plan.extra_seconds(stage, replicas,
                                                                    weights, model),
            sharding=stage, set_sharding=True))
    return out


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


def measurement_candidates(configs: Sequence[Config], count: int) -> list[Config]:
    """The configurations worth measuring before recommending one, `count` of them.

    In this order, each the best predicted fitting configuration of its kind: on one
    cell without recompute if that fits (no pipeline, no hand-over, no second forward:
    the baseline a pipeline must beat); of any kind; with cells of T > 1 devices (when
    searched: logical CPUs sharing cores make tensor parallelism the hardest to predict);
    whose cells work at once (K > 1 and M > 1, the one way to more than one core's
    worth); the same on the fewest cells (the least hand-over and per-task cost); then
    the best of each further (K, T). Predictions of logical CPUs sharing cores go wrong
    most between these kinds, while they order configurations of one kind well enough.
    Configurations that run alike are measured once.
    """
    fitting = [c for c in configs if c.fits]
    overlapping = [c for c in fitting if c.num_cells > 1 and c.num_micro_batches > 1]
    fewest = min((c.num_cells for c in overlapping), default=None)
    one_cell = [c for c in fitting if c.num_cells == 1]
    plain = ([c for c in one_cell if c.recompute == 'never' and c.tensor_parallel == 1]
             or [c for c in one_cell if c.recompute == 'never'] or one_cell)
    split = [c for c in fitting if c.tensor_parallel > 1]
    kinds = (plain[:1] + fitting[:1] + split[:1] + overlapping[:1]
             + [c for c in overlapping if c.num_cells == fewest][:1])
    shapes = {(c.num_cells, c.tensor_parallel) for c in kinds}
    for config in fitting:
        if (config.num_cells, config.tensor_parallel) not in shapes:
            kinds.append(config)
            shapes.add((config.num_cells, config.tensor_parallel))
    picked: list[Config] = []
    for config in kinds:
        if _runs_as(config) not in map(_runs_as, picked):
            picked.append(config)
    return picked[:count]


def _runs_as(config: Config) -> tuple:
    """What a configuration runs: policies and schedules that run alike compare equal (on
    one cell 'never' and 'except_last'; on one cell or one micro-batch every schedule)."""
    plays = config.schedule if config.num_cells > 1 and config.num_micro_batches > 1 else ''
    return (tuple(config.balance), config.num_micro_batches,
            tuple(recompute_flags(config.recompute, config.num_cells)), plays,
            config.tensor_parallel)


def pick_measured(candidates: Sequence[Config], step_seconds: Sequence[Sequence[float]],
                  tolerance: float = 0.05) -> int:
    """The index of the candidate to recommend from its measured steps (interleaved).

    Each candidate's median step stands for it (load only adds time and comes in bursts
    that interleaving spreads over all of them). Candidates within `tolerance` of the
    fastest median are ties that noise could order either way, so among them the pick is
    the one that needs least (fewest devices, then fewest cells, then fewest
    micro-batches, then the better prediction): the same pick on every run unless two
    candidates really differ.
    """
    medians = [statistics.median(s) for s in step_seconds]
    fastest = min(medians)
    ties = [i for i, m in enumerate(medians) if m <= fastest * (1 + tolerance)]
    return min(ties, key=lambda i: (candidates[i].devices, candidates[i].num_cells,
                                    candidates[i].num_micro_batches, i))


def format_table(configs: Sequence[Config], limit: int = 8) -> str:
    """The best few configurations as a text table (step time in ms, peak in MiB; a T
    column when tensor parallelism was searched, a P column when expert parallelism was, the
    ZeRO stage when stages were)."""
    tensor = any(c.tensor_parallel != 1 for c in configs)
    experts = any(c.expert_parallel != 1 for c in configs)
    stages = any(c.set_sharding for c in configs)
    stage = f'{"sharding":<16} ' if stages else ''
    lines = [f'{"K":>2} {"T  " if tensor else ""}{"P  " if experts else ""}{"M":>3} '
             f'{stage}{"recompute":<11} {"schedule":<10} '
             f'{"step ms":>8} {"bubble":>6} {"peak MiB/device":<24} fits  balance']
    for c in configs[:limit]:
        peaks = '/'.join(f'{p / 2**20:.0f}' for p in c.peak_bytes)
        t = f'{c.tensor_parallel:<2} ' if tensor else ''
        t += f'{c.expert_parallel:<2} ' if experts else ''
        stage = f'{c.sharding:<16} ' if stages else ''
        lines.append(f'{c.num_cells:>2} {t}{c.num_micro_batches:>3} {stage}{c.recompute:<11} '
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


