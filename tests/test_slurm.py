"""Trainer clients under a real one-node Slurm: `srun -n 2` equals one process with R=2.

`.ci/slurm start` installs and starts the Slurm these tests use (.ci/run does it
before the suite and stops it by PID after); they find it through SLURM_CONF, else
at the script's default place. Without a Slurm up they skip on a developer's machine
and fail under CI (CI=true), where a skip would hide a broken install.
The bad-input tests need no Slurm: they give the trainer Slurm's variables as a task
would see them, wrong.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from tests import trainer_helpers as th
from tests.test_clients import MODEL, STEPS, assert_same_run
from tfpipe import checkpoints

SCRIPT_CONF = '/tmp/tfpipe-slurm/slurm.conf'  # .ci/slurm's default $TFPIPE_SLURM_DIR
EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}  # docs/clients.md: oneDNN's rounding is not exact


def slurm_env() -> dict:
    return {**th.env(), 'SLURM_CONF': os.environ.get('SLURM_CONF') or SCRIPT_CONF, **EXACT}


@pytest.fixture(scope='module')
def slurm() -> dict:
    """The environment in which srun reaches a running Slurm whose node is up."""
    env = slurm_env()
    problem = None
    if shutil.which('srun') is None:
        problem = 'srun is not installed'
    elif not os.path.exists(env['SLURM_CONF']):
        problem = f'no Slurm configuration at {env["SLURM_CONF"]}'
    else:
        state = subprocess.run(['sinfo', '-h', '-o', '%t'], env=env, capture_output=True,
                               text=True, timeout=30)
        if state.returncode != 0 or not {'idle', 'mix', 'alloc'} & set(state.stdout.split()):
            problem = f'sinfo sees no node up ({(state.stdout + state.stderr).strip()!r})'
    if problem:
        message = f'{problem}: start a one-node Slurm with `.ci/slurm start` (as root)'
        if os.environ.get('CI'):
            pytest.fail(f'CI: {message}; .ci/run does so before the tests')
        pytest.skip(message)
    return env


def free_port_pair() -> int:
    """A port P with P and P+1 free: --port_base for two tasks on one node."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s:
                try:
                    s.bind(('', port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError('no two consecutive free ports')


def trainer_command(logdir: str, data_dir: str, *flags: str, cpus: int = 2,
                    steps: int = STEPS) -> list[str]:
    """The trainer of tests/test_clients.py's runs; a client has 2 logical CPUs (K=2)."""
    cmd = th.command(MODEL, logdir, data_dir, *th.fast_flags(steps, 2),
                     th.overrides(**{'task.pipeline.schedule': 'fill_drain'}), *flags)
    return [a.replace('--num_logical_cpus=4', f'--num_logical_cpus={cpus}') for a in cmd]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM first: srun forwards it to its tasks, which a SIGKILL would orphan."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def test_srun_two_clients_equal_one_process_with_two_replicas(slurm, tmp_path, data_dir):
    clients, reference = str(tmp_path / 'slurm'), str(tmp_path / 'one_process')
    started = time.monotonic()
    srun = ['srun', '--ntasks=2', '--kill-on-bad-exit=1', '--time=10',
            *trainer_command(clients, data_dir, '--cluster_resolver=slurm',
                             f'--port_base={free_port_pair()}')]
    one_process = trainer_command(reference, data_dir, th.overrides(
        **{'task.pipeline.num_replicas': 2}), cpus=4)
    procs = [subprocess.Popen(cmd, env=env, cwd=th.REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
             for cmd, env in ((srun, slurm), (one_process, {**th.env(), **EXACT}))]
    try:
        errs = [proc.communicate(timeout=300)[1] for proc in procs]
    finally:
        for proc in procs:
            stop(proc)
    for proc, err in zip(procs, errs):
        assert proc.returncode == 0, err[-3000:]
    print(f'srun -n 2 and the reference took {time.monotonic() - started:.1f} s')
    # Each task logged its own part: both clients trained every step.
    assert len(re.findall(rf'step {STEPS}/{STEPS}', errs[0])) == 2, errs[0][-3000:]
    assert_same_run(clients, reference)


def _task_pid(job_name: str, rank: int, env: dict) -> int:
    """The PID of task `rank` of the job's step, as Slurm lists it."""
    job = subprocess.run(['squeue', '-h', '-n', job_name, '-o', '%i'], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert len(job) == 1, job
    listed = subprocess.run(['scontrol', 'listpids', job[0]], env=env, capture_output=True,
                            text=True, check=True).stdout.splitlines()[1:]
    pids = [int(row.split()[0]) for row in listed if row.split()[4] == str(rank)]
    assert len(pids) == 1, listed
    return pids[0]


def test_a_task_killed_mid_run_ends_the_other_within_60_s_naming_it(slurm, tmp_path,
                                                                      data_dir):
    logdir, log = str(tmp_path / 'run'), tmp_path / 'srun.log'
    port = free_port_pair()
    name = f'tfpipe-test-{port}'
    with open(log, 'w') as out:
        proc = subprocess.Popen(['srun', '--ntasks=2', f'--job-name={name}', '--time=10',
                                 *trainer_command(logdir, data_dir, '--cluster_resolver=slurm',
                                                  f'--port_base={port}', steps=100000)],
                                env=slurm, cwd=th.REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        train_dir = os.path.join(logdir, 'train')
        deadline = time.monotonic() + 240
        while not (os.path.isdir(train_dir) and checkpoints.latest(train_dir)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(_task_pid(name, 1, slurm), signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=90)
        assert time.monotonic() - killed < 60, log.read_text()[-3000:]
    finally:
        stop(proc)
    assert proc.returncode != 0
    node = socket.gethostname().split('.')[0]  # .ci/slurm's node is this host
    assert f'error: lost trainer task 1 ({node}:{port + 1})' in log.read_text(), \
        log.read_text()[-3000:]


# -- Bad input: exit 2 with one line, before anything is written to --logdir -------------

def _step(**variables: str) -> dict:
    """Slurm's variables for task 0 of a 2-task step on one node, with `variables` changed."""
    step = {'SLURM_PROCID': '0', 'SLURM_LOCALID': '0', 'SLURMD_NODENAME': 'n1',
            'SLURM_STEP_NUM_TASKS': '2', 'SLURM_STEP_NODELIST': 'n1',
            'SLURM_STEP_TASKS_PER_NODE': '2'}
    step.update(variables)
    return {k: v for k, v in step.items() if v is not None}


def _set_step(monkeypatch, environ: dict) -> None:
    """This process's environment as a task's with `environ`, restored after the test."""
    for name in set(os.environ) - set(_without_slurm(dict(os.environ))):
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


def _without_slurm(environ: dict) -> dict:
    return {k: v for k, v in environ.items()
            if not k.startswith(('SLURM_', 'SLURMD_')) and k != 'CUDA_VISIBLE_DEVICES'}


@pytest.mark.parametrize('environ, message', [
    ({}, 'SLURM_PROCID is not set: this is not a task of a Slurm job step'),
    (_step(SLURM_STEP_NODELIST=None), 'SLURM_STEP_NODELIST is not set: this is not a task of '
                                      'an srun step'),
    (_step(SLURM_PROCID='x'), "SLURM_PROCID='x' is not an integer"),
    (_step(SLURM_STEP_NODELIST='n[1-2]'), 'disagree: 2 distinct node(s) but task counts for 1'),
    (_step(SLURM_STEP_NUM_TASKS='3'), "task counts add up to 2"),
    (_step(SLURM_PROCID='2'), 'SLURM_PROCID=2 is out of range for a step of 2 task(s)'),
    (_step(SLURM_STEP_NODELIST='n[1-'), "SLURM_STEP_NODELIST='n[1-' cannot be read"),
    # -m cyclic: task 1 on the second node, where the resolver's block order puts task 2.
    (_step(SLURM_PROCID='1', SLURMD_NODENAME='n2', SLURM_STEP_NUM_TASKS='4',
           SLURM_STEP_NODELIST='n[1-2]', SLURM_STEP_TASKS_PER_NODE='2(x2)'),
     'task 1 runs on node n2 as local task 0, but SlurmClusterResolver'),
    # Slurm orders n9 before n10, Python's sort does not: task 0, on n9, would be told n10.
    (_step(SLURMD_NODENAME='n9', SLURM_STEP_NODELIST='n[9-10]',
           SLURM_STEP_TASKS_PER_NODE='1(x2)'),
     'task 0 runs on node n9 as local task 0, but SlurmClusterResolver, which numbers tasks '
     'node by node in sorted name order, puts it at n10:23000'),
    (_step(SLURM_STEP_GPUS='0,1,2'), 'SLURM_STEP_GPUS=0,1,2 cannot be shared evenly by the 2 '
                                     'task(s)'),
    (_step(), '--port_base=65535: the 2 task(s) on a node take ports'),
])
def test_missing_or_inconsistent_slurm_variables_are_refused(monkeypatch, environ, message):
    from tfpipe import slurm
    _set_step(monkeypatch, environ)
    with pytest.raises(slurm.ClusterError, match=re.escape(message)):
        slurm.client_cluster(65535 if 'port_base' in message else 23000)


def test_a_step_of_two_nodes_gives_each_task_its_address_and_gpus(monkeypatch):
    from tfpipe import slurm
    _set_step(monkeypatch, _step(SLURM_PROCID='3', SLURM_LOCALID='1', SLURMD_NODENAME='n2',
                                 SLURM_STEP_NUM_TASKS='4', SLURM_STEP_NODELIST='n[1-2]',
                                 SLURM_STEP_TASKS_PER_NODE='2(x2)', SLURM_STEP_GPUS='4,5,6,7'))
    got = slurm.client_cluster(23000)
    assert got.addresses == ('n1:23000', 'n1:23001', 'n2:23000', 'n2:23001')
    assert (got.task_index, got.peers.is_chief) == (3, False)
    assert os.environ['CUDA_VISIBLE_DEVICES'] == '6,7'  # the second half of the node's GPUs
    assert slurm.visible_gpus({'CUDA_VISIBLE_DEVICES': '1', 'SLURM_STEP_GPUS': '0,1'}, 2) \
        is None  # srun's per-task assignment stands


@pytest.mark.parametrize('environ, flags, message', [
    ({}, ['--cluster_resolver=slurm'],
     'error: --cluster_resolver=slurm but SLURM_PROCID is not set'),
    (_step(SLURM_STEP_TASKS_PER_NODE='1'), ['--cluster_resolver=slurm'],
     "error: Slurm: SLURM_STEP_NODELIST='n1', SLURM_STEP_TASKS_PER_NODE='1', "
     "SLURM_STEP_NUM_TASKS=2 disagree"),
    (_step(), ['--cluster_resolver=slurm', '--task=0'],
     'error: --cluster_resolver=slurm takes the cluster and the task from Slurm: drop '
     '--cluster_spec and --task'),
])
def test_the_trainer_refuses_bad_slurm_input_with_one_line_and_writes_nothing(
        tmp_path, environ, flags, message):
    logdir = str(tmp_path / 'run')
    result = subprocess.run(trainer_command(logdir, str(tmp_path / 'tfds'), *flags),
                            env={**_without_slurm(th.env()), **environ}, cwd=th.REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert th.error_line(result).startswith(message), th.error_line(result)
    assert not os.path.exists(logdir)
