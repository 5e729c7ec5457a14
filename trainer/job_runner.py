"""--mode=sync: the trainer, evaler and decoder jobs of one process, built, claimed and run.

The order is what keeps a logdir safe: every job is built first (so bad params, data or
checkpoints fail before anything is written), then each job's dir is locked and its params
written, then the jobs run: the trainer on the main thread (the cluster watchdog guards it),
evalers and decoders in threads that stop once the trainer is done.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Optional

from absl import logging

from tfpipe import lr_schedules
from tfpipe.hyperparams import Params
from trainer import eval_jobs, experiment, logdir_access, runtime_options, train_job


class BuiltJobs(list):
    """(job name, runner) pairs, plus the event that tells pollers the trainer has finished."""

    def __init__(self, items=()):
        super().__init__(items)
        self.trainer_done = threading.Event()


def build_jobs(params: Params, options: runtime_options.RuntimeOptions, jobs: list[str],
               logdir: str, model: str, default_jobs: bool, peers=None) -> BuiltJobs:
    """Builds (and so validates) every job before anything is written to the logdir.

    With `default_jobs` (no --job flag) the evaler and decoder of a split the model does not
    define are skipped instead of refused. `peers`: the trainer is the chief of several
    trainer clients (tfpipe/clients.py).
    """
    experiment.check_logdir(logdir, model)
    train_dir = train_job.train_dir_of(logdir)
    saved = experiment.saved_train_params(train_dir, params)
    if 'trainer' in jobs:
        experiment.check_resumable(saved, params, train_dir)
    max_steps = options.max_steps or params.task.train.max_steps
    latest_start = experiment.saved_train_params(train_dir, params,
                                                 experiment.ATTEMPT_PARAMS_FILE) or saved
    if 'trainer' not in jobs and options.max_steps is None and latest_start is not None:
        max_steps = latest_start.task.train.max_steps  # stop where this logdir's trainer stops

    built = BuiltJobs()
    for job in jobs:
        if job == 'trainer':
            trainer = train_job.Trainer(params, train_dir, options, peers)
            step = trainer.restore_latest()
            if saved is not None:  # the checkpoints' params: did the schedule move?
                jump = lr_schedules.resumed_horizon_change(
                    saved.task.train.lr_schedule, saved.task.train.max_steps,
                    params.task.train.lr_schedule, trainer.max_steps,
                    params.task.train.learning_rate, step)
                if jump:
                    logging.warning(jump)
            built.append((job, trainer))
            continue
        kind, split = job.split('_', 1)
        if default_jobs and (split not in params.input or params.input.Get(split) is None):
            continue
        cls = eval_jobs.Evaler if kind == 'evaler' else eval_jobs.Decoder
        stop = built.trainer_done.is_set if 'trainer' in jobs else (lambda: False)
        built.append((job, cls(params, split, logdir, max_steps, options.eval_poll_max_seconds,
                               options.eval_idle_timeout_seconds, should_stop=stop)))
    return built


def claim_job_dirs(built: BuiltJobs, logdir: str, model: str,
                   params: Params) -> list[logdir_access.JobDirLock]:
    """Locks each job's dir and writes its params there: the first write to the logdir."""
    locks = []
    for job, runner in built:
        job_dir = runner.train_dir if job == 'trainer' else runner.job_dir
        locks.append(logdir_access.JobDirLock(job_dir, job).acquire())
    for job, runner in built:
        if job == 'trainer':
            runner.restore_latest()  # again: a trainer that held the lock may have saved since
            experiment.write_job_files(logdir, runner.train_dir, model, params,
                                       experiment.ATTEMPT_PARAMS_FILE)
        else:
            experiment.write_job_files(logdir, runner.job_dir, model, params)
    return locks


def run_jobs(built: BuiltJobs, cluster) -> int:
    """Runs the trainer on this thread and the other jobs in threads; 1 if any job failed."""
    from tfpipe import cluster as cluster_lib
    errors = []

    def run_in_thread(job, runner):
        try:
            runner.run()
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            logging.exception('%s failed', job)
            errors.append(f'{job}: {e}')

    threads = [threading.Thread(target=run_in_thread, args=item, daemon=True)
               for item in built if item[0] != 'trainer']
    for thread in threads:
        thread.start()
    trainers = [runner for job, runner in built if job == 'trainer']
    watchdog = _watchdog(cluster_lib, cluster, trainers[0] if trainers else None)
    try:
        with watchdog:
            for trainer in trainers:
                trainer.run()
    finally:
        built.trainer_done.set()
    for thread in threads:
        thread.join()
    if errors:
        print('error: ' + '; '.join(errors), file=sys.stderr)
        return 1
    return 0


def _watchdog(cluster_lib, cluster, trainer: Optional[train_job.Trainer]):
    """Ends the process when a step blocks on a lost worker (cluster runs only)."""
    if cluster is None:
        return contextlib.nullcontext()
    from tfpipe import clients
    probe = (cluster_lib.answers_grpc if isinstance(cluster, clients.ClientCluster)
             else cluster_lib.accepts_connections)
    if trainer is None:
        return cluster_lib.Watchdog(cluster, probe=probe)
    return cluster_lib.Watchdog(cluster, heartbeat=lambda: trainer.heartbeat,
                                step_timeout=trainer.step_timeout, probe=probe)
