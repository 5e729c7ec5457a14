"""Optimizer states sharded across trainer clients (real processes on loopback).

Two clients with task.train.shard_optimizer_states=True (Adam, K=2) each hold half of
every slot. The model is SmallConvPipe with odd-sized conv0 variables
(tests/odd_sizes_model.py): the second client's part of them is one element short,
padded for the all-gather that collects the whole slots for the chief's checkpoint.
They must train as one process with R=2 unsharded replicas does (so must stages 2 and
3, the weights' halves of stage 3 included): loss at every step, and the chief's checkpoints (weights and WHOLE Adam slots,
under the same keys) within 1e-5. The sharded run is done in two halves, so its second
half restores the chief's checkpoint into sharded clients (the non-chief, given an
empty logdir, must receive its half of the slots from the chief); the chief's step-2
checkpoint also resumes in one unsharded process with R=1 and 4 micro-batches. oneDNN
is off in every process (its kernels round differently per batch shape). Every
process is stopped by its PID in teardown.
"""
import os
import re
import shutil

import numpy as np
import pytest

from tests import trainer_helpers as th
from tests.test_clients import free_port

MODEL = 'tests.odd_sizes_model.SmallConvOddPipe'
STEPS = 4
EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}
SHARDED = {'task.train.shard_optimizer_states': True}
SLOT_BYTES = re.compile(r'optimizer slots: (\d+) bytes per replica in this process, '
                        r'(\d+) unsharded')


def _flags(steps: int, **overrides) -> list[str]:
    return [*th.fast_flags(steps, 2), *([th.overrides(**overrides)] if overrides else [])]


def _start_clients(processes: th.Processes, logdirs, data_dir: str, *flags: str) -> list:
    spec = 'trainer=' + ','.join(f'127.0.0.1:{free_port()}' for _ in logdirs)
    procs = []
    for task, logdir in enumerate(logdirs):
        cmd = ['--num_logical_cpus=2' if a.startswith('--num_logical_cpus=') else a
               for a in th.command(MODEL, logdir, data_dir, *flags)]
        procs.append(processes.start([*cmd, f'--task={task}', f'--cluster_spec={spec}'],
                                     environ=EXACT))
    return procs


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir, processes):
    root = tmp_path_factory.mktemp('sharded_clients')
    d = {name: str(root / name) for name in ('chief', 'other', 'reference', 'unsharded')}
    first = _start_clients(processes, [d['chief'], d['other']], data_dir,
                           *_flags(STEPS // 2, **SHARDED))
    reference = processes.start(th.command(MODEL, d['reference'], data_dir, *_flags(
        STEPS, **{'task.pipeline.num_replicas': 2})), environ=EXACT)
    d['first_stderr'] = th.finish(first)
    assert not os.path.exists(d['other'])
    shutil.copytree(d['chief'], d['unsharded'])
    os.makedirs(d['other'])  # empty: the non-chief has no access to the chief's logdir
    second = _start_clients(processes, [d['chief'], d['other']], data_dir,
                            *_flags(STEPS, **SHARDED))
    unsharded = processes.start(th.command(MODEL, d['unsharded'], data_dir, *_flags(
        STEPS, **{'task.pipeline.num_micro_batches': 4})), environ=EXACT)
    d['second_stderr'] = th.finish([*second, unsharded, reference])
    return d


def _assert_same_checkpoint(actual: str, expected: str, step: int) -> None:
    got, want = th.checkpoint_state(actual, step), th.checkpoint_state(expected, step)
    assert got.keys() == want.keys()
    slots = [name for name in want if '/_slots/' in name]
    assert len(slots) == 2 * len([n for n in want if n.startswith('model/')])  # Adam: m, v
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6,
                                   err_msg=f'ckpt-{step} {name}')
    # The slots moved: the comparison is not between two zero tensors.
    assert any(np.abs(want[name]).max() > 0 for name in slots)


def _assert_same_losses(actual: str, expected: str, steps) -> None:
    got = th.losses_by_step(os.path.join(actual, 'train'))
    want = th.losses_by_step(os.path.join(expected, 'train'))
    assert sorted(got) == list(steps), got
    for step in steps:
        np.testing.assert_allclose(got[step], want[step], rtol=1e-5, err_msg=f'step {step}')


def test_sharded_clients_train_as_one_unsharded_process_with_whole_slots_saved(runs):
    _assert_same_losses(runs['chief'], runs['reference'], range(1, STEPS + 1))
    for step in (STEPS // 2, STEPS):
        _assert_same_checkpoint(runs['chief'], runs['reference'], step)
    assert os.listdir(runs['other']) == []  # the non-chief wrote nothing


def test_the_chiefs_checkpoint_resumes_in_one_unsharded_process(runs):
    _assert_same_losses(runs['unsharded'], runs['reference'], range(1, STEPS + 1))
    _assert_same_checkpoint(runs['unsharded'], runs['reference'], STEPS)


def test_each_client_holds_half_of_the_slots(runs):
    chief, other = runs['first_stderr'][:2]
    (held_0, whole_0), = SLOT_BYTES.findall(chief)
    (held_1, whole_1), = SLOT_BYTES.findall(other)
    assert whole_0 == whole_1
    whole = int(whole_0)
    assert int(held_0) + int(held_1) == whole  # the halves partition every slot
    # Each half is ceil(n/2) or floor(n/2) elements of each slot: within 4 bytes per slot.
    saved = th.checkpoint_state(runs['reference'], STEPS)
    num_slots = 2 * len([n for n in saved if n.startswith('model/')])
    for held in (int(held_0), int(held_1)):
        assert abs(held - whole / 2) <= 4 * num_slots / 2


def test_stage2_clients_train_as_one_unsharded_process(runs, tmp_path, data_dir, processes):
    """ZeRO stage 2 across the 2 clients (task.train.sharding='gradients'): each client's
    own gradient sums reduce-scattered by all_to_all_v2 across the processes, clipped by
    the norm summed over both parts: the reference's losses and checkpoint, one short run."""
    chief, other = str(tmp_path / 'chief'), str(tmp_path / 'other')
    th.finish(_start_clients(processes, [chief, other], data_dir,
                           *_flags(STEPS, **{'task.train.sharding': 'gradients'})))
    _assert_same_losses(chief, runs['reference'], range(1, STEPS + 1))
    _assert_same_checkpoint(chief, runs['reference'], STEPS)


def test_stage3_clients_train_and_resume_as_one_unsharded_process(runs, tmp_path, data_dir,
                                                                  processes):
    """ZeRO stage 3 across the 2 clients (task.train.sharding='weights'): each client holds
    half of every weight between steps, all-gathered across the processes once a step;
    the chief's checkpoint holds the whole weights (every client sends its halves at each
    save), and a restart restores it into the clients (the non-chief, with an empty
    logdir, takes its halves of the chief's weights): the reference's losses and
    checkpoints."""
    chief, other = str(tmp_path / 'chief'), str(tmp_path / 'other')
    stage3 = {'task.train.sharding': 'weights'}
    th.finish(_start_clients(processes, [chief, other], data_dir, *_flags(STEPS // 2, **stage3)))
    os.makedirs(other)
    th.finish(_start_clients(processes, [chief, other], data_dir, *_flags(STEPS, **stage3)))
    _assert_same_losses(chief, runs['reference'], range(1, STEPS + 1))
    for step in (STEPS // 2, STEPS):
        _assert_same_checkpoint(chief, runs['reference'], step)
    assert os.listdir(other) == []


# Bad stages, each in a cluster whose other members never start: refused before the
# cluster starts, so each process exits 2 at once instead of waiting for its peers.
BAD_STAGES = {
    'unknown': ('trainer', 2, 1, {'task.train.sharding': 'gradient'},
                "unknown task.train.sharding='gradient' (did you mean 'gradients'?)"),
    'one_client': ('trainer', 1, 0, {'task.train.sharding': 'gradients'},
                   "task.train.sharding='gradients' with 1 replica does nothing"),
    'workers': ('worker', 2, None, {'task.train.sharding': 'weights',
                                    'task.pipeline.num_replicas': 1},
                "task.train.sharding='weights' with 1 replica does nothing"),
    # Not a stage, refused at the same point for the same reason.
    'experts_clients': ('trainer', 2, 1, {'task.pipeline.expert_parallel': 3},
                        'task.pipeline: expert_parallel=3 does not divide num_replicas=2'),
}


def test_a_bad_stage_is_refused_before_the_cluster_starts(tmp_path, data_dir, processes):
    """Trainer clients (the non-chief too), a cluster of one client, and the single-client
    trainer over --job=worker servers: one error line, exit 2, within the 60 s the
    cluster would wait for its missing members, and nothing in any logdir."""
    procs = {}
    for name, (job, count, task, overrides, _) in BAD_STAGES.items():
        spec = f'{job}=' + ','.join(f'127.0.0.1:{free_port()}' for _ in range(count))
        flags = [*_flags(2, **overrides), f'--cluster_spec={spec}',
                 '--cluster_wait_seconds=60', *([] if task is None else [f'--task={task}'])]
        procs[name] = processes.start(th.command(MODEL, str(tmp_path / name), data_dir,
                                                 *flags))
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.startswith('error: ')]
        assert proc.returncode == 2 and len(lines) == 1, (name, err[-3000:])
        assert BAD_STAGES[name][-1] in lines[0], (name, lines[0])
        assert 'did not come up' not in err, name
    assert os.listdir(tmp_path) == []
