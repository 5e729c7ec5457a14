"""tfpipe.cluster and the cluster half of tfpipe.devices, in this process (no servers)."""
import json
import socket
import time

import pytest

from tfpipe import cluster, devices

SPEC = 'worker=127.0.0.1:2222,127.0.0.1:2223'


def test_parse_spec_with_and_without_chief():
    assert cluster.parse_spec(SPEC) == {'worker': ('127.0.0.1:2222', '127.0.0.1:2223')}
    jobs = cluster.parse_spec('worker=h1:1, h2:2@chief=h0:3')
    assert jobs == {'worker': ('h1:1', 'h2:2'), 'chief': ('h0:3',)}
    c = cluster.Cluster(jobs)
    assert c.client_job == 'chief' and cluster.Cluster({'worker': ('h:1',)}).client_job == 'localhost'
    assert c.describe(1) == 'worker task 1 (h2:2)'


@pytest.mark.parametrize('text, message', [
    ('127.0.0.1:2222', r'is not JOB=HOST:PORT'),
    ('worker=', r"job 'worker' lists no address"),
    ('worker=127.0.0.1', r"bad address '127.0.0.1': write HOST:PORT"),
    ('worker=127.0.0.1:99999', r'port in 1..65535'),
    ('worker=:2222', r"bad address ':2222'"),
    ('worker=h:1,h:1', r'address h:1 is listed twice'),
    ('worker=h:1@chief=h:1', r'address h:1 is listed twice'),
    ('worker=h:1@worker=h:2', r"job 'worker' is given twice"),
    ('ps=h:1', r"unknown job 'ps'.*--cluster_spec=worker=HOST:PORT"),
    ('chief=h:1', r"no 'worker' job"),
    ('worker=h:1@chief=h:2,h:3', r'one trainer'),
])
def test_malformed_spec_names_the_fix(text, message):
    with pytest.raises(cluster.ClusterError, match=message):
        cluster.parse_spec(text)


def _tf_config(task_type='worker', index=0, **extra):
    return json.dumps({'cluster': {'worker': ['127.0.0.1:1', '127.0.0.1:2'], **extra},
                       'task': {'type': task_type, 'index': index}})


def test_tf_config_is_read_for_a_worker_server_only():
    c = cluster.from_tf_config(_tf_config('worker', 1))
    assert (c.task_type, c.task_index, c.workers) == ('worker', 1, ('127.0.0.1:1', '127.0.0.1:2'))
    c = cluster.from_flags(None, 'worker', None, {'TF_CONFIG': _tf_config('worker', 1)})
    assert (c.task_type, c.task_index) == ('worker', 1)
    # Without --job=worker, TF_CONFIG makes trainer clients (tfpipe/clients.py), not this
    # single-client trainer, which takes --cluster_spec=worker=... explicitly.
    for job in (None, 'trainer'):
        for task_type in ('chief', 'worker'):
            environ = {'TF_CONFIG': _tf_config(task_type, 0, chief=['127.0.0.1:3'])}
            assert cluster.from_flags(None, job, None, environ) is None


@pytest.mark.parametrize('text, message', [
    ('{"cluster": ', r'TF_CONFIG is not valid JSON.*"cluster"'),
    ('[]', r'no "cluster" object'),
    ('{"cluster": {"worker": "h:1"}, "task": {"type": "worker"}}', r'must list addresses'),
    ('{"cluster": {"worker": []}, "task": {"type": "worker"}}', r'lists no address'),
    ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "ps", "index": 0}}',
     r'"task" must be \{"type": "worker" or "chief"'),
    (_tf_config('worker', 2), r'task index 2 is out of range.*use 0..1'),
    (_tf_config('worker', '1'), r"task index '1' must be an int"),
])
def test_malformed_tf_config_names_the_fix(text, message):
    with pytest.raises(cluster.ClusterError, match=message):
        cluster.from_tf_config(text)


def test_flags_choose_the_task_and_refuse_contradictions():
    c = cluster.from_flags(SPEC, 'worker', 1, {})
    assert (c.task_type, c.task_index) == ('worker', 1)
    assert cluster.from_flags(SPEC, 'trainer', None, {}).task_type is None
    assert cluster.from_flags(None, 'trainer', None, {}) is None
    # --cluster_spec wins over TF_CONFIG.
    assert cluster.from_flags(SPEC, None, None, {'TF_CONFIG': '{'}).task_type is None
    for args, message in [
            ((SPEC, 'worker', 2), r'--task=2: task index 2 is out of range'),
            ((SPEC, 'worker', -1), r'out of range'),
            ((SPEC, 'worker', None), r'--job=worker needs --task=N'),
            ((SPEC, 'trainer', 0), r'--task=0 is only for --job=worker'),
            ((None, 'worker', 0), r'--job=worker needs the cluster')]:
        with pytest.raises(cluster.ClusterError, match=message):
            cluster.from_flags(*args, {})
    with pytest.raises(cluster.ClusterError, match=r'set "type": "worker"'):
        cluster.from_flags(None, 'worker', None, {'TF_CONFIG': _tf_config('chief')})


def test_port_in_use_is_refused_and_a_free_port_accepted():
    with socket.socket() as held:
        held.bind(('127.0.0.1', 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(cluster.ClusterError, match=rf'port {port} .* is in use.*another port'):
            cluster.check_port_free(f'127.0.0.1:{port}', 'worker task 0')
        assert cluster.accepts_connections(f'127.0.0.1:{port}')
    cluster.check_port_free(f'127.0.0.1:{port}', 'worker task 0')
    assert not cluster.accepts_connections(f'127.0.0.1:{port}', timeout=0.5)


def test_wait_for_workers_names_the_missing_task():
    with socket.socket() as up, socket.socket() as down:
        up.bind(('127.0.0.1', 0))
        up.listen()
        down.bind(('127.0.0.1', 0))  # bound, not listening: refuses connections
        addresses = (f'127.0.0.1:{up.getsockname()[1]}', f'127.0.0.1:{down.getsockname()[1]}')
        c = cluster.Cluster({'worker': addresses})
        assert cluster.unreachable_workers(c, timeout=0.5) == [1]
        # A worker that misses one probe (a loaded host) is not lost; one that misses two is.
        missed = []

        def misses_once(address, timeout):
            missed.append(address)
            return address == addresses[0] and missed.count(address) > 1
        assert cluster.unreachable_workers(c, 0.5, misses_once) == [1]
        with pytest.raises(cluster.WorkerUnavailableError,
                           match=rf'worker task 1 \({addresses[1]}\) did not accept connections '
                                 r'within 0.3 s: start it \(.*--task=1'):
            cluster.wait_for_workers(c, 0.3)
        cluster.wait_for_workers(cluster.Cluster({'worker': addresses[:1]}), 0.3)


def _names(task_devices):
    return [[f't{t}d{i}' for i in range(n)] for t, n in enumerate(task_devices)]


@pytest.mark.parametrize('per_task, slots, expected', [
    ([2, 2], 2, ['t0d0', 't1d0']),                   # K=2 on 2 workers uses both
    ([2, 2], 4, ['t0d0', 't0d1', 't1d0', 't1d1']),   # R=2 x K=2: one replica per worker
    ([4, 4], 4, ['t0d0', 't0d1', 't1d0', 't1d1']),
    ([2, 2, 2], 4, ['t0d0', 't0d1', 't1d0', 't2d0']),
    ([2, 2, 2], 2, ['t0d0', 't1d0']),                # fewer slots than tasks
    ([3], 3, ['t0d0', 't0d1', 't0d2']),
])
def test_spread_over_tasks_first(per_task, slots, expected):
    assert devices.spread(_names(per_task), slots) == expected


def test_spread_errors_name_the_fix():
    with pytest.raises(ValueError, match=r'needs 5 devices but the cluster has 4 \(task 0: 2, '
                                         r'task 1: 2\).*--num_logical_cpus'):
        devices.spread(_names([2, 2]), 5)
    with pytest.raises(ValueError, match=r'puts 2 devices on task 1 but it has 1: give that '
                                         'worker at least 2'):
        devices.spread(_names([3, 1]), 4)


def test_remote_device_without_a_cluster_is_refused():
    assert devices.remote_devices_by_task() == {}  # this test process is not connected
    with pytest.raises(ValueError, match=r"on job 'worker' but this process is not connected "
                                         r'to a cluster: pass the trainer --cluster_spec'):
        devices.resolve(['/job:worker/replica:0/task:0/device:CPU:0'], 1)
    assert devices.local_cpu() == '/job:localhost/replica:0/task:0/device:CPU:0'


def test_lost_worker_error_names_the_task():
    import tensorflow as tf
    with socket.socket() as up0, socket.socket() as up1, socket.socket() as down:
        for s in (up0, up1):
            s.bind(('127.0.0.1', 0))
            s.listen()
        down.bind(('127.0.0.1', 0))
        address = [f'127.0.0.1:{s.getsockname()[1]}' for s in (up0, up1, down)]
        unavailable = tf.errors.UnavailableError(
            None, None, 'Graph execution error:\nfrom remote target '
            '/job:worker/replica:0/task:1/device:CPU:0 while calling RunComponentFunction')
        fix = ('training stopped without saving; restart the worker and rerun the trainer, '
               'which resumes from the last checkpoint')
        # A worker that no longer accepts connections is named, whatever the message says.
        c = cluster.Cluster({'worker': (address[0], address[2])})
        assert str(cluster.lost_worker_error(c, unavailable)) == \
            f'lost worker task 1 ({address[2]}): {fix}'
        # All accept connections again: TensorFlow's message names the task, or nothing does.
        c = cluster.Cluster({'worker': tuple(address[:2])})
        assert str(cluster.lost_worker_error(c, unavailable)) == \
            f'lost worker task 1 ({address[1]}): {fix}'
        reset = tf.errors.UnavailableError(None, None, 'recvmsg:Connection reset by peer')
        assert str(cluster.lost_worker_error(c, reset)) == \
            f'lost a worker (UnavailableError: recvmsg:Connection reset by peer): {fix}'
        # Other failures are not a lost worker.
        assert cluster.lost_worker_error(c, tf.errors.InternalError(None, None, 'x')) is None
        assert cluster.lost_worker_error(c, ValueError('x')) is None


def test_the_default_step_deadline_follows_the_measured_steps(tmp_path, data_dir):
    from tests import trainer_helpers
    from trainer import experiment, runtime_options, train_job
    params = experiment.load_params(trainer_helpers.FAST)
    params.input.train.data_dir = data_dir
    trainer = train_job.Trainer(params, str(tmp_path / 'a'),
                                runtime_options.RuntimeOptions(max_steps=3))
    assert trainer.step_timeout() == train_job.UNMEASURED_STEP_TIMEOUT  # nothing measured
    trainer.run()
    assert len(trainer._step_seconds) == 2  # the steps after the first (which traces)
    trainer._step_seconds.clear()
    trainer._step_seconds.extend([0.01] * 10)
    assert trainer.step_timeout() == train_job.MIN_STEP_TIMEOUT  # 20 x 10 ms is too short
    trainer._step_seconds.extend([5.0] * 30)
    assert trainer.step_timeout() == 20 * 5.0
    explicit = train_job.Trainer(params, str(tmp_path / 'b'),
                                 runtime_options.RuntimeOptions(step_timeout_seconds=30))
    explicit._step_seconds.extend([5.0] * 10)
    assert explicit.step_timeout() == 30  # a gin value wins
    # The watchdog asks for the current deadline at each look.
    c = cluster.Cluster({'worker': ('127.0.0.1:1',)})
    beat = (3, time.monotonic() - 90)
    assert cluster.Watchdog(c, heartbeat=lambda: beat,
                            step_timeout=trainer.step_timeout)._stalled_step() is None
    trainer._step_seconds.extend([0.01] * 40)
    assert 'step 4 has not finished 60 s after step 3' in cluster.Watchdog(
        c, heartbeat=lambda: beat, step_timeout=trainer.step_timeout)._stalled_step()


def test_step_deadline_is_armed_by_the_first_step_and_names_the_workers():
    import time
    c = cluster.Cluster({'worker': ('127.0.0.1:1', '127.0.0.1:2')})
    beat = [None]
    watchdog = cluster.Watchdog(c, heartbeat=lambda: beat[0], step_timeout=30)
    assert watchdog._stalled_step() is None  # the first step (tracing) has no deadline
    beat[0] = (7, time.monotonic() - 29)
    assert watchdog._stalled_step() is None
    beat[0] = (7, time.monotonic() - 31)
    assert watchdog._stalled_step() == (
        'step 8 has not finished 30 s after step 7, though every worker accepts connections: '
        'one may be frozen (stopped, swapping or a hung device) among task 0 (127.0.0.1:1), '
        'task 1 (127.0.0.1:2); restart the workers and this trainer (it resumes from the last '
        'checkpoint), or raise trainer.step_timeout_seconds if a step really takes this long')
