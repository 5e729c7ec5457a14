"""Trainer clients as Ray Train workers, on a real local Ray (one cluster for the module).

Each worker of `TensorflowTrainer` runs docs/clients.md's recipe: `trainer.run(argv)`
with `--cluster_resolver=tf_config`, in the worker's training thread, reading the
TF_CONFIG Ray gives it. Two workers must equal one process with R=2. A worker of
Ray's generic DataParallelTrainer, which sets no TF_CONFIG, must be refused with one
line and exit status 2.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import ray  # setup.py's test extra

from tests import trainer_helpers as th
from tests.test_clients import MODEL, STEPS, assert_same_run

EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}  # docs/clients.md: oneDNN's rounding is not exact


@pytest.fixture(scope='module')
def local_ray():
    """A local Ray of 2 CPUs whose workers import this checkout; shut down at the end."""
    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={'env_vars': {'PYTHONPATH': th.REPO, 'TF_CPP_MIN_LOG_LEVEL': '2',
                                       'RAY_USAGE_STATS_ENABLED': '0', **EXACT}})
    print(f'ray.init took {time.monotonic() - started:.1f} s')
    try:
        yield
    finally:
        ray.shutdown()


def train_loop_per_worker(config: dict) -> None:
    """docs/clients.md's loop: each Ray worker is one trainer client."""
    import trainer
    code = trainer.run(config['argv'])
    if code != 0:
        raise RuntimeError(f'trainer.run exited {code}; its error is in the worker\'s log')


def record_exit_statuses(config: dict) -> None:
    """Calls trainer.run twice and writes both exit statuses and the stderr to a file."""
    import contextlib
    import io
    import trainer
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        codes = [trainer.run(config['argv']), trainer.run(config['argv'])]
    with open(config['out'], 'w') as f:
        json.dump({'codes': codes, 'stderr': err.getvalue(),
                   'tf_config': os.environ.get('TF_CONFIG')}, f)


def _fit(trainer_cls, loop, config: dict, workers: int, storage: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    started = time.monotonic()
    trainer_cls(loop, train_loop_config=config, scaling_config=ScalingConfig(
        num_workers=workers), run_config=RunConfig(storage_path=storage, name='run')).fit()
    return time.monotonic() - started


def _argv(logdir: str, data_dir: str, *flags: str, cpus: int) -> list[str]:
    cmd = th.command(MODEL, logdir, data_dir, *th.fast_flags(STEPS, 2),
                     th.overrides(**{'task.pipeline.schedule': 'fill_drain'}), *flags)
    return [a.replace('--num_logical_cpus=4', f'--num_logical_cpus={cpus}')
            for a in cmd[cmd.index('trainer') + 1:]]


def test_two_ray_train_workers_equal_one_process_with_two_replicas(local_ray, tmp_path,
                                                                   data_dir):
    from ray.train.tensorflow import TensorflowTrainer
    from tfpipe import clients as clients_lib
    standard = '{"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 0}}'
    # Else each worker would serve as a --job=worker server and fit() would never return.
    assert clients_lib.from_flags(None, None, None, {'TF_CONFIG': standard}) is not None, \
        'the standard TF_CONFIG is not a many-client run in this checkout'
    clients, reference = str(tmp_path / 'ray'), str(tmp_path / 'one_process')
    one_process = subprocess.Popen(
        [sys.executable, '-m', 'trainer',
         *_argv(reference, data_dir, th.overrides(**{'task.pipeline.num_replicas': 2}),
                cpus=4)],
        env={**th.env(), **EXACT}, cwd=th.REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        seconds = _fit(TensorflowTrainer, train_loop_per_worker,
                       {'argv': _argv(clients, data_dir, '--cluster_resolver=tf_config',
                                      cpus=2)}, 2, str(tmp_path / 'ray_storage'))
        _, err = one_process.communicate(timeout=300)
    finally:
        if one_process.poll() is None:
            one_process.kill()
        one_process.wait()
    assert one_process.returncode == 0, err[-3000:]
    print(f'TensorflowTrainer.fit with 2 clients took {seconds:.1f} s')
    assert_same_run(clients, reference)


def test_a_ray_worker_without_tf_config_is_refused_and_run_is_once_per_process(
        local_ray, tmp_path):
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    logdir, out = str(tmp_path / 'run'), str(tmp_path / 'statuses.json')
    _fit(DataParallelTrainer, record_exit_statuses,
         {'argv': _argv(logdir, str(tmp_path / 'tfds'), '--cluster_resolver=tf_config',
                        cpus=2), 'out': out}, 1, str(tmp_path / 'ray_storage'))
    with open(out) as f:
        got = json.load(f)
    assert got['tf_config'] is None
    assert got['codes'] == [2, 2], got['stderr']
    lines = [line for line in got['stderr'].splitlines() if line.startswith('error: ')]
    assert len(lines) == 2, got['stderr']  # one line per call
    assert lines[0].startswith('error: --cluster_resolver=tf_config but TF_CONFIG is not set')
    assert lines[1].startswith('error: trainer.run was already called in this process')
    assert not os.path.exists(logdir)
