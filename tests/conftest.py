"""Test-session setup: 8 logical CPU devices, configured before TensorFlow starts.

Pipelined == unpartitioned must be shown on real multi-device placement, so every
test process splits the host CPU into 8 logical devices. This has to happen before
anything initialises the TensorFlow runtime, hence a conftest at import time.
"""
import pytest
import tensorflow as tf

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
