"""Measured peak memory per device, as TensorFlow's allocators count it.

`tf.config.experimental.get_memory_info` reports the bytes an allocator handed out
at its peak. GPUs always keep these statistics; on CPUs only the BFC allocator does
(`TF_CPU_ALLOCATOR_USE_BFC=true`, set before TensorFlow loads), and all logical
CPUs share that one allocator, so the figure of CPU:0 is the host's. Devices whose
allocator keeps none are left out, so a caller can print what exists.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import tensorflow as tf

BFC_VARIABLE = 'TF_CPU_ALLOCATOR_USE_BFC'
# Per allocator: the peak before a block `not_counted` took out of the statistics.
_floors: dict[str, int] = {}


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


def _peak(name: str) -> int | None:
    """The allocator's peak bytes, or None where it keeps no statistics."""
    try:
        peak = int(tf.config.experimental.get_memory_info(name)['peak'])
    except (ValueError, tf.errors.InvalidArgumentError):
        return None  # this allocator keeps no statistics
    return peak if peak > 0 else None  # the default CPU allocator answers 0


def peak_bytes(devices: Iterable[str]) -> dict[str, int]:
    """{allocator device: peak bytes since the process started (or the last reset), the
    blocks run `not_counted` left out} for the allocators of `devices` that keep
    statistics."""
    peaks = {}
    for name in allocator_devices(devices):
        peak = _peak(name)
        if peak is not None:
            peaks[name] = max(peak, _floors.get(name, 0))
    return peaks


@contextlib.contextmanager
def not_counted(device: str) -> Iterator[None]:
    """Runs a block whose allocations on `device`'s allocator are not the program's own
    (the trainer's matmul probe of the host's peak FLOP/s, 64 MiB on a CPU host): a model
    of 12 MiB otherwise reported that probe as its peak. The statistics are reset after
    the block, and the peak before it kept as a floor that `peak_bytes` reports."""
    spec = tf.DeviceSpec.from_string(device)
    name = f'{spec.device_type}:{0 if spec.device_type == "CPU" else spec.device_index or 0}'
    before = _peak(name)
    yield
    if before is not None:
        _floors[name] = max(_floors.get(name, 0), before)
        tf.config.experimental.reset_memory_stats(name)


def format_peaks(peaks: dict[str, int]) -> str:
    """'peak CPU:0 312.4 MiB' (several devices comma-separated); '' without any."""
    if not peaks:
        return ''
    return 'peak ' + ', '.join(f'{name} {value / 2 ** 20:.1f} MiB'
                               for name, value in peaks.items())
