"""The launcher (`--local_clients=R`) with real client processes on loopback.

Four launcher runs and the one-process R=2 reference run start together (a module
fixture, one thread per run), because each client costs seconds of TensorFlow
start-up on this machine:

- `sigterm`: 2 clients, SIGTERM to the launcher mid-run: the clients save at the step
  they agree on and the launcher exits 0; the losses of every step and the checkpoint
  equal the one-process R=2 run's at that step.
- `restarted`: --max_restarts=1; client 1 SIGKILLed mid-run is restarted with every
  client from the last checkpoint (the first clients, the chief too, are gone before the
  new ones start); killed again with no restart left, the chief exits
  naming the lost task and the launcher exits 1 naming client 1. Its last checkpoint
  equals the reference's at that step.
- `single`: R=1, its client SIGKILLed: restarted although no client is left running.
- `refused`: bad input that only the clients can see (num_replicas=3 for 2 clients):
  exit 2 with one error line, no restart although --max_restarts=1.

Runs that need no reference run alone: SIGTERM during the clients' start-up, a
killed launcher (its clients die with it) and a NaN (not restarted).

The reference saves every step, so it holds the state of whichever step a run ended
at. TF_ENABLE_ONEDNN_OPTS=0 everywhere: oneDNN's kernels round R=2 differently from
one process (docs/clients.md). Every process is stopped by its PID in teardown.
"""
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests import trainer_helpers as th
from tfpipe import checkpoints
from trainer.exit_codes import EXIT_NON_FINITE

MODEL = 'tests.clients_model.SmallConvBNPipe'
REFERENCE_STEPS = 60  # more than any launcher run below reaches before it is stopped
CLIENT_CPUS = 2


def env() -> dict:
    return {**th.env(), 'TF_ENABLE_ONEDNN_OPTS': '0'}


def train_flags(max_steps: int, *extra: str, cpus: int = CLIENT_CPUS) -> list[str]:
    return [f'--model={MODEL}', f'--num_logical_cpus={cpus}', '--run_locally=cpu',
            f'--max_steps={max_steps}', '--gin_bindings=trainer.save_interval_steps=1',
            f'--gin_bindings=trainer.save_max_to_keep={REFERENCE_STEPS + 1}',
            '--gin_bindings=trainer.summary_interval_steps=1', *extra]


class LauncherRun:
    """One launcher process; its output goes to a file that the test reads as it grows."""

    def __init__(self, root, name: str, data_dir: str, *flags: str):
        self.logdir = str(root / name)
        self.log_path = str(root / f'{name}.log')
        with open(self.log_path, 'w') as log:
            self.proc = subprocess.Popen(
                [sys.executable, '-m', 'trainer', f'--logdir={self.logdir}',
                 f'--tfds_data_dir={data_dir}', *train_flags(REFERENCE_STEPS), *flags],
                env=env(), cwd=th.REPO, stdout=log, stderr=subprocess.STDOUT)
        self.code = None
        self.ended_at = None

    @property
    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def client_pids(self) -> list[int]:
        """Every client PID the launcher logged, in order (a restart logs new ones)."""
        return [int(p) for p in re.findall(r'^\[launcher\] client \d+: pid (\d+)',
                                           self.output, re.M)]

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if len(re.findall(pattern, self.output, re.M)) >= count:
                return
            assert self.proc.poll() is None, self.output[-4000:]
            time.sleep(0.05)
        raise AssertionError(f'no {count} x {pattern!r} within {timeout} s:\n'
                             + self.output[-4000:])

    def finish(self, timeout: float = 300) -> None:
        self.code = self.proc.wait(timeout=timeout)
        self.ended_at = time.time()

    def stop(self) -> None:
        """Teardown: the launcher and any client it logged, by PID."""
        for pid in [self.proc.pid, *self.client_pids()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (ended, not yet reaped by whoever adopted it) does not."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The PIDs among `pids` still running after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


SAVED = r'^\[client 0\] .*saved .*ckpt-\d+: step \d+, '  # trainer/train_job.py's save line


def sigterm_scenario(run: LauncherRun) -> LauncherRun:
    run.wait_for(SAVED, 2)
    run.proc.send_signal(signal.SIGTERM)
    run.finish()
    return run


def restart_scenario(run: LauncherRun) -> LauncherRun:
    run.wait_for(SAVED, 2)
    os.kill(run.client_pids()[1], signal.SIGKILL)
    run.killed_at = time.time()
    run.wait_for(r'^\[launcher\] client 1: pid \d+', 2)
    run.restarted_at = time.time()
    run.first_generation_alive = [pid for pid in run.client_pids()[:2] if alive(pid)]
    run.wait_for(SAVED, len(re.findall(SAVED, run.output, re.M)) + 2)  # training again
    os.kill(run.client_pids()[3], signal.SIGKILL)
    run.killed_again_at = time.time()
    run.finish()
    return run


def single_client_scenario(run: LauncherRun) -> LauncherRun:
    """R=1: its one client's death leaves no client running, and is still a restart."""
    run.wait_for(SAVED, 1)
    os.kill(run.client_pids()[0], signal.SIGKILL)
    run.wait_for(r'^\[launcher\] client 0: pid \d+', 2)
    run.wait_for(SAVED, len(re.findall(SAVED, run.output, re.M)) + 1)
    run.proc.send_signal(signal.SIGTERM)
    run.finish()
    return run


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp('launcher')
    launched = {
        'sigterm': LauncherRun(root, 'sigterm', data_dir, '--local_clients=2'),
        'restarted': LauncherRun(root, 'restarted', data_dir, '--local_clients=2',
                                 '--max_restarts=1'),
        'refused': LauncherRun(root, 'refused', data_dir, '--local_clients=2',
                               '--max_restarts=1', '--params_override=task.pipeline.'
                               'num_replicas=3'),
        'single': LauncherRun(root, 'single', data_dir, '--local_clients=1',
                              '--max_restarts=1'),
    }
    reference_dir = str(root / 'reference')
    reference = subprocess.Popen(
        [sys.executable, '-m', 'trainer', f'--logdir={reference_dir}',
         f'--tfds_data_dir={data_dir}', '--job=trainer',
         *train_flags(REFERENCE_STEPS, '--params_override=task.pipeline.num_replicas=2',
                      cpus=2 * CLIENT_CPUS)],
        env=env(), cwd=th.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(sigterm_scenario, launched['sigterm']),
                       pool.submit(restart_scenario, launched['restarted']),
                       pool.submit(single_client_scenario, launched['single']),
                       pool.submit(launched['refused'].finish)]
            _, err = reference.communicate(timeout=600)
            assert reference.returncode == 0, err[-3000:]
            for future in futures:
                future.result()
        yield {**launched, 'reference': reference_dir}
    finally:
        if reference.poll() is None:
            reference.kill()
        reference.wait()
        for run in launched.values():
            run.stop()


def _train(logdir: str) -> str:
    return os.path.join(logdir, 'train')


def checkpoint_values(path: str) -> dict:
    """Every variable of a checkpoint: weights, BatchNorm statistics, optimizer slots, step and
    input position (not the count of saves, which says nothing about training)."""
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(path)
            if name.endswith('.ATTRIBUTES/VARIABLE_VALUE') and
            not name.startswith('save_counter/')}


def assert_checkpoint_equals_reference(logdir: str, reference: str) -> int:
    """The run's last checkpoint equals the reference's of the same step; returns it."""
    path = checkpoints.latest(_train(logdir))
    step = checkpoints.step_of(path)
    assert 1 <= step <= REFERENCE_STEPS, path
    values = checkpoint_values(path)
    want = checkpoint_values(os.path.join(_train(reference), f'ckpt-{step}'))
    assert values.keys() == want.keys()
    assert any('moving_mean' in name for name in values)
    assert any(name.startswith('optimizer/_slots/') for name in values), sorted(values)
    for name in want:
        np.testing.assert_allclose(values[name], want[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    return step


def test_sigterm_saves_where_the_clients_agree_and_equals_one_process(runs):
    run = runs['sigterm']
    assert run.code == 0, run.output[-4000:]
    stops = re.findall(r'^\[client (\d)\] .*signal 15: saving a checkpoint at step (\d+) and '
                       r'stopping$', run.output, re.M)
    assert sorted(stops) == [('0', stops[0][1]), ('1', stops[0][1])], run.output[-4000:]
    step = assert_checkpoint_equals_reference(run.logdir, runs['reference'])
    assert step == int(stops[0][1])
    losses = th.losses_by_step(_train(run.logdir))
    want = th.losses_by_step(_train(runs['reference']))
    assert sorted(losses) == list(range(1, step + 1)), losses
    for at in losses:
        np.testing.assert_allclose(losses[at], want[at], rtol=1e-5, err_msg=f'loss at {at}')


def test_every_line_carries_its_task_and_the_clients_talk_over_loopback(runs):
    out = runs['sigterm'].output
    lines = [line for line in out.splitlines() if line.strip()]
    unprefixed = [line for line in lines if not re.match(r'\[(client [01]|launcher)\] ', line)]
    assert unprefixed == [], unprefixed[:5]
    assert re.search(r'^\[client 1\] .*trained steps 0\.\.\d+', out, re.M)
    spec = re.findall(r'^\[launcher\] client (\d): pid \d+, (127\.0\.0\.1:\d+), CPU cores',
                      out, re.M)
    assert [task for task, _ in spec] == ['0', '1'], out[:3000]
    assert 'listen on ports' in out and 'every interface' in out


def test_a_killed_client_restarts_every_client_from_the_last_checkpoint(runs):
    run = runs['restarted']
    out = run.output
    pids = run.client_pids()
    assert len(pids) == 4 and len(set(pids)) == 4, out[-4000:]
    assert run.first_generation_alive == [], out[-4000:]  # the chief too, not only client 1
    assert re.search(rf'^\[launcher\] client 1 \(pid {pids[1]}, 127\.0\.0\.1:\d+\) was killed '
                     r'by SIGKILL: stopped every client; restarting all 2 from the last '
                     r'checkpoint .*\(restart 1 of --max_restarts=1\)$', out, re.M), out[-4000:]
    assert re.search(r'^\[client 0\] .*restored .*ckpt-\d+ at step \d+', out, re.M)
    assert_checkpoint_equals_reference(run.logdir, runs['reference'])


def test_a_single_clients_death_is_restarted_too(runs):
    run = runs['single']
    assert run.code == 0, run.output[-4000:]
    assert re.search(r'^\[launcher\] client 0 \(pid \d+, 127\.0\.0\.1:\d+\) was killed by '
                     r'SIGKILL: stopped every client; restarting all 1 ', run.output, re.M)
    assert re.search(r'^\[client 0\] .*signal 15: saving a checkpoint at step \d+',
                     run.output, re.M), run.output[-4000:]


def test_without_restarts_left_the_others_exit_naming_the_lost_client(runs):
    run = runs['restarted']
    out = run.output
    pids = run.client_pids()
    assert run.code == 1, out[-4000:]
    assert run.ended_at - run.killed_again_at < 60, out[-4000:]
    lost = re.search(rf'^error: lost client 1 \(pid {pids[3]}, (127\.0\.0\.1:\d+)\) was killed '
                     r'by SIGKILL; no restart left \(--max_restarts=1\)', out, re.M)
    assert lost, out[-4000:]
    assert re.search(rf'^\[client 0\] error: lost trainer task 1 \({lost.group(1)}\)', out,
                     re.M), out[-4000:]


def test_bad_input_the_clients_find_exits_2_with_one_line_and_no_restart(runs):
    run = runs['refused']
    assert run.code == 2, run.output[-4000:]
    errors = [line for line in run.output.splitlines() if 'error: ' in line]
    assert len(errors) == 1, errors
    assert re.match(r'\[client \d\] error: task\.pipeline\.num_replicas=3 but the cluster has 2',
                    errors[0]), errors
    assert len(run.client_pids()) == 2, run.output[-4000:]  # no second start
    assert not os.path.exists(run.logdir)


# -- Stops that are not a lost client: one launcher run each, no reference needed --------

def test_sigterm_during_start_up_stops_every_client_and_exits_0(tmp_path, data_dir):
    run = LauncherRun(tmp_path, 'start_up', data_dir, '--local_clients=2')
    try:
        run.wait_for(r'^\[launcher\] client 1: pid \d+')  # both started, neither trains yet
        run.proc.send_signal(signal.SIGTERM)
        run.finish(timeout=120)
        out = run.output
        assert run.code == 0, out[-4000:]
        assert 'Traceback' not in out and not re.search(r'^(\[\w+ ?\d*\] )?error', out, re.M), \
            out[-4000:]
        assert re.search(r'^\[launcher\] client 1 \(pid \d+, 127\.0\.0\.1:\d+\) was killed by '
                         r'SIGTERM before it trained: nothing to save$', out, re.M), out[-4000:]
        assert wait_gone(run.client_pids(), 0) == []
    finally:
        run.stop()


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='a Linux parent-death signal')
def test_the_clients_of_a_killed_launcher_die_with_it(tmp_path, data_dir):
    """The clients are frozen (SIGSTOP) first: a client busy in a long step prints nothing
    for minutes, and one printing would die of the broken pipe to its dead launcher, which
    is not what is tested; a frozen client dies only of the parent-death signal."""
    run = LauncherRun(tmp_path, 'orphaned', data_dir, '--local_clients=2')
    try:
        run.wait_for(SAVED)  # training: each client past its start-up
        pids = run.client_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        run.proc.kill()
        run.finish()
        assert wait_gone(pids, 10) == [], run.output[-4000:]
    finally:
        run.stop()


def test_a_client_entry_started_by_hand_exits_2_with_one_line():
    result = subprocess.run([sys.executable, '-m', 'trainer.launched_client', f'--model={MODEL}'],
                            env=env(), cwd=th.REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith('error: TFPIPE_LAUNCHER_PID is not set: '), result.stderr
    assert result.stderr.count('\n') == 1, result.stderr


def test_a_nan_is_not_restarted_and_exits_3_naming_it(tmp_path, data_dir):
    run = LauncherRun(tmp_path, 'nan', data_dir, '--local_clients=1', '--max_restarts=1',
                      th.overrides(**{'task.train.learning_rate': 1e30}))
    try:
        run.finish()
        out = run.output
        assert run.code == EXIT_NON_FINITE, out[-4000:]
        assert len(run.client_pids()) == 1, out[-4000:]  # no restart
        last = out.splitlines()[-1]
        assert re.match(r'error: client 0 \(pid \d+, 127\.0\.0\.1:\d+\) stopped training: '
                        r'(loss is \S+ and gradient norm \S+ at step \d+|the weights after '
                        r'step \d+ are not finite); not restarted', last), out[-4000:]
    finally:
        run.stop()


# -- Bad input the launcher itself refuses: one line, exit 2, nothing started or written ----

def _cores() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize('flags, environ, message', [
    (['--local_clients=0'], {}, '--local_clients=0 must be >= 1'),
    ([f'--local_clients={_cores() + 1}', '--run_locally=cpu'], {},
     f'--local_clients={_cores() + 1} but this process may run on {_cores()} CPU core(s)'),
    (['--local_clients=2', '--run_locally=gpu'], {'CUDA_VISIBLE_DEVICES': '0'},
     '--local_clients=2 but 1 GPU(s) are visible'),
    (['--local_clients=2', '--cluster_spec=trainer=127.0.0.1:1,127.0.0.1:2'], {},
     '--cluster_spec with --local_clients'),
    (['--local_clients=2', '--task=1'], {}, '--task with --local_clients'),
    (['--local_clients=2', '--job=evaler_dev'], {}, '--job=evaler_dev with --local_clients'),
    (['--local_clients=2'], {'TF_CONFIG': '{"cluster": {"trainer": ["127.0.0.1:1"]}, '
                                          '"task": {"type": "trainer", "index": 0}}'},
     'TF_CONFIG is set and --local_clients is given'),
    (['--local_clients=2', '--mode=inspect_model'], {}, '--mode=inspect_model with'),
    (['--max_restarts=1'], {}, '--max_restarts=1 is for the launcher'),
    (['--local_clients=1', '--max_restarts=-1'], {}, '--max_restarts=-1 must be >= 0'),
])
def test_bad_launcher_input_exits_2_with_one_line(tmp_path, flags, environ, message):
    logdir = str(tmp_path / 'run')
    result = subprocess.run([sys.executable, '-m', 'trainer', f'--model={MODEL}',
                             f'--logdir={logdir}', *flags], env={**env(), **environ},
                            cwd=th.REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(f'error: {message}'), result.stderr
    assert result.stderr.count('\n') == 1, result.stderr
    assert not os.path.exists(logdir)
