"""Trainer clients read 1/R of each global batch, and a checkpoint resumes under another R.

One module fixture runs, with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0) so that R=1 and R=2
agree to float rounding: the one-process R=2 run of 4 steps (the reference); 2 clients
for 2 steps; then the 2-client checkpoint resumed to step 4 by one process with R=1 and
by 4 clients. Each must equal the reference within 1e-5 (loss at every step, final
weights and BatchNorm statistics), each trainer logs the bytes it reads per step, and 3
clients, which cannot share the checkpoint's 4 micro-batches, all exit 2 before writing.
Every process is stopped by its PID in teardown.
"""
import os
import re
import shutil

import numpy as np
import pytest

from tests import trainer_helpers as th
from tests.test_clients import MODEL, client_command, finish, spec_of
from tfpipe import checkpoints

STEPS = 4
EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}
GLOBAL_BATCH = 16  # SmallConvPipe's input.train.batch_size
EXAMPLE_BYTES = 16 * 16 * 3 * 4 + 4  # a float32 16x16x3 image and an int32 label


def _flags(steps: int, **overrides) -> list[str]:
    return [*th.fast_flags(steps, 2), th.overrides(**{'task.pipeline.schedule': 'fill_drain',
                                                      **overrides})]


def _clients(processes: th.Processes, logdirs: list[str], data_dir: str, steps: int):
    spec = spec_of(len(logdirs))
    return [processes.start(client_command(logdir, data_dir, spec, task, *_flags(steps)),
                            environ=EXACT)
            for task, logdir in enumerate(logdirs)]


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir, processes, clients_r2_exact):
    root = tmp_path_factory.mktemp('clients_input')
    d = {name: str(root / name) for name in ('r2', 'r1', 'r4')}
    d['reference'] = clients_r2_exact.logdir
    r2 = _clients(processes, [d['r2'], str(root / 'r2_other')], data_dir, STEPS // 2)
    stderr = {'r2': finish(r2)}
    for name in ('r1', 'r4'):
        shutil.copytree(d['r2'], d[name])
    r1 = processes.start(th.command(MODEL, d['r1'], data_dir, *_flags(STEPS)), environ=EXACT)
    r4 = _clients(processes, [d['r4']] + [str(root / f'r4_{t}') for t in (1, 2, 3)],
                  data_dir, STEPS)
    stderr['r4'] = finish(r4)
    stderr['r1'] = finish([r1])
    return d, stderr


def _input_bytes(stderr: str) -> tuple[int, int, int]:
    """(first example, last example, bytes per step) from the trainer's input line."""
    found = re.findall(r'reads examples (\d+)\.\.(\d+) of each global batch of 16: (\d+) bytes '
                       r'per step', stderr)
    assert len(found) == 1, stderr[-3000:]
    return tuple(int(v) for v in found[0])


def test_each_client_reads_its_share_of_the_global_batch(runs):
    _, stderr = runs
    assert _input_bytes(stderr['r1'][0]) == (0, 15, GLOBAL_BATCH * EXAMPLE_BYTES)
    # R=2: M=2 each, examples 0..7 and 8..15; R=4: M=1 each, 4 examples each.
    for count, errs in ((2, stderr['r2']), (4, stderr['r4'])):
        share = GLOBAL_BATCH // count
        assert [_input_bytes(err) for err in errs] == [
            (t * share, (t + 1) * share - 1, share * EXAMPLE_BYTES) for t in range(count)]


def _assert_equal_runs(actual: str, expected: str) -> None:
    train, want_train = os.path.join(actual, 'train'), os.path.join(expected, 'train')
    losses, want = th.losses_by_step(train), th.losses_by_step(want_train)
    assert sorted(losses) == sorted(want) == list(range(1, STEPS + 1)), (losses, want)
    for step in want:
        np.testing.assert_allclose(losses[step], want[step], rtol=1e-5,
                                   err_msg=f'loss at step {step}')
    values = th.model_values(checkpoints.latest(train))
    want_values = th.model_values(checkpoints.latest(want_train))
    assert values.keys() == want_values.keys()
    assert any('moving_mean' in name for name in values)
    for name in want_values:
        np.testing.assert_allclose(values[name], want_values[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize('resumed', ['r1', 'r4'])
def test_a_2_client_checkpoint_resumes_under_another_r_on_the_same_trajectory(runs, resumed):
    d, stderr = runs
    _assert_equal_runs(d[resumed], d['reference'])
    assert 'at step 2' in stderr[resumed][0]
    each = {'r1': 4, 'r4': 1}[resumed]
    assert (f'resuming a checkpoint of 2 replicas x 2 micro-batches with '
            f'{4 // each} replicas: each runs {each}') in stderr[resumed][0]


def test_the_2_clients_equal_the_one_process_r2_run(runs):
    d, _ = runs
    losses, want = (th.losses_by_step(os.path.join(d[n], 'train')) for n in ('r2', 'reference'))
    assert sorted(losses) == [1, 2]
    for step in losses:
        np.testing.assert_allclose(losses[step], want[step], rtol=1e-5)


def test_an_r_that_cannot_share_the_micro_batches_exits_2_in_every_client_before_writing(
        runs, data_dir, tmp_path, processes):
    """3 clients on the 2-client checkpoint (4 micro-batches per global batch): the chief
    refuses, and the others, told the checkpoint's split by the chief, refuse alike."""
    d, _ = runs
    chief = str(tmp_path / 'r3')
    shutil.copytree(d['r2'], chief)
    before = th.snapshot(chief)
    others = [str(tmp_path / f'r3_{t}') for t in (1, 2)]
    procs = _clients(processes, [chief] + others, data_dir, STEPS)
    errs = [err for _, err in (proc.communicate(timeout=300) for proc in procs)]
    codes = [proc.returncode for proc in procs]
    assert codes == [2, 2, 2], [err[-2000:] for err in errs]
    for err, checkpoint in zip(errs, [f'the checkpoint in {chief}/train', "the chief's "
                                      'checkpoint', "the chief's checkpoint"]):
        assert [line for line in err.splitlines() if line.startswith('error: ')] == [
            f'error: {checkpoint} was trained with 4 micro-batches per '
            'global batch (2 replicas x 2), which 3 replicas cannot share evenly: resume with '
            'R in 1, 2, 4 (trainer clients, or task.pipeline.num_replicas in one process), or '
            'use a new --logdir'], err[-3000:]
    assert th.snapshot(chief) == before
    assert not any(os.path.exists(other) for other in others)
