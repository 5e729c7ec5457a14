"""Measured peak memory per device, as TensorFlow's allocators count it.

`tf.config.experimental.get_memory_info` reports the bytes an allocator handed out
at its peak. GPUs always keep these statistics; on CPUs only the BFC allocator does
(`TF_CPU_ALLOCATOR_USE_BFC=true`, set before TensorFlow loads), and all logical
CPUs share that one allocator, so the figure of CPU:0 is the host's. Devices whose
allocator keeps none are left out, so a caller can print what exists.
"""
from __future__ import annotations

from typing import Iterable

import tensorflow as tf

BFC_VARIABLE = 'TF_CPU_ALLOCATOR_USE_BFC'


def allocator_devices(devices: Iterable[str]) -> list[str]:
    """One device per allocator among this process's `devices` ('CPU:0', 'GPU:1', ...):
    every logical CPU shares the host's allocator, which CPU:0 names. Another
    process's devices (a cluster worker's, another trainer client's) are left out:
    their statistics are theirs. A trainer client's own devices are named by its
    task ('/job:trainer/replica:0/task:1/device:CPU:0'), not 'localhost'."""
    from tensorflow.python.eager import context  # the only way to ask for this task's name
    own = tf.DeviceSpec.from_string(context.context().host_address_space())
    names = []
    for device in devices:
        spec = tf.DeviceSpec.from_string(device)
        if spec.device_type is None or spec.job not in (None, 'localhost') and (
                (spec.job, spec.replica or 0, spec.task or 0) !=
                (own.job, own.replica or 0, own.task or 0)):
            continue
        index = 0 if spec.device_type == 'CPU' else spec.device_index or 0
        name = f'{spec.device_type}:{index}'
        if name not in names:
            names.append(name)
    return names


def peak_bytes(devices: Iterable[str]) -> dict[str, int]:
    """{allocator device: peak bytes since the process started (or the last reset)} for
    the allocators of `devices` that keep statistics."""
    peaks = {}
    for name in allocator_devices(devices):
        try:
            peak = int(tf.config.experimental.get_memory_info(name)['peak'])
        except (ValueError, tf.errors.InvalidArgumentError):
            continue  # this allocator keeps no statistics
        if peak > 0:  # the default CPU allocator answers 0
            peaks[name] = peak
    return peaks


def format_peaks(peaks: dict[str, int]) -> str:
    """'peak CPU:0 312.4 MiB' (several devices comma-separated); '' without any."""
    if not peaks:
        return ''
    return 'peak ' + ', '.join(f'{name} {value / 2 ** 20:.1f} MiB'
                               for name, value in peaks.items())
