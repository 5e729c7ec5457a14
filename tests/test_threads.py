"""Thread flags reach TensorFlow: read back from tf.config.threading in a process whose
runtime starts after them (tests/thread_probe.py)."""
import sys

import pytest

from tests import trainer_helpers


def _run(mode, *args, extra_env=None):
    """tests/thread_probe.py's (intra-op threads, inter-op threads, logical CPUs), forked
    before TensorFlow's runtime starts (trainer_helpers.run_command)."""
    out = trainer_helpers.run_command([sys.executable, '-m', 'tests.thread_probe', mode, *args],
                                      extra_env)
    assert out.returncode == 0, out.stderr[-3000:]
    return [int(v) for v in out.stdout.split()[-3:]]


def _probe(*flags, extra_env=None):
    return _run('trainer', '--run_locally=cpu', '--num_logical_cpus=3', *flags,
                extra_env=extra_env)


def test_thread_flags_reach_tensorflow():
    assert _probe('--intra_op_threads=3', '--inter_op_threads=5') == [3, 5, 3]


def test_the_default_is_tfpipes_and_the_environment_wins():
    from tfpipe import devices
    assert _probe() == [*devices.default_threads(3), 3]
    # TF_NUM_*_THREADS are read by TensorFlow itself: tfpipe leaves the config unset.
    assert _probe(extra_env={'TF_NUM_INTRAOP_THREADS': '1', 'TF_NUM_INTEROP_THREADS': '1'}
                  )[:2] == [0, 0]
    assert _probe('--intra_op_threads=2', extra_env={'TF_NUM_INTRAOP_THREADS': '1'})[0] == 2


def test_zero_flags_restore_tensorflows_own_default():
    """tfpipe's default on logical CPUs is not TensorFlow's; 0 gives TensorFlow's back."""
    from tfpipe import devices
    assert 0 not in devices.default_threads(3)
    assert _probe('--intra_op_threads=0', '--inter_op_threads=0') == [0, 0, 3]
    assert _probe('--inter_op_threads=0') == [devices.default_threads(3)[0], 0, 3]


def test_the_library_takes_the_same_default_on_logical_cpus():
    from tfpipe import devices
    assert _run('library') == [*devices.default_threads(3), 3]
    assert _run('library', '0', 'None') == [0, devices.default_threads(3)[1], 3]
    assert _run('library', '--inter_set_before', '5') == [
        devices.default_threads(3)[0], 5, 3]


def test_gpus_keep_tensorflows_default():
    assert _run('trainer', '--fake_gpu', '--run_locally=gpu',
                '--inter_op_threads=3')[:2] == [0, 3]


def test_default_threads_share_the_cores_among_logical_cpus(monkeypatch):
    import os
    from tfpipe import devices
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(range(32)))
    assert devices.default_threads(8) == (4, 32)
    assert devices.default_threads(64) == (1, 32)
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0})
    assert devices.default_threads(8) == (1, 2)


def test_bad_thread_counts_name_the_fix():
    from tfpipe import devices
    with pytest.raises(ValueError, match='intra_op_threads=-1 must be an int >= 0'):
        devices.configure_threads(-1, 0)


def test_cluster_workers_size_their_pools_like_the_trainer(monkeypatch):
    import os
    from tfpipe import cluster
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(range(32)))
    for env in ('TF_NUM_INTRAOP_THREADS', 'TF_NUM_INTEROP_THREADS'):
        monkeypatch.delenv(env, raising=False)

    def pools(*args):
        config = cluster.server_config(*args)
        return config.intra_op_parallelism_threads, config.inter_op_parallelism_threads

    assert pools(8) == (4, 32)  # a worker's 8 logical CPUs share its 32 cores
    assert pools(8, 3, 5) == (3, 5)  # the worker's own --intra/--inter_op_threads win
    assert pools(8, 0, 0) == (0, 0)  # 0: TensorFlow's default
    assert pools(None) == (0, 0)  # GPUs keep TensorFlow's default
    monkeypatch.setenv('TF_NUM_INTRAOP_THREADS', '6')
    assert pools(8) == (0, 32)  # TensorFlow reads the environment itself
    with pytest.raises(ValueError, match='inter_op_parallelism_threads=-2 must be an int >= 0'):
        cluster.server_config(8, None, -2)
