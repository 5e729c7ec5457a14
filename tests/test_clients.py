"""Trainer clients on loopback: one process per replica must take the one-process step.

2 clients x K=2 (2 logical CPUs each) must equal the single-client num_replicas=2 run
and one pipeline with 2M micro-batches: loss at every step, final weights and BatchNorm
moving statistics. The fill_drain client run is done in two halves, so it also shows
that a non-chief client, given an empty logdir of its own, receives the chief's restored
state (else its weights, Adam slots and input position restart from zero). Every process
is stopped by its PID in teardown.
"""
import os
import socket
import subprocess
import time

import numpy as np
import pytest

from tests import trainer_helpers as th
from tfpipe import checkpoints

MODEL = 'tests.clients_model.SmallConvBNPipe'
STEPS = 4
CLIENT_CPUS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Processes:
    """Every process a test starts, stopped by its PID at the end."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], env: dict = None) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env={**th.env(), **(env or {})}, cwd=th.REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture(scope='module')
def processes():
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop_all()


def client_command(logdir: str, data_dir: str, spec: str, task: int, *flags: str) -> list[str]:
    cmd = th.command(MODEL, logdir, data_dir, *flags, f'--task={task}',
                     f'--cluster_spec={spec}')
    return [f'--num_logical_cpus={CLIENT_CPUS}' if a.startswith('--num_logical_cpus=') else a
            for a in cmd]


def spec_of(count: int) -> str:
    return 'trainer=' + ','.join(f'127.0.0.1:{free_port()}' for _ in range(count))


def start_clients(processes: Processes, logdirs, data_dir: str, *flags: str,
                  spec: str = None) -> list[subprocess.Popen]:
    spec = spec or spec_of(len(logdirs))
    return [processes.start(client_command(logdir, data_dir, spec, task, *flags))
            for task, logdir in enumerate(logdirs)]


def finish(procs, timeout: float = 300) -> list[str]:
    """Waits for every process; each must exit 0. Returns their stderr."""
    out = []
    deadline = time.time() + timeout
    for proc in procs:
        _, err = proc.communicate(timeout=max(1.0, deadline - time.time()))
        assert proc.returncode == 0, err[-3000:]
        out.append(err)
    return out


def flags(steps: int, schedule: str, **overrides) -> list[str]:
    return [*th.fast_flags(steps, 2), th.overrides(**{'task.pipeline.schedule': schedule,
                                                      **overrides})]


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir, processes):
    """For each schedule: the 2-client run and the one-process runs it must equal."""
    root = tmp_path_factory.mktemp('clients')
    out = {}
    started = []
    for schedule in ('fill_drain', '1f1b'):
        d = {name: str(root / f'{schedule}_{name}') for name in ('chief', 'other', 'r2', 'm4')}
        out[schedule] = d
        started.append(processes.start(th.command(MODEL, d['m4'], data_dir, *flags(
            STEPS, schedule, **{'task.pipeline.num_micro_batches': 4}))))
        if schedule == 'fill_drain':
            started.append(processes.start(th.command(MODEL, d['r2'], data_dir, *flags(
                STEPS, schedule, **{'task.pipeline.num_replicas': 2}))))
            half = start_clients(processes, [d['chief'], d['other']], data_dir,
                                 *flags(STEPS // 2, schedule))
            finish(half)
            assert not os.path.exists(d['other'])
            os.makedirs(d['other'])  # empty: the non-chief has no access to the chief's logdir
            started += start_clients(processes, [d['chief'], d['other']], data_dir,
                                     *flags(STEPS, schedule))
        else:
            started += start_clients(processes, [d['chief'], d['other']], data_dir,
                                     *flags(STEPS, schedule, **{
                                         'task.pipeline.num_replicas': 2}))
    finish(started)
    return out


def _train(logdir: str) -> str:
    return os.path.join(logdir, 'train')


def assert_same_run(actual: str, expected: str) -> None:
    losses = th.losses_by_step(_train(actual))
    want = th.losses_by_step(_train(expected))
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    for step in want:
        np.testing.assert_allclose(losses[step], want[step], rtol=1e-5,
                                   err_msg=f'loss at step {step}')
    values = th.model_values(checkpoints.latest(_train(actual)))
    want_values = th.model_values(checkpoints.latest(_train(expected)))
    assert values.keys() == want_values.keys()
    assert any('moving_mean' in name for name in values)
    for name in want_values:
        np.testing.assert_allclose(values[name], want_values[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize('schedule', ['fill_drain', '1f1b'])
def test_two_clients_take_the_one_pipeline_step(runs, schedule):
    d = runs[schedule]
    assert_same_run(d['chief'], d['m4'])
    if schedule == 'fill_drain':
        assert_same_run(d['chief'], d['r2'])


def test_a_non_chief_client_resumes_from_the_chief_and_writes_nothing(runs):
    d = runs['fill_drain']
    assert os.listdir(d['other']) == []
    assert not os.path.exists(runs['1f1b']['other'])
    assert checkpoints.step_of(checkpoints.latest(_train(d['chief']))) == STEPS
