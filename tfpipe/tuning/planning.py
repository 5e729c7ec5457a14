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
    budget_note: str = ''  # what was measured within a budget ('' without one)

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


class MeasuringBudget:
    """`measure` within wall-clock `seconds` from `start` (the trainer's --plan_seconds).

    Measuring is most of a plan of a large model: GPT2SmallShapedLM's took 10 minutes on a
    quiet host and 46 on a loaded one, 12 traced configurations of several 4-30 s steps.
    With a budget a measurement starts only while it would end before the budget does, judged by
    the same configuration's previous call (its trace is cached, so a later round costs
    less) or else the longest first call so far; what could not be measured is left out
    and said (`note`), and the plan decides on what was: fewer calibration runs, fewer
    candidates or rounds, at worst the profile alone. None: no budget.
    """

    def __init__(self, measure: Measure, seconds: Optional[float], start: float,
                 clock: Callable[[], float] = time.perf_counter):
        self._measure, self._clock, self.seconds = measure, clock, seconds
        self.deadline = None if seconds is None else start + seconds
        self._first_calls: list[float] = []
        self._last: dict[str, float] = {}  # config.describe() -> its last call's seconds
        self.calls = 0

    def allows(self, config: planner.Config) -> bool:
        if self.deadline is None:
            return True
        key = config.describe()
        cost = self._last.get(key, max(self._first_calls, default=0.0))
        return self._clock() + cost < self.deadline

    def __call__(self, config: planner.Config, steps: int, record: bool) -> MeasuredRun:
        begin = self._clock()
        run = self._measure(config, steps, record)
        took, key = self._clock() - begin, config.describe()
        self.calls += 1
        if key not in self._last:
            self._first_calls.append(took)
        self._last[key] = took
        return run

    def note(self, calibrated: int, calibrations: int, measured: int, candidates: int,
             rounds: int, wanted_rounds: int) -> str:
        """What was measured within the budget, one line ('' without a budget)."""
        if self.deadline is None:
            return ''
        complete = (calibrated, measured, rounds) == (calibrations, candidates, wanted_rounds)
        longest = max(self._first_calls, default=0.0)
        decided = ('the pick is the best measured candidate' if measured else
                   'the pick is the calibrated prediction, not measured' if calibrated else
                   'the pick is the profile\'s prediction: nothing was measured')
        return (f'planning budget {self.seconds:g} s (--plan_seconds): measured {calibrated} of '
                f'{calibrations} calibration runs and {measured} of {candidates} candidates in '
                f'{rounds} of {wanted_rounds} rounds (a first measurement took up to '
                f'{longest:.0f} s); {decided}.' + ('' if complete else
                                                    ' Raise it, or drop it, to measure more.'))


def interleaved(measure: Measure, configs: Sequence[planner.Config], rounds: int,
                steps: int, budget: Optional[MeasuringBudget] = None) -> list[list[float]]:
    """Wall seconds of up to `rounds` x `steps` training steps of each configuration.

    The rounds are interleaved (each in another order) so that every configuration sees
    the same load: on a shared machine load comes and goes in bursts longer than a step.
    Within a `budget` a round stops at the first configuration it does not allow, and no
    round follows: a configuration may have one round fewer, or none.
    """
    seconds: list[list[float]] = [[] for _ in configs]
    for r in range(rounds):
        for i in [(r + j) % len(configs) for j in range(len(configs))]:
            if budget is not None and not budget.allows(configs[i]):
                return seconds
            seconds[i] += (budget or measure)(configs[i], steps, False).step_seconds
    return seconds


def plan(profiles: Sequence[LayerProfile], batch_size: int, num_devices: int,
         device: planner.DeviceProfile, configured: planner.Config,
         measure: Optional[Measure] = None, replicas: int = 1,
         calibration_steps: int = CALIBRATION_STEPS, candidates: int = CANDIDATES,
         rounds: int = CANDIDATE_ROUNDS, steps: int = CANDIDATE_STEPS,
         budget_seconds: Optional[float] = None, start: Optional[float] = None,
         clock: Callable[[], float] = time.perf_counter, **search_options) -> Plan:
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
    predictions differ by the memory and collectives `sharding_plan` models. With
    `budget_seconds` (counted from `start`, e.g. before profiling, on `clock`) measuring
    stops where a `MeasuringBudget` says, and the plan says what it left out.
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
    budget = MeasuringBudget(measure, budget_seconds, clock() if start is None else start,
                             clock)
    wanted = calibration_configs(configured, profiles, batch)
    runs = []
    for config in wanted:
        if not budget.allows(config):
            break
        runs.append(budget(config, calibration_steps, True))
    if not runs:
        return Plan(configs, best, budget_note=budget.note(0, len(wanted), 0, candidates, 0,
                                                           rounds))
    calibration = fit_calibration(profiles, runs, batch, device.model.parallelism)
    configs = planner.search(profiles, batch, devices, device, calibration=calibration,
                             replicas=replicas, **search_options)
    best = planner.best_fitting(configs, device.memory)
    begin = clock()
    chosen = planner.measurement_candidates(configs, candidates)
    seconds = interleaved(measure, chosen, rounds, steps, budget)
    done = [i for i, s in enumerate(seconds) if s]
    note = budget.note(len(runs), len(wanted), len(done), len(chosen),
                       -(-(budget.calls - len(runs)) // max(len(chosen), 1)), rounds)
    if not done:
        return Plan(configs, best, calibration, measuring_seconds=clock() - begin,
                    budget_note=note)
    measured, seconds = [chosen[i] for i in done], [seconds[i] for i in done]
    pick = planner.pick_measured(measured, seconds, PICK_TOLERANCE)
    return Plan(configs, measured[pick], calibration, measured, seconds,
                clock() - begin, rounds, steps, note)
