"""Which devices the pipeline's cells run on, and checking the user's choice.

TensorFlow silently places ops for an unknown device such as `/CPU:9` on CPU:0 in
eager mode, so a typo would quietly put the whole pipeline on one device. Every
device name is therefore validated against the logical devices of this process
(remote `/job:...` devices of a cluster are taken as given: they are checked by
the distributed runtime when the graph runs).
"""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf


def configure_logical_cpus(count: int) -> None:
    """Splits the host CPU into `count` logical devices.

    Must run before TensorFlow initialises its runtime (before the first op,
    variable or device listing); afterwards it fails with a message saying so.
    """
    cpus = tf.config.list_physical_devices('CPU')
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError as e:
        have = len(tf.config.list_logical_devices('CPU'))
        if have >= count:
            return
        raise RuntimeError(
            f'cannot configure {count} logical CPUs: TensorFlow is already '
            f'initialised with {have}; call tfpipe.configure_logical_cpus({count}) '
            'at the start of the program, before any TensorFlow op') from e


def _canonical(name: str) -> tf.DeviceSpec:
    spec = tf.DeviceSpec.from_string(name)
    if spec.device_type is None:
        raise ValueError(f"device {name!r} names no device type: write e.g. '/CPU:1' or '/GPU:0'")
    spec = spec.replace(device_type=spec.device_type.upper(),
                        device_index=spec.device_index or 0)
    if spec.job in (None, 'localhost'):
        spec = spec.replace(job='localhost', replica=spec.replica or 0, task=spec.task or 0)
    return spec


def _is_remote(spec: tf.DeviceSpec) -> bool:
    return spec.job not in (None, 'localhost')


def resolve(devices: Optional[Sequence[str]], num_cells: int) -> list[str]:
    """Returns one canonical device name per cell.

    `devices=None` picks the first `num_cells` GPUs if the process has any GPU,
    else logical CPUs. Errors name the fix: too few devices, more devices than
    slots (never cut silently), unknown device, a device listed twice.
    """
    if devices is None:
        gpus = tf.config.list_logical_devices('GPU')
        if gpus and len(gpus) < num_cells:
            raise ValueError(
                f'the pipeline has {num_cells} cells but this process has {len(gpus)} GPU(s): '
                'use at most that many cells, or list the devices explicitly (devices=[...]; '
                'the trainer: --run_locally=cpu for logical CPUs)')
        pool = gpus or tf.config.list_logical_devices('CPU')
        if len(pool) < num_cells:
            raise ValueError(
                f'the pipeline has {num_cells} cells but this process has only {len(pool)} '
                f'logical CPU device(s): use fewer cells, or call '
                f'tfpipe.configure_logical_cpus({num_cells}) before TensorFlow starts (the '
                f'trainer: --num_logical_cpus={num_cells})')
        return [_canonical(d.name).to_string() for d in pool[:num_cells]]
    devices = list(devices)
    if len(devices) < num_cells:
        raise ValueError(
            f'the pipeline has {num_cells} cells but devices lists {len(devices)}: '
            f'give one device per cell, or devices=None to use the first {num_cells}')
    if len(devices) > num_cells:
        # Cutting the list would silently leave devices the user meant to use idle.
        raise ValueError(
            f'devices lists {len(devices)} devices but the pipeline needs {num_cells} device '
            f'slot(s): list exactly {num_cells} devices, or give the pipeline more cells so '
            'that every listed device gets one')
    known = {_canonical(d.name).to_string(): d.name for d in tf.config.list_logical_devices()}
    resolved = []
    for name in devices:
        spec = _canonical(name)
        if not _is_remote(spec):
            if spec.to_string() not in known:
                raise ValueError(
                    f'unknown device {name!r}: this process has '
                    f'{sorted(known.values())}; pick one of those (for more CPUs '
                    'call tfpipe.configure_logical_cpus(n) at start-up; the trainer: '
                    '--num_logical_cpus=n)')
        resolved.append(spec.to_string())
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f'devices {devices} lists a device twice: every cell needs '
            'its own device, otherwise use fewer cells')
    return resolved
