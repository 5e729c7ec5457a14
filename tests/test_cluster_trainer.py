"""The trainer across worker processes on loopback: equality, a lost worker, bad input.

Two worker servers (2 logical CPUs each) are shared by the module; every process
a test starts is stopped by its PID in teardown, also when the test fails.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests import trainer_helpers as th
from tfpipe import checkpoints

WORKER_CPUS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


class Workers:
    """Worker processes of one cluster spec, restartable, each stopped by its PID."""

    def __init__(self, cwd: str, count: int = 2):
        self.cwd = cwd  # not the trainer's cwd: checkpoint I/O must happen in the trainer
        self.addresses = [f'127.0.0.1:{free_port()}' for _ in range(count)]
        self.spec = 'worker=' + ','.join(self.addresses)
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, task: int) -> subprocess.Popen:
        proc = th.popen(
            [sys.executable, '-m', 'trainer', '--job=worker', f'--task={task}',
             f'--cluster_spec={self.spec}', '--run_locally=cpu',
             f'--num_logical_cpus={WORKER_CPUS}'],
            th.env(), subprocess.DEVNULL, subprocess.PIPE, cwd=self.cwd)
        self.procs[task] = proc
        return proc

    def start_all(self) -> None:
        for task in range(len(self.addresses)):
            self.start(task)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            _stop(proc)


@pytest.fixture(scope='module')
def workers(tmp_path_factory):
    w = Workers(str(tmp_path_factory.mktemp('worker_cwd')))
    try:
        w.start_all()
        yield w
    finally:
        w.stop_all()


def trainer(cwd: str, logdir: str, data_dir: str, *flags: str, spec: str = None,
            environ: dict = None, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = th.command(th.FAST, logdir, data_dir, *flags)
    if spec:
        cmd.append(f'--cluster_spec={spec}')
    return th.run_command(cmd, environ, timeout, cwd=cwd)


def start_long_run(cwd: str, logdir: str, data_dir: str, spec: str,
                   *flags: str) -> subprocess.Popen:
    """A cluster trainer that would run for ever (the caller stops it by PID)."""
    cmd = [*th.command(th.FAST, logdir, data_dir, *th.fast_flags(100000, 2)),
           f'--cluster_spec={spec}', *flags]
    return th.popen(cmd, th.env(), subprocess.DEVNULL, subprocess.PIPE, cwd=cwd)


def losses(train_dir: str) -> dict[int, float]:
    """The loss summary at every step, from the trainer's event files."""
    out = {}
    for name in sorted(os.listdir(train_dir)):
        if not name.startswith('events.out.tfevents'):
            continue
        for record in tf.data.TFRecordDataset(os.path.join(train_dir, name)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.tag == 'loss':
                    out[event.step] = float(tf.make_ndarray(value.tensor))
    return out


STEPS = 4


def assert_same_run(expected_dir, actual_dir) -> None:
    """Loss at every step and the final checkpoint's variables within 1e-5."""
    expected, actual = losses(str(expected_dir)), losses(str(actual_dir))
    assert sorted(expected) == sorted(actual) == list(range(1, STEPS + 1))
    for step in expected:
        assert actual[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-7), step
    assert checkpoints.step_of(checkpoints.latest(str(actual_dir))) == STEPS
    want = th.model_values(checkpoints.latest(str(expected_dir)))
    got = th.model_values(checkpoints.latest(str(actual_dir)))
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)


def single_process_run(request, tmp_path, data_dir, flags, balance) -> str:
    """The train dir of `flags` on local CPUs; the model's own balance is a shared run."""
    if balance == [3, 2]:
        shared = request.getfixturevalue('trained_4_steps')  # the same flags
        with open(os.path.join(shared.logdir, 'train', 'params.txt')) as f:
            assert f'task.pipeline.balance : {balance}\n' in f.read()
        return os.path.join(shared.logdir, 'train')
    local = trainer(str(tmp_path), 'local', data_dir, *flags)
    assert local.returncode == 0, local.stderr[-3000:]
    return str(tmp_path / 'local' / 'train')


@pytest.mark.parametrize('balance', [[3, 2], [1, 1, 1, 2]], ids=['K2', 'K4'])
def test_cluster_run_equals_single_process_run(request, tmp_path, data_dir, workers, balance):
    flags = [*th.fast_flags(STEPS, 2), th.overrides(**{'task.pipeline.balance': balance})]
    local_train_dir = single_process_run(request, tmp_path, data_dir, flags, balance)
    # A relative logdir, and workers in another cwd: the checkpoint files are written
    # by the trainer process (a worker writing its shard would miss this directory).
    # K=4 also names the trainer's own address (job chief), as runs across hosts must.
    spec = workers.spec + (f'@chief=127.0.0.1:{free_port()}' if len(balance) == 4 else '')
    remote = trainer(str(tmp_path), 'remote', data_dir, *flags, spec=spec)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert_same_run(local_train_dir, tmp_path / 'remote' / 'train')
    if len(balance) == 4:  # each check once, to keep the module short
        inspect = trainer(str(tmp_path), 'remote', data_dir, '--mode=inspect_model',
                          th.overrides(**{'task.pipeline.balance': balance}), spec=workers.spec)
        assert inspect.returncode == 0, inspect.stderr[-3000:]
        for k, (task, index) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):  # tasks first
            assert f'cell {k} on /job:worker/replica:0/task:{task}/device:CPU:{index}:' \
                in inspect.stdout, inspect.stdout
        return
    # The evaler needs no cluster to read the cluster's checkpoints.
    result = trainer(str(tmp_path), 'remote', data_dir, '--job=evaler_dev',
                     f'--max_steps={STEPS}', th.overrides(**{'task.eval.samples_per_summary': 32}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(tmp_path / 'remote' / 'eval_dev' / f'score-{STEPS}.txt')


def test_replicas_across_processes_equal_replicas_in_one_process(
        tmp_path, data_dir, workers, trained_4_steps_two_replicas):
    """R=2 x K=2: one replica per worker, each cell's gradients all-reduced across the
    two processes by TF's collective ops, equals the same layout on 4 local CPUs (the
    session's shared run of these flags)."""
    flags = [*th.fast_flags(STEPS, 2), th.overrides(**{'task.pipeline.num_replicas': 2})]
    remote = trainer(str(tmp_path), 'remote', data_dir, *flags, spec=workers.spec)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert_same_run(os.path.join(trained_4_steps_two_replicas.logdir, 'train'),
                    tmp_path / 'remote' / 'train')
    inspect = trainer(str(tmp_path), 'remote', data_dir, '--mode=inspect_model',
                      th.overrides(**{'task.pipeline.num_replicas': 2}), spec=workers.spec)
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    for r in range(2):  # one replica per worker task
        for k in range(2):
            assert (f'replica {r} cell {k} on /job:worker/replica:0/task:{r}/device:CPU:{k}:'
                    in inspect.stdout), inspect.stdout


def test_sharded_optimizer_states_across_processes_equal_unsharded_in_one_process(
        tmp_path, data_dir, workers, trained_4_steps_two_replicas):
    """R=2 x K=2 with task.train.shard_optimizer_states, one replica per worker: each
    process keeps half of the Adam slots; the all-gather of the updated weights and the
    saved slots cross processes. Equal to the unsharded run on 4 local CPUs."""
    flags = [*th.fast_flags(STEPS, 2), th.overrides(**{
        'task.pipeline.num_replicas': 2, 'task.train.shard_optimizer_states': True})]
    remote = trainer(str(tmp_path), 'remote', data_dir, *flags, spec=workers.spec)
    assert remote.returncode == 0, remote.stderr[-3000:]
    local_dir = os.path.join(trained_4_steps_two_replicas.logdir, 'train')
    assert_same_run(local_dir, tmp_path / 'remote' / 'train')
    want = tf.train.load_checkpoint(checkpoints.latest(local_dir))
    got = tf.train.load_checkpoint(checkpoints.latest(str(tmp_path / 'remote' / 'train')))
    slots = [name for name in want.get_variable_to_shape_map() if '/_slots/' in name]
    assert slots
    for name in slots:
        np.testing.assert_allclose(got.get_tensor(name), want.get_tensor(name), rtol=1e-5,
                                   atol=1e-7, err_msg=name)


def test_lost_worker_fails_fast_and_rerun_resumes(tmp_path, data_dir, workers):
    logdir = str(tmp_path / 'run')
    train_dir = os.path.join(logdir, 'train')
    proc = start_long_run(str(tmp_path), logdir, data_dir, workers.spec)
    try:
        th.wait_for_checkpoint(proc, train_dir, 4)
        workers.procs[1].kill()  # SIGKILL, at whatever point the step is
        workers.procs[1].wait()
        killed_at = time.time()
        _, stderr = proc.communicate(timeout=90)
        failed_after = time.time() - killed_at
    finally:
        _stop(proc)
        workers.start(1)
    assert proc.returncode == 1, stderr[-3000:]
    assert failed_after < 60, failed_after
    error = [line for line in stderr.splitlines() if line.startswith('error: ')]
    assert error == [f'error: lost worker task 1 ({workers.addresses[1]}): training stopped '
                     'without saving; restart the worker and rerun the trainer, which resumes '
                     'from the last checkpoint'], stderr[-3000:]
    # Every listed checkpoint is complete and loadable.
    state = tf.train.get_checkpoint_state(train_dir)
    for path in state.all_model_checkpoint_paths:
        assert th.model_values(os.path.join(train_dir, os.path.basename(path)))
    last = checkpoints.step_of(checkpoints.latest(train_dir))
    assert last >= 4
    result = trainer(str(tmp_path), 'run', data_dir, *th.fast_flags(last + 2, 2),
                     spec=workers.spec)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'ckpt-{last} at step {last}' in result.stderr  # resumed, not restarted
    assert checkpoints.step_of(checkpoints.latest(train_dir)) == last + 2


def test_frozen_worker_ends_the_step_at_its_deadline(tmp_path, data_dir, workers):
    """SIGSTOP: the worker's kernel still accepts connections, so only the step deadline
    (trainer.step_timeout_seconds) can tell; the trainer names the workers and exits 1."""
    logdir = str(tmp_path / 'run')
    train_dir = os.path.join(logdir, 'train')
    proc = start_long_run(str(tmp_path), logdir, data_dir, workers.spec,
                          '--gin_bindings=trainer.step_timeout_seconds=8')
    frozen = workers.procs[1]
    try:
        th.wait_for_checkpoint(proc, train_dir, 2)
        frozen.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        _, stderr = proc.communicate(timeout=120)
        failed_after = time.time() - stopped_at
    finally:
        _stop(proc)
        frozen.send_signal(signal.SIGCONT)
        _stop(frozen)
        workers.start(1)
    assert proc.returncode == 1, stderr[-3000:]
    assert 8 <= failed_after < 60, failed_after
    error = [line for line in stderr.splitlines() if line.startswith('error: ')]
    assert len(error) == 1 and ' s after step ' in error[0] and (
        f'task 0 ({workers.addresses[0]}), task 1 ({workers.addresses[1]})' in error[0]) and (
        error[0].endswith('or raise trainer.step_timeout_seconds if a step really takes this '
                          'long')), stderr[-3000:]
    checkpoints.check_readable(checkpoints.latest(train_dir))


def test_more_cells_than_cluster_devices(tmp_path, data_dir, workers):
    result = trainer(str(tmp_path), 'run', data_dir, '--job=trainer',
                     th.overrides(**{'task.pipeline.balance': [1, 1, 1, 1, 1]}),
                     spec=workers.spec)
    assert result.returncode == 2, result.stderr[-3000:]
    assert th.error_line(result) == (
        'error: task/pipe: the pipeline needs 5 devices but the cluster has 4 (worker task 0: 2, '
        'worker task 1: 2): use at most that many cells (times replicas), start more workers, '
        'or give each worker more devices (--num_logical_cpus with --run_locally=cpu)')
    assert not os.path.exists(tmp_path / 'run')


def test_worker_not_up_times_out_naming_it(tmp_path, data_dir, workers):
    missing = f'127.0.0.1:{free_port()}'
    start = time.time()
    result = trainer(str(tmp_path), 'run', data_dir, '--job=trainer',
                     '--cluster_wait_seconds=1', spec=f'{workers.spec},{missing}')
    assert result.returncode == 1, result.stderr[-3000:]
    assert th.error_line(result) == (
        f'error: worker task 2 ({missing}) did not accept connections within 1 s: start it '
        '(python -m trainer --job=worker --task=2 --cluster_spec=...) or raise '
        '--cluster_wait_seconds')
    assert time.time() - start < 60
    assert not os.path.exists(tmp_path / 'run')


def test_worker_serves_until_sigterm_and_refuses_a_used_port(tmp_path):
    w = Workers(str(tmp_path), count=1)
    second = None
    try:
        first = w.start(0)
        deadline = time.time() + 60
        from tfpipe import cluster
        while not cluster.accepts_connections(w.addresses[0]) and time.time() < deadline:
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.1)
        second = th.run_command(
            [sys.executable, '-m', 'trainer', '--job=worker', '--task=0',
             f'--cluster_spec={w.spec}'], timeout=120, cwd=os.getcwd())
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
    finally:
        w.stop_all()
    assert second.returncode == 2, second.stderr[-3000:]
    port = w.addresses[0].rsplit(':', 1)[1]
    assert th.error_line(second) == (
        f'error: worker task 0: port {port} of {w.addresses[0]} is in use (Address already in '
        'use): stop the process that holds it, or give this task another port in the cluster '
        'spec')


BAD = [
    (['--job=trainer', '--cluster_spec=worker=127.0.0.1'], {},
     "error: --cluster_spec=worker=127.0.0.1: bad address '127.0.0.1': write HOST:PORT with a "
     'port in 1..65535, e.g. 127.0.0.1:2222'),
    (['--job=trainer'], {'TF_CONFIG': '{"cluster": {"worker": ["127.0.0.1:1"]'},
     'error: TF_CONFIG is not valid JSON (Expecting \',\' delimiter at char 38); write '
     'TF_CONFIG=\'{"cluster": {"worker": ["HOST:PORT", ...]}, "task": {"type": "worker", '
     '"index": I}}\' (optionally a "chief" and an "evaluator" job)'),
    (['--job=worker', '--task=2', '--cluster_spec=worker=127.0.0.1:1,127.0.0.1:2'], {},
     "error: --task=2: task index 2 is out of range: job 'worker' has 2 task(s), so use 0..1"),
    ([], {'TF_CONFIG': json.dumps({'cluster': {'worker': ['127.0.0.1:1']},
                                   'task': {'type': 'worker', 'index': 1}})},
     "error: TF_CONFIG: task index 1 is out of range: job 'worker' has 1 task(s), so use 0..0"),
]


@pytest.mark.parametrize('flags, environ, message', BAD,
                         ids=['spec', 'tf_config', 'task_flag', 'task_tf_config'])
def test_bad_cluster_input_exits_2(tmp_path, data_dir, flags, environ, message):
    result = trainer(str(tmp_path), 'run', data_dir, *flags, environ=environ, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert th.error_line(result) == message
    assert not os.path.exists(tmp_path / 'run')
