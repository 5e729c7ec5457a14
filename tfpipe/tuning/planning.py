"""The planning flow in one direction: search, calibrate, measure the best few, choose.

The caller (the trainer's inspect_pipeline) profiles the model's layers and
hands `plan` one function, `measure(config, steps, record) -> MeasuredRun`,
that runs `steps` real training steps of one configuration (recorded
timelines too when `record`). Everything else happens here, in order: the
uncalibrated search (a budget nothing fits is an error before any step runs),
measured steps of the configurations that calibrate the costs
(`calibration_configs`), the calibrated search, interleaved rounds of the best
predicted candidates (`planner.measurement_candidates`) and the pick
(`planner.pick_measured`). The caller prints the `Plan` that comes back. Without
a measuring function (planning for other devices) the profile alone decides.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional, Sequence

from tfpipe.pipeline.cell import recompute_flags
from tfpipe.tuning import planner
from tfpipe.tuning.calibration import Calibration, MeasuredRun, balance_for, calibrate
from tfpipe.tuning.profile import LayerProfile

# measure(config, steps, record): `steps` training steps of `config` (the model with
# config.overrides() applied), warmed up beforehand; with `record`, as many recorded steps
# alternating with them, whose timelines come back too.
Measure = Callable[[planner.Config, int, bool], MeasuredRun]

CALIBRATION_STEPS = 5
# Before recommending, this many of the best predicted configurations are measured for
# CANDIDATE_ROUNDS interleaved rounds of CANDIDATE_STEPS steps each.
CANDIDATES = 4
CANDIDATE_ROUNDS = 4
CANDIDATE_STEPS = 3
PICK_TOLERANCE = 0.05  # measured medians closer than this are a tie (planner.pick_measured)


@dataclasses.dataclass
class Plan:
    """What planning found: every configuration's prediction (calibrated when measured),
    the recommendation, and the candidates measured before it was chosen."""

    configs: list[planner.Config]
    best: planner.Config
    calibration: Calibration = Calibration()
    candidates: list[planner.Config] = dataclasses.field(default_factory=list)
    step_seconds: list[list[float]] = dataclasses.field(default_factory=list)
    measuring_seconds: float = 0.0
    rounds: int = CANDIDATE_ROUNDS
    steps: int = CANDIDATE_STEPS

    def describe_measured(self) -> str:
        """The measured candidates and the pick, one line each ('' when none were)."""
        if not self.candidates:
            return ''
        lines = [f'measured before recommending ({self.rounds} interleaved rounds of up to '
                 f'{self.steps} steps, {_counts(self.step_seconds)} steps of each in all, '
                 f'{self.measuring_seconds:.0f} s): the best predicted '
                 'on one cell (without recompute), of any kind, running cells at once, that on '
                 'the fewest cells, of other K']
        for c, s in zip(self.candidates, self.step_seconds):
            lines.append(f'  {c.describe()}: predicted {1e3 * c.step_time:.2f} ms, measured '
                         f'median {1e3 * statistics.median(s):.2f} ms (fastest '
                         f'{1e3 * min(s):.2f})' + ('  <- picked' if c is self.best else ''))
        lines.append(f'picked: the fastest median; candidates within {PICK_TOLERANCE:.0%} of '
                     'it are a tie, won by fewer cells, then fewer micro-batches')
        return '\n'.join(lines)

    def measured_json(self) -> list[dict]:
        return [{'config': c.to_json(), 'step_seconds': s}
                for c, s in zip(self.candidates, self.step_seconds)]


def _counts(runs: Sequence[Sequence]) -> str:
    """'5', or '1-5' when a measuring function ran fewer steps of some (it may stop early
    where steps are long: trainer/plan_mode.STEP_BUDGET_SECONDS)."""
    least, most = min(len(r) for r in runs), max(len(r) for r in runs)
    return str(least) if least == most else f'{least}-{most}'


def calibration_configs(configured: planner.Config, profiles: Sequence[LayerProfile],
                        batch_size: int) -> list[planner.Config]:
    """The configurations whose measured steps calibrate the planner.

    First the model's own pipeline (`configured`) as the planner can play it
    (fill_drain unless its schedule is one the planner searches; T=1: the calibrated
    costs are those of one device, which tensor parallelism divides); then the same
    with twice (at the limit half) the micro-batches, which tells the per-call
    part of compute from the per-example part; then the same on one cell (two
    if it has one), which tells how much logical CPUs really run at once, and
    that once more under the other recompute policy ('never' if its cells
    recompute, else 'always'), which tells what keeping activations costs.
    """
    own = dataclasses.replace(configured, balance=list(configured.balance), tensor_parallel=1)
    if own.schedule not in planner.SCHEDULES:
        own.schedule = 'fill_drain'
    runs = [own]
    limit = min(max(planner.MICRO_BATCHES), batch_size)
    m = own.num_micro_batches
    other = 2 * m if 2 * m <= limit else m // 2
    if 1 <= other != m:
        runs.append(dataclasses.replace(own, num_micro_batches=other))
    if own.num_cells > 1 or len(profiles) > 1:
        k = 1 if own.num_cells > 1 else 2
        one = dataclasses.replace(own, num_cells=k,
                                  balance=balance_for(profiles, k, batch_size / m))
        runs.append(one)
        flags = recompute_flags(own.recompute, k)
        runs.append(dataclasses.replace(one, recompute='never' if any(flags) else 'always'))
    return runs


def fit_calibration(profiles: Sequence[LayerProfile], runs: Sequence[MeasuredRun],
                    batch_size: int, parallelism: Optional[float]) -> Calibration:
    """calibration.calibrate on measured runs, saying which runs they were."""
    shapes = ', '.join(f'K={len(run.balance)} M={run.num_micro_batches} {run.recompute}'
                       for run in runs)
    return calibrate(profiles, runs, batch_size, parallelism,
                     source=f'{_counts([run.timelines for run in runs])} steps each of {shapes} '
                     f'(schedule={runs[0].schedule})')


def interleaved(measure: Measure, configs: Sequence[planner.Config], rounds: int,
                steps: int) -> list[list[float]]:
    """Wall seconds of `rounds` x `steps` training steps of each configuration.

    The rounds are interleaved (each in another order) so that every configuration sees
    the same load: on a shared machine load comes and goes in bursts longer than a step.
    """
    seconds: list[list[float]] = [[] for _ in configs]
    for r in range(rounds):
        for i in [(r + j) % len(configs) for j in range(len(configs))]:
            seconds[i] += measure(configs[i], steps, False).step_seconds
    return seconds


def plan(profiles: Sequence[LayerProfile], batch_size: int, num_devices: int,
         device: planner.DeviceProfile, configured: planner.Config,
         measure: Optional[Measure] = None, replicas: int = 1,
         calibration_steps: int = CALIBRATION_STEPS, candidates: int = CANDIDATES,
         rounds: int = CANDIDATE_ROUNDS, steps: int = CANDIDATE_STEPS,
         **search_options) -> Plan:
    """The recommended configuration of one replica's pipeline (of `replicas`, each on its
    share of `batch_size` and of the `num_devices` devices) for devices like `device`.

    With `measure`, the costs are first calibrated on measured steps of
    `calibration_configs(configured, ...)`, and then `candidates` of the best
    predicted are measured and the fastest measured recommended: predictions of
    CPU steps can put configurations within 1% that run 1.4x apart. `measure` runs
    one replica on its share of the batch. A budget no configuration fits is a
    ValueError raised before anything is measured. `search_options` go to
    `planner.search` (e.g. `tensor_parallel`, the T to try); with `replicas` > 1 the search
    tries each ZeRO stage too, which `measure` (one replica) cannot tell apart: their
    predictions differ by the memory and collectives `sharding_plan` models.
    """
    if num_devices < replicas:
        raise ValueError(f'{replicas} replicas need at least as many devices, not '
                         f'{num_devices}: raise --num_devices or lower num_replicas')
    batch, devices = batch_size // replicas, num_devices // replicas
    configs = planner.search(profiles, batch, devices, device, replicas=replicas,
                             **search_options)
    best = planner.best_fitting(configs, device.memory)  # memory needs no calibration
    if measure is None:
        return Plan(configs, best)
    runs = [measure(c, calibration_steps, True)
            for c in calibration_configs(configured, profiles, batch)]
    calibration = fit_calibration(profiles, runs, batch, device.model.parallelism)
    configs = planner.search(profiles, batch, devices, device, calibration=calibration,
                             replicas=replicas, **search_options)
    planner.best_fitting(configs, device.memory)
    begin = time.perf_counter()
    measured = planner.measurement_candidates(configs, candidates)
    seconds = interleaved(measure, measured, rounds, steps)
    pick = planner.pick_measured(measured, seconds, PICK_TOLERANCE)
    return Plan(configs, measured[pick], calibration, measured, seconds,
                time.perf_counter() - begin, rounds, steps)
