"""Expert parallelism across trainer clients (real processes on loopback).

Two clients of lm.pystdlib.TinyMoETransformerLM with task.pipeline.expert_parallel=2: the
clients are the expert group, each holds 4 of the 8 experts of its MoE layer and tokens
cross processes by all-to-all. They must train as one process with R=2 replicas at P=2
does: the loss (with its auxiliary losses) and the clipped global norm at every step, and
the chief's checkpoints (every expert whole under the layer's path, with its whole Adam
slots) within 1e-5. The clients shard their optimizer states (ZeRO stage 1: the expert
slots unsharded, each expert rank being held by one client; the others' over both). The
second half of the run is 4 clients that restore the chief's checkpoint (the non-chiefs,
given empty logdirs, must receive their experts' rows and slot parts from the chief): two
expert groups, each expert's gradient reduce-scattered over the 2 clients that hold it
(ZeRO stage 2: its slots sharded over those 2, the others' over all 4), against the
unsharded reference: resumed at another stage, as the uninterrupted run. Beside it, 4
clients at ZeRO stage 3 resume a copy of the same checkpoint: each cuts its part of every
weight from the chief's, an expert weight's over the 2 clients holding its experts, and
they reach the same step-4 state. oneDNN is off in every process; every process is
stopped by its PID in teardown.
"""
import os
import re
import shutil

import numpy as np
import pytest

from tests import trainer_helpers as th
from tests.test_clients import free_port

MODEL = 'lm.pystdlib.TinyMoETransformerLM'
STEPS = 4
EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}
EXPERTS = {'task.pipeline.expert_parallel': 2}
SLOT_BYTES = re.compile(r'optimizer slots: (\d+) bytes per replica in this process, (\d+) '
                        'unsharded')
WEIGHT_BYTES = re.compile(r'weights: (\d+) bytes per replica, (\d+) unsharded')


def _flags(steps: int, **overrides) -> list[str]:
    return [*th.fast_flags(steps, 2), th.overrides(**EXPERTS, **overrides)]


def _start_clients(processes: th.Processes, logdirs, data_dir: str, *flags: str) -> list:
    spec = 'trainer=' + ','.join(f'127.0.0.1:{free_port()}' for _ in logdirs)
    cpus = f'--num_logical_cpus={4 // len(logdirs) * 2}'  # 2 cells, on 2 devices or 1
    return [processes.start([*[cpus if a.startswith('--num_logical_cpus=') else a
                               for a in th.command(MODEL, logdir, data_dir, *flags)],
                             f'--task={task}', f'--cluster_spec={spec}'], environ=EXACT)
            for task, logdir in enumerate(logdirs)]


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir, processes):
    root = tmp_path_factory.mktemp('expert_clients')
    d = {name: str(root / name) for name in ('chief', 'reference')}
    others = [str(root / f'other{i}') for i in (1, 2, 3)]
    first = _start_clients(processes, [d['chief'], others[0]], data_dir, *_flags(
        STEPS // 2, **{'task.train.sharding': 'optimizer_states'}))
    reference = processes.start(th.command(MODEL, d['reference'], data_dir, *_flags(
        STEPS, **{'task.pipeline.num_replicas': 2})), environ=EXACT)
    d['first_stderr'] = th.finish(first, timeout=600)
    assert not os.path.exists(others[0])
    d['stage3'] = [str(root / f'stage3_{i}') for i in range(4)]
    shutil.copytree(d['chief'], d['stage3'][0])  # the step-2 checkpoint, resumed twice
    for other in [*others, *d['stage3'][1:]]:
        os.makedirs(other)  # empty: the non-chiefs have no access to the chief's logdir
    # Resumed by 4 clients: two expert groups, and the expert gradients summed over the
    # pairs of clients that hold the same experts. The checkpoint's 4 micro-batches are
    # kept (M=1 each), so the steps are the reference's.
    second = _start_clients(processes, [d['chief'], *others], data_dir, *_flags(
        STEPS, **{'task.train.sharding': 'gradients'}))
    stage3 = _start_clients(processes, d['stage3'], data_dir, *_flags(
        STEPS, **{'task.train.sharding': 'weights'}))
    stderr = th.finish([*second, *stage3, reference], timeout=600)
    d['second_stderr'], d['stage3_stderr'] = stderr[:4], stderr[4:8]
    d['others'] = others
    return d


def test_expert_clients_train_as_one_process_and_save_every_expert_whole(runs):
    got = th.losses_by_step(os.path.join(runs['chief'], 'train'))
    want = th.losses_by_step(os.path.join(runs['reference'], 'train'))
    assert sorted(got) == list(range(1, STEPS + 1)), got
    for step in got:
        np.testing.assert_allclose(got[step], want[step], rtol=1e-5, err_msg=f'step {step}')
    # The global norm counts each expert rank's squares once, as one process does (the
    # clients' own expert squares summed over their expert group): clipping scales alike.
    norms = [th.losses_by_step(os.path.join(runs[run], 'train'), 'grad_norm')
             for run in ('chief', 'reference')]
    np.testing.assert_allclose([norms[0][s] for s in got], [norms[1][s] for s in got],
                               rtol=1e-5)
    assert min(norms[1].values()) > 1.0  # above the LM's clip: clipping was active
    for step in (STEPS // 2, STEPS):
        _assert_checkpoint_equal(runs['chief'], runs['reference'], step)
    assert all(os.listdir(other) == [] for other in runs['others'])  # only the chief wrote


def _assert_checkpoint_equal(chief: str, reference: str, step: int) -> None:
    """The chief's checkpoint of `step` holds the reference's keys, every expert weight and
    slot whole (all 8 experts), and its values within 1e-5."""
    actual = th.checkpoint_state(chief, step)
    expected = th.checkpoint_state(reference, step)
    assert actual.keys() == expected.keys()
    experts = [n for n in expected if re.search(r'moe(\.S|-)[wb][io]/', n)]
    assert len(experts) == 12  # wi, wo, bi, bo and their m and v, with all 8 experts:
    assert all(actual[n].shape[0] == 8 for n in experts)
    for name in expected:
        if re.search(r'atten(\.S|-)key(\.S|-)b/', name):
            # A softmax ignores a bias added to every key: its gradient is rounding
            # noise, summed in another order by 4 clients, which Adam scales to steps
            # of lr. Zero in exact arithmetic; here small, not equal.
            assert np.abs(actual[name]).max() < 1e-4, name
            continue
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6,
                                   err_msg=f'ckpt-{step} {name}')


def test_expert_clients_at_stage_3_resume_and_train_as_one_process(runs):
    """4 clients at sharding='weights', P=2, resumed from the stage-1 step-2 checkpoint:
    losses of steps 3-4 and the chief's step-4 checkpoint equal the unsharded one-process
    reference's; each client holds under half the weights of an unsharded replica
    between steps (its E/P experts' over 2 clients, the rest over 4: 1/4 of all E's)."""
    got = th.losses_by_step(os.path.join(runs['stage3'][0], 'train'))
    want = th.losses_by_step(os.path.join(runs['reference'], 'train'))
    assert sorted(got)[-2:] == [3, 4], got
    np.testing.assert_allclose([got[s] for s in (3, 4)], [want[s] for s in (3, 4)],
                               rtol=1e-5)
    _assert_checkpoint_equal(runs['stage3'][0], runs['reference'], STEPS)
    assert all(os.listdir(other) == [] for other in runs['stage3'][1:])  # only the chief wrote
    sizes = [tuple(map(int, WEIGHT_BYTES.findall(err)[-1])) for err in runs['stage3_stderr']]
    assert all(mine < whole / 2 for mine, whole in sizes), sizes


def test_expert_clients_hold_part_of_the_optimizer_slots(runs):
    """Each client's log line: the slots it holds, below one unsharded replica's (its own
    experts' and all the others'), by the sharded non-expert slots at stage 1 (2 clients)
    and by the expert slots too at stage 2 (4 clients, 2 per expert rank)."""
    held = {}
    for half in ('first_stderr', 'second_stderr'):
        sizes = [tuple(map(int, SLOT_BYTES.findall(err)[-1])) for err in runs[half]]
        assert all(mine < whole for mine, whole in sizes), (half, sizes)
        assert len({whole for _, whole in sizes}) == 1, (half, sizes)
        held[half] = max(mine for mine, _ in sizes)
    assert held['second_stderr'] < held['first_stderr'], held


BAD = {  # overrides -> the error line's text; refused before the cluster starts
    'experts': ({'task.pipeline.body[3].num_experts': 3},
                'task.pipeline.body[3]: num_experts=3 is not divisible by expert_parallel=2'),
    'batch': ({'input.train.batch_size': 14},
              'a batch of 14 cuts into uneven micro-batches [4, 4, 3, 3]'),
}


def test_bad_expert_layouts_are_refused_before_the_cluster_starts(tmp_path, data_dir,
                                                                   processes):
    """Client 1 of 2 alone: one error line, exit 2, within the 60 s the cluster would wait
    for its missing member, and nothing in its logdir."""
    spec = f'--cluster_spec=trainer=127.0.0.1:{free_port()},127.0.0.1:{free_port()}'
    procs = {name: processes.start(
        [*th.command(MODEL, str(tmp_path / name), data_dir, *_flags(2, **overrides)),
         '--task=1', spec, '--cluster_wait_seconds=60'])
        for name, (overrides, _) in BAD.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.startswith('error: ')]
        assert proc.returncode == 2 and len(lines) == 1, (name, err[-3000:])
        assert BAD[name][1] in lines[0], (name, lines[0])
    assert os.listdir(tmp_path) == []
