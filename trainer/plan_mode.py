"""The trainer's inspect_pipeline mode: the model's real training step as the planner's
measuring function, and the plan that comes back printed and written to --logdir.

The planning itself (search, calibration, candidates, pick) is tfpipe/tuning/planning.py;
this module only knows how to run a configuration of this model (`StepMeasurer`) and how
to report a `planning.Plan`.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import tempfile
import time
from typing import Optional

from absl import logging

from tfpipe.hyperparams import Params
from tfpipe.tuning import (expert_parallel_memory, planner, planning, sharding_plan,
                           tensor_split, timeline)
from tfpipe.tuning.calibration import MeasuredRun
from trainer import inspect_modes

PLAN_FILE = 'inspect_pipeline.json'
PLAN_GIN_FILE = 'inspect_pipeline.gin'


def configured_pipeline(task) -> planner.Config:
    """The model's own pipeline (its balance as partitioned) as a configuration to measure
    (setting T and P when the model's are not 1: calibration measures it at T=1, P=1)."""
    pipe = task.pipe
    t = (pipe.params.tensor_parallel or 1) if 'tensor_parallel' in pipe.params else 1
    p = expert_parallel_memory.degree(pipe.params)
    return planner.Config(len(pipe.balance), list(pipe.balance), pipe.params.num_micro_batches,
                          pipe.params.recompute, pipe.params.schedule, tensor_parallel=t,
                          set_tensor_parallel=t != 1, expert_parallel=p,
                          set_expert_parallel=p != 1)


def warm_up(trainer, batch, record: bool, calls: int = 2) -> None:
    """Traces and warms up the plain step, or the recorded one (`calls` calls: the first
    traces)."""
    step = trainer._recorded_step if record else trainer._step  # noqa: SLF001 - the real step
    for _ in range(calls):
        step(batch)[0].numpy()


# A measuring call stops once its steps took this long (after one at least). The planner
# asks for 5 steps of each of 4 calibration configurations and 4 rounds of 3 steps of each
# of 4 candidates: milliseconds each for the small models, over an hour for a GPT-2-sized
# one whose step takes 25 s here, whose single step is steady enough on its own.
STEP_BUDGET_SECONDS = 10.0
# The same for a lean measurement (a planning budget, --plan_seconds): one step of a
# GPT-2-sized model.
LEAN_STEP_BUDGET_SECONDS = 3.0


def timed_steps(trainer, batch, steps: int, record: bool, lean: bool = False
                ) -> tuple[list[timeline.Timeline], list[float]]:
    """Wall seconds of up to `steps` training steps (fewer once they took
    STEP_BUDGET_SECONDS) and, with `record`, timelines of as many recorded ones
    alternating with them, so both see the same load. `lean` and `record`: the recorded
    steps alone, each timed (their walls include the stamps' few ops), within
    LEAN_STEP_BUDGET_SECONDS."""
    lines, walls = [], []
    limit = LEAN_STEP_BUDGET_SECONDS if lean and record else STEP_BUDGET_SECONDS
    while len(walls) < steps and (not walls or sum(walls) < limit):
        begin = time.perf_counter()
        if not (lean and record):
            trainer._step(batch)[0].numpy()  # noqa: SLF001 - the trainer's real step
            walls.append(time.perf_counter() - begin)
        if record:
            stamps = trainer._recorded_step(batch)[-1].numpy()  # noqa: SLF001
            if lean:
                walls.append(time.perf_counter() - begin)
            lines.append(timeline.Timeline.from_stamps(trainer._recorder,  # noqa: SLF001
                                                       stamps))
    return lines, walls


@dataclasses.dataclass
class _Run:
    trainer: object
    batch: object
    train_dir: tempfile.TemporaryDirectory
    plain_warm: bool = False
    recorded_warm: bool = False


class StepMeasurer:
    """`planning.Measure` for this model: `measure(config, steps, record)` runs the model's
    training step (pipeline, loss, gradient norm, update) with `config`'s overrides, as
    one replica on its share of the batch with one virtual stage (the pipeline the
    planner plays) holding every expert (P=1: a member cannot run without its group; the
    exchange is the planner's model alone), in a throwaway train dir: the logdir is
    never touched.

    A configuration's trainer is built, traced and warmed up on its first call and kept
    for the next (candidates are measured in interleaved rounds of a few steps), the
    `capacity` most recently used of them (None: all); `close` frees them.

    `lean` (a planning budget): a recorded call traces and times the recorded step
    alone, with one call to trace it (`timed_steps`). Tracing a GPT-2-sized step takes
    12-16 s, so a calibration run that traced both steps, warmed each up twice and timed
    3 of each took 63 s of a 121 s plan, and a lean one about 25 s.
    """

    def __init__(self, params: Params, capacity: Optional[int] = None, lean: bool = False):
        self.params = params
        self.capacity = capacity
        self.lean = lean
        self._runs: collections.OrderedDict[str, _Run] = collections.OrderedDict()

    def _run(self, config: planner.Config) -> _Run:
        from trainer import runtime_options, train_job

        key = config.params_override()
        if key in self._runs:
            self._runs.move_to_end(key)
            return self._runs[key]
        params = self.params.Copy().Set(**config.overrides())
        params.input.train.batch_size //= params.task.pipeline.num_replicas
        params.task.pipeline.Set(num_replicas=1, virtual_stages=1)
        # One replica shards nothing: every stage runs its step as 'none' (the planner
        # models the stages' memory and collectives, tfpipe/tuning/sharding_plan.py).
        params.task.train.Set(sharding='none', shard_optimizer_states=False,
                              regather_per_micro_batch=False)
        if 'expert_parallel' in params.task.pipeline:
            params.task.pipeline.expert_parallel = 1
        train_dir = tempfile.TemporaryDirectory()
        trainer = train_job.Trainer(params, train_dir.name, runtime_options.RuntimeOptions())
        run = _Run(trainer, next(trainer.iterator), train_dir)
        self._runs[key] = run
        while self.capacity is not None and len(self._runs) > self.capacity:
            self._runs.popitem(last=False)[1].train_dir.cleanup()
        return run

    def __call__(self, config: planner.Config, steps: int, record: bool) -> MeasuredRun:
        run = self._run(config)
        lean = self.lean and record
        if not lean and not run.plain_warm:
            warm_up(run.trainer, run.batch, record=False)
            run.plain_warm = True
        if record and not run.recorded_warm:
            warm_up(run.trainer, run.batch, record=True, calls=1 if lean else 2)
            run.recorded_warm = True
        lines, walls = timed_steps(run.trainer, run.batch, steps, record, lean)
        pipe = run.trainer.task.pipe
        # A GPT-2-sized model's planning takes many minutes: say where it is.
        logging.info('planning: measured %s: %d step(s)%s, fastest %.3g s',
                     config.describe(), len(walls), ' recorded' if record else '', min(walls))
        return MeasuredRun(list(pipe.balance), pipe.params.num_micro_batches, lines, walls,
                           pipe.params.schedule, pipe.params.recompute)

    def close(self) -> None:
        while self._runs:
            self._runs.popitem()[1].train_dir.cleanup()

    def __enter__(self) -> 'StepMeasurer':
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _device(num_devices: int, device_memory: Optional[float], device_profile: str,
            intra_op_threads: int) -> planner.DeviceProfile:
    if device_profile:
        device = planner.parse_device_profile(device_profile)
    else:
        device = planner.DeviceProfile(planner.simulator.DeviceModel(
            parallelism=planner.local_parallelism(intra_op_threads)))
    if device_memory is not None:
        device = dataclasses.replace(device, memory=device_memory)
    return device


def inspect_pipeline(params: Params, num_devices: int, device_memory: Optional[float],
                     device_profile: str, intra_op_threads: int,
                     logdir: Optional[str], seconds: Optional[float] = None) -> None:
    """Profiles the body, hands `planning.plan` this model's measuring function (when
    planning for this machine's logical CPUs; for other devices, `device_profile`, the
    profile alone decides), prints the plan and writes it to `logdir`. A budget no
    configuration fits is a ValueError (exit 2) raised before anything is measured or
    written. With `seconds` (--plan_seconds), measuring stops so that the plan, profiling
    and the memory prediction included, ends within them where it can
    (planning.MeasuringBudget), and its calibration runs are lean (StepMeasurer)."""
    begin = time.perf_counter()
    device = _device(num_devices, device_memory, device_profile, intra_op_threads)
    task = params.task.Instantiate()
    inspect_modes.print_placement(task.pipe)
    batch_size = params.input.train.batch_size
    max_m = min(max(planner.MICRO_BATCHES), batch_size)
    profiles = inspect_modes.profile_model(params, task, max_m, member=False)
    logging.info('planning: %d layers profiled in %.0f s; measuring configurations next',
                 len(profiles), time.perf_counter() - begin)
    replicas = params.task.pipeline.num_replicas
    degrees = tensor_split.tensor_parallel_degrees(params.task.pipeline,
                                                   num_devices // replicas)
    configured = configured_pipeline(task)
    experts = expert_parallel_memory.expert_layers(
        task.pipe, params.task.train.optimizer, inspect_modes.sample_inputs(params, task)[0],
        replicas)
    expert_degrees = experts.degrees() if experts is not None else [1]
    # The configured pipeline's memory first: it measures working sets (20 s of a
    # GPT-2-sized plan), which a budget then counts before measuring any step.
    inspect_modes.print_memory_prediction(
        params, task, expert_parallel_memory.member_profiles(task.pipe, profiles,
                                                             params.task.train.optimizer))
    with StepMeasurer(params, capacity=planning.CANDIDATES, lean=seconds is not None
                      ) as measure:
        # When the model splits layers or runs T != 1, every candidate sets T: one of T=1
        # must not run (nor be recommended) on the model's own T.
        plan = planning.plan(profiles, batch_size, num_devices, device, configured,
                             None if device_profile else measure, replicas,
                             tensor_parallel=degrees,
                             set_tensor_parallel=degrees != [1] or configured.set_tensor_parallel,
                             experts=experts, set_expert_parallel=(
                                 expert_degrees != [1] or configured.set_expert_parallel),
                             budget_seconds=seconds, start=begin)
    best = plan.best
    print(f'{len(profiles)} layers profiled on {task.pipe.devices[0]}, batch {batch_size}; '
          f'{len(plan.configs)} configurations simulated for up to {num_devices} devices'
          + (f' ({replicas} replicas of K x T <= {num_devices // replicas})' if replicas > 1
             else '')
          + (f', T in {degrees}' if degrees != [1] else '')
          + (f', P in {expert_degrees}' if expert_degrees != [1] else '')
          + (', each at sharding in '
             f'{sorted({c.sharding for c in plan.configs}, key=sharding_plan.order)}'
             if replicas > 1 else '')
          + (f', budget {inspect_modes.mib(device.memory)} per device' if device.memory
             else ''))
    print(plan.calibration.describe())
    print(planner.format_table(plan.configs))
    if plan.candidates:
        print(plan.describe_measured())
    if plan.budget_note:
        print(plan.budget_note)
    print(f'best: {best.describe()}: predicted {1e3 * best.step_time:.2f} ms/step, bubble '
          f'{best.bubble:.2f}, peak {inspect_modes.mib(max(best.peak_bytes))}')
    print(best.shell_flag())
    if logdir:
        _write(logdir, params, num_devices, device, profiles, plan)


def _write(logdir: str, params: Params, num_devices: int, device: planner.DeviceProfile,
           profiles, plan: planning.Plan) -> None:
    """inspect_pipeline.gin (the pick as --gin_file) and inspect_pipeline.json (everything)."""
    os.makedirs(logdir, exist_ok=True)
    gin_path = os.path.join(logdir, PLAN_GIN_FILE)
    with open(gin_path, 'w') as f:
        f.write(plan.best.gin_text())
    print(f'wrote {gin_path} (the same as --gin_file={gin_path})')
    report = {'batch_size': params.input.train.batch_size, 'num_devices': num_devices,
              'device_memory': device.memory, 'device_model': dataclasses.asdict(device.model),
              'calibration': dataclasses.asdict(plan.calibration),
              'layers': [p.to_json() for p in profiles],
              'best': plan.best.to_json(), 'params_override': plan.best.params_override(),
              'configs': [c.to_json() for c in plan.configs],
              'measured': plan.measured_json(),
              'measuring_seconds': plan.measuring_seconds, 'budget_note': plan.budget_note}
    path = os.path.join(logdir, PLAN_FILE)
    with open(path, 'w') as f:
        json.dump(report, f, indent=1)
    print(f'wrote {path}')
