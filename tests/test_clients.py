"""Trainer clients on loopback: one process per replica must take the one-process step.

2 clients x K=2 (2 logical CPUs each) must equal the single-client num_replicas=2 run
and one pipeline with 2M micro-batches: loss at every step, final weights and BatchNorm
moving statistics. The fill_drain client run is done in two halves, so it also shows
that a non-chief client, given an empty logdir of its own, receives the chief's restored
state (else its weights, Adam slots and input position restart from zero). Every process
is stopped by its PID in teardown.
"""
import os
import re
import signal
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


def client_command(logdir: str, data_dir: str, spec: str, task: int, *flags: str,
                   model: str = MODEL) -> list[str]:
    cmd = th.command(model, logdir, data_dir, *flags, f'--task={task}',
                     f'--cluster_spec={spec}')
    return [f'--num_logical_cpus={CLIENT_CPUS}' if a.startswith('--num_logical_cpus=') else a
            for a in cmd]


def spec_of(count: int) -> str:
    return 'trainer=' + ','.join(f'127.0.0.1:{free_port()}' for _ in range(count))


def start_clients(processes: th.Processes, logdirs, data_dir: str, *flags: str,
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


def test_an_evaler_runs_unchanged_on_the_chiefs_logdir(runs, data_dir):
    chief = runs['fill_drain']['chief']
    result = th.run(MODEL, chief, data_dir, '--job=evaler_dev', f'--max_steps={STEPS}',
                    th.overrides(**{'task.pipeline.schedule': 'fill_drain',
                                    'task.eval.samples_per_summary': 32}))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(chief, 'eval_dev', f'score-{STEPS}.txt')) as f:
        scores = dict(line.split(': ') for line in f.read().splitlines())
    assert scores['num_examples'] == '32' and np.isfinite(float(scores['loss']))


def test_a_clients_progress_reports_its_hosts_peak_memory(runs):
    """A client's devices are named /job:trainer/replica:0/task:i, not localhost: its
    progress lines and summaries still carry the allocator's peak (docs/memory.md)."""
    import glob
    import tensorflow as tf
    peaks = [float(tf.make_ndarray(value.tensor))
             for path in glob.glob(os.path.join(_train(runs['fill_drain']['chief']),
                                                'events.out.tfevents.*'))
             for event in tf.compat.v1.train.summary_iterator(path)
             for value in event.summary.value if value.tag == 'peak_bytes/CPU:0']
    assert peaks and min(peaks) > 0, peaks


# -- Bad input: exit 2 with one line, before anything is written ---------------------------

@pytest.mark.parametrize('spec, job, task, environ, message', [
    ('trainer=127.0.0.1:1,127.0.0.1:1', 'trainer', 0, {}, 'address 127.0.0.1:1 is listed twice'),
    ('trainer=127.0.0.1:1,127.0.0.1:2', 'trainer', 2, {}, 'task index 2 is out of range'),
    ('trainer=127.0.0.1:1,127.0.0.1:2', 'trainer', None, {}, 'needs its index: pass --task'),
    ('trainer=127.0.0.1', 'trainer', 0, {}, "bad address '127.0.0.1'"),
    ('trainer=127.0.0.1:1@worker=127.0.0.1:2', 'trainer', 0, {}, "cannot also list ['worker']"),
    ('trainer=127.0.0.1:1', 'evaler_dev', 0, {}, 'each client runs the trainer job only'),
    (None, None, None, {'TF_CONFIG': '{"cluster": {"trainer": ["127.0.0.1:1"]}, '
                                     '"task": {"type": "worker", "index": 0}}'},
     '"task" must be {"type": "trainer"'),
    (None, None, None, {'TF_CONFIG': '{"cluster": {"trainer": ["127.0.0.1:1"]}, '
                                     '"task": {"type": "trainer", "index": 1}}'},
     'task index 1 is out of range'),
])
def test_bad_client_clusters_are_refused(spec, job, task, environ, message):
    from tfpipe import clients
    with pytest.raises(clients.ClusterError, match=re.escape(message)):
        clients.from_flags(spec, job, task, environ)


def test_a_worker_cluster_is_not_a_client_cluster():
    from tfpipe import clients
    assert clients.from_flags('worker=127.0.0.1:1', None, None, {}) is None
    config = '{"cluster": {"trainer": ["h:1", "h:2"]}, "task": {"type": "trainer", "index": 1}}'
    got = clients.from_flags(None, None, None, {'TF_CONFIG': config})
    assert (got.addresses, got.task_index, got.peers.is_chief) == (('h:1', 'h:2'), 1, False)


def _run_client(logdir, data_dir, spec, task, *extra, timeout=120):
    return th.run_command(client_command(logdir, data_dir, spec, task, *th.fast_flags(2, 2),
                                         *extra), timeout=timeout)


def test_port_in_use_and_wrong_replicas_exit_2_and_a_missing_client_exits_1(
        tmp_path, data_dir):
    logdir = str(tmp_path / 'run')
    with socket.socket() as held:
        held.bind(('127.0.0.1', 0))
        held.listen()
        port = held.getsockname()[1]
        result = _run_client(logdir, data_dir, f'trainer=127.0.0.1:{port},127.0.0.1:'
                             f'{free_port()}', 0)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f'port {port} of 127.0.0.1:{port} is in use' in th.error_line(result)

    result = _run_client(logdir, data_dir, spec_of(2), 0,
                         th.overrides(**{'task.pipeline.num_replicas': 3}))
    assert result.returncode == 2, result.stderr[-3000:]
    assert 'num_replicas=3 but the cluster has 2 trainer client(s)' in th.error_line(result)

    spec = spec_of(2)
    missing = spec.split(',')[1]
    result = _run_client(logdir, data_dir, spec, 0, '--cluster_wait_seconds=2')
    assert result.returncode == 1, result.stderr[-3000:]
    assert th.error_line(result).startswith(
        f'error: trainer task 1 ({missing}) did not come up within 2 s')
    assert not os.path.exists(logdir)


# -- Faults mid-run: SIGTERM agrees on a step; a frozen or killed client ends the others ---

def _logged_stop_step(stderr: str) -> int:
    found = re.findall(r'saving a checkpoint at step (\d+) and stopping', stderr)
    assert len(found) == 1, stderr[-3000:]
    return int(found[0])


def _saved(logdir: str) -> int:
    return checkpoints.step_of(checkpoints.latest(_train(logdir)))


def _ends_naming(proc, lost: str, since: float) -> None:
    """`proc` exits 1 within 60 s of `since` with the error naming the lost client."""
    _, err = proc.communicate(timeout=90)
    assert time.time() - since < 60, err[-3000:]
    assert proc.returncode == 1, err[-3000:]
    assert f'error: lost {lost}' in err, err[-3000:]


def test_sigterm_stops_all_at_one_step_and_a_frozen_or_killed_client_ends_the_others(
        tmp_path, data_dir, processes):
    chief, other = str(tmp_path / 'chief'), str(tmp_path / 'other')
    forever = th.fast_flags(100000, 2)
    procs = start_clients(processes, [chief, other], data_dir, *forever)
    th.wait_for_checkpoint(procs[0], _train(chief), 2)
    procs[1].send_signal(signal.SIGTERM)
    errs = finish(procs, timeout=120)
    step = _logged_stop_step(errs[0])
    assert _logged_stop_step(errs[1]) == step
    assert checkpoints.step_of(checkpoints.latest(_train(chief))) == step

    spec = spec_of(2)
    procs = start_clients(processes, [chief, other], data_dir, *forever, spec=spec)
    th.wait_for_checkpoint(procs[0], _train(chief), _saved(chief) + 2)
    procs[1].send_signal(signal.SIGSTOP)  # frozen: its kernel still accepts connections
    _ends_naming(procs[0], f'trainer task 1 ({spec.split(",")[1]})', time.time())
    procs[1].kill()
    procs[1].wait()

    spec = spec_of(2)
    procs = start_clients(processes, [chief, other], data_dir, *forever, spec=spec)
    th.wait_for_checkpoint(procs[0], _train(chief), _saved(chief) + 2)  # both are training
    procs[0].kill()
    _ends_naming(procs[1], f'trainer task 0 ({spec[len("trainer="):].split(",")[0]})',
                 time.time())
    last = checkpoints.latest(_train(chief))
    th.model_values(last)  # loadable: no partial checkpoint is listed

    final = checkpoints.step_of(last) + 2
    reference = str(tmp_path / 'reference')
    started = start_clients(processes, [chief, other], data_dir, *th.fast_flags(final, 2))
    started.append(processes.start(th.command(MODEL, reference, data_dir, *th.fast_flags(
        final, 2), th.overrides(**{'task.pipeline.num_replicas': 2}))))
    errs = finish(started)
    assert f'at step {checkpoints.step_of(last)}' in errs[0]
    losses, want = th.losses_by_step(_train(chief)), th.losses_by_step(_train(reference))
    assert sorted(losses) == sorted(want) == list(range(1, final + 1)), (losses, want)
    for at in want:
        np.testing.assert_allclose(losses[at], want[at], rtol=1e-5, err_msg=f'loss at {at}')


def test_a_client_replica_holds_one_replica_and_only_trains():
    from tests import model_zoo as mz
    from tfpipe.pipeline.across_clients import Peers
    with pytest.raises(ValueError, match='num_replicas=2 in a client of 2: each trainer client '
                                         'holds one replica'):
        mz.pipeline(mz.mlp_body(), 2, 2, num_replicas=2).JoinClients(Peers(2, 0))
    pipe = mz.pipeline(mz.mlp_body(), 2, 2)
    pipe.JoinClients(Peers(2, 1))
    x, _ = mz.inputs_for(mz.mlp_body())
    with pytest.raises(ValueError, match='a trainer client trains with ForwardBackward only'):
        pipe.FProp(pipe.theta, x)


def test_sigterm_ends_clients_blocked_by_a_stuck_peer_within_their_grace(
        tmp_path, data_dir, processes):
    """Client 1's input hangs after 4 steps' examples while it still answers its peer, so
    client 0 waits in step 5's collectives: no watchdog names a peer, and both used to
    ignore SIGTERM until the step deadline (600 s this early). Now each leaves with one
    line, exit 1, keeping the chief's last checkpoint."""
    from tests import clients_model
    chief, other = str(tmp_path / 'chief'), str(tmp_path / 'other')
    never_written = str(tmp_path / 'never_written')
    os.mkfifo(never_written)
    spec = spec_of(2)
    model = 'tests.clients_model.SmallConvNoisePipe'
    procs = [processes.start(
        client_command(logdir, data_dir, spec, task, *th.fast_flags(100000, 2), model=model),
        {clients_model.STUCK_INPUT: f'{4 * 16}:{never_written}'} if task == 1 else {})
        for task, logdir in enumerate([chief, other])]
    th.wait_for_checkpoint(procs[0], _train(chief), 4)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for task, proc in enumerate(procs):
        _, err = proc.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.startswith('error: ')]
        assert proc.returncode == 1 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith(f'error: SIGTERM: trainer client {task} has been blocked '
                                   'for'), lines[0]
        assert 'after step 4, in its input or in collectives' in lines[0], lines[0]
    assert _saved(chief) == 4
    th.model_values(checkpoints.latest(_train(chief)))  # loadable: nothing partial is listed
