"""Which devices the pipeline's cells run on, and checking the user's choice.

TensorFlow silently places ops for an unknown device such as `/CPU:9` on CPU:0 in
eager mode, so a typo would quietly put the whole pipeline on one device. Every
device name is therefore validated against the logical devices of this process
(remote `/job:...` devices of a cluster are taken as given: they are checked by
the distributed runtime when the graph runs).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import tensorflow as tf

# Measured with benchmarks/planner_benchmark.py (trainer steps/s of the default model on
# 8 logical CPUs of a 2-core host): see its threads rows.
DEFAULT_INTRA_OP_THREADS = 0
DEFAULT_INTER_OP_THREADS = 0
_THREAD_ENV = ('TF_NUM_INTRAOP_THREADS', 'TF_NUM_INTEROP_THREADS')


def configure_threads(intra_op_threads: int, inter_op_threads: int) -> None:
    """Sets TensorFlow's thread pools; 0 leaves a pool at TensorFlow's default.

    Like the logical devices, the pools are fixed when the runtime starts, so
    this must run before the first op; a conflicting later call names the fix.
    """
    setters = ((intra_op_threads, tf.config.threading.get_intra_op_parallelism_threads,
                tf.config.threading.set_intra_op_parallelism_threads, 'intra_op_threads'),
               (inter_op_threads, tf.config.threading.get_inter_op_parallelism_threads,
                tf.config.threading.set_inter_op_parallelism_threads, 'inter_op_threads'))
    for value, get, set_, name in setters:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f'{name}={value!r} must be an int >= 0 (0: TensorFlow\'s default)')
        if value == 0 or get() == value:
            continue
        try:
            set_(value)
        except RuntimeError as e:
            raise RuntimeError(
                f'cannot set {name}={value}: TensorFlow is already initialised with '
                f'{get()}; configure threads at the start of the program, before any '
                'TensorFlow op') from e


def configure_logical_cpus(count: int, intra_op_threads: Optional[int] = None,
                           inter_op_threads: Optional[int] = None) -> None:
    """Splits the host CPU into `count` logical devices and sizes the thread pools.

    Thread pools: None takes tfpipe's default for logical CPUs
    (DEFAULT_INTRA_OP_THREADS / DEFAULT_INTER_OP_THREADS, the fastest setting
    measured for the trainer) unless TF_NUM_INTRAOP_THREADS /
    TF_NUM_INTEROP_THREADS are set, which then win; 0 keeps TensorFlow's
    default. Logical CPUs share the host's cores, so single-threaded ops let
    two cells really overlap instead of each grabbing every core.

    Must run before TensorFlow initialises its runtime (before the first op,
    variable or device listing); afterwards it fails with a message saying so.
    """
    defaults = (DEFAULT_INTRA_OP_THREADS, DEFAULT_INTER_OP_THREADS)
    threads = [0 if value is None and os.environ.get(env) else
               default if value is None else value
               for value, default, env in zip((intra_op_threads, inter_op_threads),
                                              defaults, _THREAD_ENV)]
    configure_threads(*threads)
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
    else logical CPUs. Errors name the fix: too few devices, unknown device, a
    device listed twice.
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
    known = {_canonical(d.name).to_string(): d.name for d in tf.config.list_logical_devices()}
    resolved = []
    for name in devices[:num_cells]:
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
            f'devices {devices[:num_cells]} lists a device twice: every cell needs '
            'its own device, otherwise use fewer cells')
    return resolved
