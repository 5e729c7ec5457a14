"""Test-session setup: 8 logical CPU devices, configured before TensorFlow starts.

Pipelined == unpartitioned must be shown on real multi-device placement, so every
test process splits the host CPU into 8 logical devices. This has to happen before
anything initialises the TensorFlow runtime, hence a conftest at import time.
"""
import os

import pytest

# The kernels the trainer runs with (trainer/main.py `run`), so that this process and
# the trainer processes it starts compute alike on every CPU.
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '1')
import tensorflow as tf  # noqa: E402  (after the variable: TensorFlow reads it once)

NUM_LOGICAL_CPUS = 8

_cpus = tf.config.list_physical_devices('CPU')
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    """tfpipe's generated datasets, built once per test session (a few seconds)."""
    from tfpipe import datasets
    path = str(tmp_path_factory.mktemp('tfds'))
    datasets.prepare('tfpipe_shapes', path)
    datasets.prepare('tfpipe_reverse', path)
    return path


# Trainer runs that several test modules start from, each run once per session
# (a trainer process costs ~10 s on 2 cores). Tests copy them before writing.

@pytest.fixture(scope='session')
def trained_2_steps(tmp_path_factory, data_dir):
    """SmallConvPipe trained 2 steps, checkpoint at step 2."""
    from tests import trainer_helpers as th
    return th.train_once(tmp_path_factory.mktemp('trained_2_steps'), data_dir,
                         *th.fast_flags(2, 2))


@pytest.fixture(scope='session')
def trained_4_steps(tmp_path_factory, data_dir):
    """SmallConvPipe trained 4 steps, checkpoints at steps 2 and 4, loss logged each step."""
    from tests import trainer_helpers as th
    return th.train_once(tmp_path_factory.mktemp('trained_4_steps'), data_dir,
                         *th.fast_flags(4, 2))


@pytest.fixture(scope='session')
def trained_4_steps_two_replicas(tmp_path_factory, data_dir):
    """As trained_4_steps with R=2 replicas x K=2 cells (M=2 each) on 4 logical CPUs."""
    from tests import trainer_helpers as th
    return th.train_once(tmp_path_factory.mktemp('trained_4_steps_r2'), data_dir,
                         *th.fast_flags(4, 2),
                         th.overrides(**{'task.pipeline.num_replicas': 2}))
