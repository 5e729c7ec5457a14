"""ZeRO stage 3 (task.train.sharding='weights') with tensor-parallel cells across trainer clients.

Two trainer clients (real processes on loopback), each one replica of
image.shapes.TensorParallelMLP at T=2 x K=2 (4 logical CPUs each): a split weight's
shard t lives on each client's t-th device of its cell, and each client holds half of
every shard there, all-gathered across the clients among the copies of that shard.
They must train as one process with R=2 unsharded replicas at the same T and K does:
loss at every step and the chief's checkpoint key by key (whole weights under the T=1
keys, whole slots) within 1e-5, with Adam and with Adafactor (its statistics span the
whole weight: a split weight's factored moments sum over its T shards, each shard's over
the clients' parts). The Adafactor run regathers each recomputing cell's weights in every
task (task.train.regather_per_micro_batch, under cell functions), and is done in two
halves, so its second half restores the chief's step-2 checkpoint into the clients' parts
of the shards (the non-chief from an empty logdir). oneDNN is off in every process; each process is stopped by its PID in
teardown (the `processes` fixture). The first test of T > 1 across clients at any stage:
each client's cell group (its own 2 devices) needs a key no other client's group has
(replicas.group_key), else the first step fails ('joining a group that is already full').
"""
import os
import re

import numpy as np
import pytest

from tests import trainer_helpers as th
from tests.test_clients import free_port

MODEL = 'image.shapes.TensorParallelMLP'
STEPS = 3
EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}
T2 = {'task.pipeline.tensor_parallel': 2}
WEIGHT_BYTES = re.compile(r'weights: (\d+) bytes per replica, (\d+) unsharded')


def _flags(steps: int, optimizer_file: str | None, **overrides) -> list[str]:
    return [*th.fast_flags(steps, 2), th.overrides(**T2, **overrides),
            *([f'--params_file_override={optimizer_file}'] if optimizer_file else [])]


def _start_clients(processes: th.Processes, logdirs, data_dir: str, *flags: str) -> list:
    spec = 'trainer=' + ','.join(f'127.0.0.1:{free_port()}' for _ in logdirs)
    return [processes.start([*th.command(MODEL, logdir, data_dir, *flags), f'--task={task}',
                             f'--cluster_spec={spec}'], environ=EXACT)
            for task, logdir in enumerate(logdirs)]


def _start_reference(processes: th.Processes, logdir: str, data_dir: str, *flags: str):
    cmd = ['--num_logical_cpus=8' if a.startswith('--num_logical_cpus=') else a
           for a in th.command(MODEL, logdir, data_dir, *flags)]
    return processes.start(cmd, environ=EXACT)


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir, processes):
    """{optimizer: {'chief', 'other', 'reference': logdir, 'stderr': the clients' stderrs}}."""
    root = tmp_path_factory.mktemp('stage3_clients_t2')
    adafactor = root / 'adafactor.txt'
    adafactor.write_text('task.train.optimizer : Params(cls=tfpipe.optimizers.Adafactor)\n')
    d = {name: {part: str(root / f'{name}_{part}') for part in ('chief', 'other', 'reference')}
         for name in ('adam', 'adafactor')}
    stage3 = {'task.train.sharding': 'weights'}
    started = [_start_reference(processes, d[name]['reference'], data_dir,
                                *_flags(STEPS, optimizer, **{'task.pipeline.num_replicas': 2}))
               for name, optimizer in (('adam', None), ('adafactor', str(adafactor)))]
    adam = _start_clients(processes, [d['adam']['chief'], d['adam']['other']], data_dir,
                          *_flags(STEPS, None, **stage3))
    half = [d['adafactor']['chief'], d['adafactor']['other']]
    regather = {**stage3, 'task.train.regather_per_micro_batch': True}
    th.finish(_start_clients(processes, half, data_dir, *_flags(2, str(adafactor), **regather)))
    assert not os.path.exists(d['adafactor']['other'])
    os.makedirs(d['adafactor']['other'])  # empty: the non-chief has no access to the chief's
    adafactor_clients = _start_clients(processes, half, data_dir,
                                       *_flags(STEPS, str(adafactor), **regather))
    d['adam']['stderr'] = th.finish(adam)
    d['adafactor']['stderr'] = th.finish(adafactor_clients)
    th.finish(started)
    return d


@pytest.mark.parametrize('optimizer', ['adam', 'adafactor'])
def test_stage3_clients_at_t2_train_as_one_unsharded_process(runs, optimizer):
    run = runs[optimizer]
    saved, expected = th.same_run(run['chief'], run['reference'], STEPS)
    assert not any('shard' in key for key in saved)  # whole weights under the T=1 keys
    assert any('/_slots/' in key for key in saved)
    for key, value in expected.items():
        np.testing.assert_allclose(saved[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    # The non-chief wrote nothing (the Adafactor run's second half was given an empty logdir).
    assert not os.path.exists(run['other']) or os.listdir(run['other']) == []


def test_each_client_holds_half_of_every_shard(runs):
    for stderr in runs['adam']['stderr']:
        (held, whole), = WEIGHT_BYTES.findall(stderr)
        assert 2 * int(held) == int(whole)  # every shard's size is even: no padding

