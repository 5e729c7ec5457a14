"""Which devices the pipeline's cells run on, and checking the user's choice.

TensorFlow silently places ops for an unknown device such as `/CPU:9` on CPU:0 in
eager mode, so a typo would quietly put the whole pipeline on one device. Every
device name is therefore validated against the logical devices TensorFlow lists,
which include the workers' devices once the process is connected to a cluster
(`tfpipe.cluster.connect`).

Connected to a cluster, the default devices are the workers' (GPUs, else CPUs):
slots are spread over tasks first, slot j on task floor(j*T/N), then over that
task's devices in order, so K=2 cells on 2 workers use both workers, and R
replicas of K cells asking for R*K slots get one replica per worker when R = T.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Optional, Sequence

import tensorflow as tf

# The trainer's own job: TF's default, the listed chief, or one of several trainer clients
# (tfpipe/clients.py), whose task index is its own.
LOCAL_JOBS = ('localhost', 'chief', 'trainer')

_THREAD_ENV = ('TF_NUM_INTRAOP_THREADS', 'TF_NUM_INTEROP_THREADS')


def default_threads(num_logical_cpus: int) -> tuple[int, int]:
    """tfpipe's (intra, inter) thread pools on `num_logical_cpus` logical CPUs.

    Logical CPUs share the host's cores, and TensorFlow's default splits every op
    over all of them, so the cells' ops queue behind each other instead of
    overlapping. tfpipe gives each logical CPU its share of the cores per op, and
    one inter-op thread per core (at least 2) so that that many ops run at once.
    benchmarks/threads_benchmark.py (trainer steps/s of the default model, K=4 on 8
    logical CPUs of a 2-core host, i.e. 1/2 here) measured this fastest on an
    otherwise idle machine, 1.9x TensorFlow's default; under heavy load from
    other processes more inter-op threads won (1/8), because they take a larger
    share of contended cores. GPUs keep TensorFlow's default.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, num_logical_cpus)), max(2, cores)


def check_thread_count(name: str, value: int) -> None:
    """A one-line ValueError unless `value` is a thread count (an int >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f'{name}={value!r} must be an int >= 0 (0: TensorFlow\'s default)')


def thread_pools(num_logical_cpus: Optional[int], intra_op_threads: Optional[int],
                 inter_op_threads: Optional[int], sized: Sequence[int] = (0, 0)
                 ) -> tuple[int, int]:
    """The (intra, inter) pool sizes to set, 0 meaning TensorFlow's default.

    A given value wins. None takes `default_threads` on `num_logical_cpus` logical
    CPUs (TensorFlow's default when None: GPUs), unless TF_NUM_INTRAOP_THREADS /
    TF_NUM_INTEROP_THREADS are set or the pool is already `sized`, which then win.
    """
    defaults = default_threads(num_logical_cpus) if num_logical_cpus is not None else (0, 0)
    return tuple(value if value is not None else 0 if os.environ.get(env) or now else default
                 for value, default, now, env in zip((intra_op_threads, inter_op_threads),
                                                     defaults, sized, _THREAD_ENV))


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
        check_thread_count(name, value)
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

    Thread pools: None takes tfpipe's default for logical CPUs (`default_threads`,
    the fastest setting measured for the trainer) unless the program already sized
    that pool (tf.config.threading) or TF_NUM_INTRAOP_THREADS /
    TF_NUM_INTEROP_THREADS are set, which then win; 0 keeps TensorFlow's default. Logical CPUs share
    the host's cores, so single-threaded ops let the cells really overlap
    instead of each op being split over every core.

    Must run before TensorFlow initialises its runtime (before the first op,
    variable or device listing); afterwards it fails with a message saying so.
    """
    current = (tf.config.threading.get_intra_op_parallelism_threads(),
               tf.config.threading.get_inter_op_parallelism_threads())
    configure_threads(*thread_pools(count, intra_op_threads, inter_op_threads, current))
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
    if spec.job is None:
        job, task = _local_task()
        spec = spec.replace(job=job, task=task)
    return spec.replace(replica=spec.replica or 0, task=spec.task or 0)


def _local_task() -> tuple[str, int]:
    """This process's own (job, task): ('chief', 0) when the trainer connected as the
    cluster's chief, ('trainer', r) for trainer client r, else ('localhost', 0)."""
    names = [d.name for d in tf.config.list_logical_devices()]
    for job in LOCAL_JOBS[1:]:
        for name in names:
            if name.startswith(f'/job:{job}/'):
                return job, tf.DeviceSpec.from_string(name).task or 0
    return 'localhost', 0


def local_cpu() -> str:
    """This process's first CPU: where its own file I/O and input pipeline run."""
    job, task = _local_task()
    return f'/job:{job}/replica:0/task:{task}/device:CPU:0'


def _is_remote(spec: tf.DeviceSpec) -> bool:
    return spec.job not in (None,) + LOCAL_JOBS


def remote_devices_by_task() -> dict[tuple[str, int], list[str]]:
    """The connected cluster's devices per (job, task): GPUs if the task has any, else CPUs.

    Empty when this process is not connected to a cluster.
    """
    by_task: dict[tuple[str, int], dict[str, list[tf.DeviceSpec]]] = defaultdict(
        lambda: defaultdict(list))
    for device in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(device.name)
        if _is_remote(spec):
            by_task[(spec.job, spec.task)][spec.device_type].append(spec)
    out = {}
    for key in sorted(by_task):
        kinds = by_task[key]
        pool = kinds.get('GPU') or kinds.get('CPU') or []
        out[key] = [s.to_string() for s in sorted(pool, key=lambda s: s.device_index)]
    return out


def spread(task_devices: Sequence[Sequence[str]], num_slots: int,
           task_names: Optional[Sequence[str]] = None) -> list[str]:
    """Slot j on task floor(j*T/N), then on that task's devices in order.

    Tasks first so that consecutive cells (and whole replicas) land on different
    workers only where they must: with N = T*D every task gets D consecutive slots.
    """
    num_tasks = len(task_devices)
    names = list(task_names or [f'task {t}' for t in range(num_tasks)])
    total = sum(len(d) for d in task_devices)
    if num_slots > total:
        raise ValueError(
            f'the pipeline needs {num_slots} devices but the cluster has {total} '
            f'({", ".join(f"{n}: {len(d)}" for n, d in zip(names, task_devices))}): use at '
            'most that many cells (times replicas), start more workers, or give each worker '
            'more devices (--num_logical_cpus with --run_locally=cpu)')
    out = []
    for j in range(num_slots):
        task = j * num_tasks // num_slots
        first = -(-task * num_slots // num_tasks)  # the first slot of this task: ceil(t*N/T)
        index = j - first
        if index >= len(task_devices[task]):
            wanted = -(-(task + 1) * num_slots // num_tasks) - first
            raise ValueError(
                f'the pipeline puts {wanted} devices on {names[task]} but it has '
                f'{len(task_devices[task])}: give that worker at least {wanted} devices '
                '(--num_logical_cpus with --run_locally=cpu, or GPUs), or list the devices '
                'explicitly (task.pipeline.devices)')
        out.append(task_devices[task][index])
    return out


def resolve(devices: Optional[Sequence[str]], num_cells: int) -> list[str]:
    """Returns one canonical device name per cell.

    `devices=None` picks the workers' devices spread over tasks (see `spread`)
    when the process is connected to a cluster, else the first `num_cells` GPUs
    if the process has any GPU, else logical CPUs. Errors name the fix: too few
    devices, more devices than slots (never cut silently), unknown device, a
    device listed twice.
    """
    if devices is None:
        remote = remote_devices_by_task()
        if remote:
            return spread(list(remote.values()), num_cells,
                          [f'{job} task {task}' for job, task in remote])
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
        if spec.to_string() not in known:
            if _is_remote(spec) and not any(_is_remote(_canonical(n)) for n in known):
                raise ValueError(
                    f'device {name!r} is on job {spec.job!r} but this process is not '
                    'connected to a cluster: pass the trainer --cluster_spec=worker=HOST:PORT,'
                    '... (or TF_CONFIG), or call tfpipe.cluster.connect first')
            raise ValueError(
                f'unknown device {name!r}: TensorFlow lists '
                f'{sorted(known.values())}; pick one of those (for more CPUs '
                'call tfpipe.configure_logical_cpus(n) at start-up; the trainer: '
                '--num_logical_cpus=n; a worker: --num_logical_cpus=n with --run_locally=cpu)')
        resolved.append(spec.to_string())
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f'devices {devices} lists a device twice: every cell needs '
            'its own device, otherwise use fewer cells')
    return resolved
