"""The machine's peak FLOP/s, measured once by a matmul probe and cached.

MFU is only as honest as its denominator. A datasheet number means nothing for a
CPU (it depends on the cores, the vector units, the clock under load and
oneDNN's kernels), so tfpipe measures the peak that TensorFlow itself reaches:
square matmuls of MATMUL_SIZE, the shape oneDNN and cuBLAS run fastest, as many
at once as the host has cores (the trainer's logical CPUs run single-threaded
ops side by side, so one matmul would measure one core), the best of several
calls. The figure is cached per machine (host name, processor, cores,
TensorFlow version, device type, dtype) in `cache_path()`, so later runs on the
same machine divide by the same number. A probe taken on a loaded machine is low:
the cache keeps the highest figure and probes again when the host is quieter
(`cached_peak`). On GPUs and TPUs with a known peak, give it instead (gin
`trainer.peak_flops`, which each trainer client may set for its own devices): a
datasheet figure is the usual MFU denominator there. GPU probing is untested here (no GPU).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import tempfile
import time
from typing import Optional

import tensorflow as tf
from absl import logging

from tfpipe import memory_stats

MATMUL_SIZE = 2048
CALLS = 5  # the first call traces and warms the caches; the best of the rest counts
CACHE_ENV = 'TFPIPE_CACHE_DIR'
QUIET_LOAD = 0.25  # load average per core under which a probe is not repeated


def cache_path() -> str:
    """$TFPIPE_CACHE_DIR/peak_flops.json, else ~/.cache/tfpipe/peak_flops.json."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'tfpipe')
    return os.path.join(root, 'peak_flops.json')


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _processor() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.partition(':')[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(device_type: str, dtype: tf.DType) -> str:
    """What the cached peak is valid for: this host, its cores, TensorFlow, device, dtype."""
    return (f'{platform.node()}|{_processor()}|{_cores()} cores|tf {tf.__version__}|'
            f'{device_type}|{tf.as_dtype(dtype).name}')


def measure(device: str, dtype: tf.DType = tf.float32, parallel: int = 1,
            size: int = MATMUL_SIZE) -> float:
    """FLOP/s of `parallel` independent size x size matmuls at once on `device`."""
    with tf.device(device):
        inputs = [tf.random.uniform([size, size], dtype=tf.float32) for _ in range(parallel)]
        inputs = [tf.cast(x, dtype) for x in inputs]

    @tf.function(autograph=False)
    def products(xs):
        with tf.device(device):
            # A sum of one element per product: the matmuls cannot be pruned, and
            # nothing large comes back to the host.
            return tf.add_n([tf.cast(tf.matmul(x, x)[0, 0], tf.float32) for x in xs])

    best = float('inf')
    for call in range(CALLS):
        start = time.perf_counter()
        products(inputs).numpy()
        if call:
            best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 * parallel / best


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # absent or unreadable: measured again and rewritten


def _write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix='.peak_flops.')
    with os.fdopen(fd, 'w') as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: two trainers starting at once never see half a file


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s; `measured_now` when this call probed; `load`: the host's
    load average per core when the cached figure was probed."""

    flops: float
    measured_now: bool
    load: float


def host_load() -> float:
    """The 1-minute load average per core: 1.0 means every core busy."""
    try:
        return os.getloadavg()[0] / _cores()
    except OSError:  # not available here: taken as quiet
        return 0.0


def cached_peak(device_type: str = 'CPU', dtype: tf.DType = tf.float32,
                path: Optional[str] = None) -> Peak:
    """The peak FLOP/s of one device of `device_type` (a CPU's device is the whole host,
    its logical devices sharing the cores; a GPU's is one GPU), from the cache or probed.

    A probe on a busy host reads low, and a low peak would overstate every MFU after
    it, so the cache records the load each figure was probed at and probes again when
    the host is at most half as loaded (QUIET_LOAD and under counts as quiet): a few
    runs on a shared machine converge on the quiet figure. The cache keeps the highest.
    """
    path = path or cache_path()
    key = machine_key(device_type, dtype)
    load = host_load()
    entry = _entry(_read(path), key)
    if entry is not None and (entry['load'] <= QUIET_LOAD or load > entry['load'] / 2):
        return Peak(entry['flops'], False, entry['load'])
    device = f'/{device_type}:0'
    with memory_stats.not_counted(device):  # the probe's matrices are not the run's peak
        flops = measure(device, dtype, parallel=_cores() if device_type == 'CPU' else 1)
    cached = _read(path)  # another process may have written meanwhile
    entry = _entry(cached, key) or {'flops': 0.0, 'load': load}
    cached[key] = {'flops': max(flops, entry['flops']), 'load': min(load, entry['load'])}
    try:
        _write(path, cached)
    except OSError as e:  # a read-only home: the figure is still right for this run
        logging.warning('could not cache the peak FLOP/s in %s (%s): set $%s to a writable '
                        'directory, or the next run measures it again', path, e, CACHE_ENV)
    return Peak(cached[key]['flops'], True, cached[key]['load'])


def raise_cached(flops: float, device_type: str = 'CPU', dtype: tf.DType = tf.float32,
                 path: Optional[str] = None) -> None:
    """Caches `flops`, a rate a run reached on one device, where it beats the cached peak:
    the run proves the probe read low (trainer/throughput.py). The probe's load stays,
    so a quieter host still probes again."""
    path = path or cache_path()
    key = machine_key(device_type, dtype)
    cached = _read(path)
    entry = _entry(cached, key)
    if entry is not None and entry['flops'] >= flops:
        return
    cached[key] = {'flops': float(flops), 'load': entry['load'] if entry else host_load()}
    try:
        _write(path, cached)
    except OSError as e:
        logging.warning('could not cache the peak FLOP/s in %s (%s)', path, e)


def _entry(cached: dict, key: str) -> Optional[dict]:
    """The cached {'flops', 'load'} of `key`, or None if absent or malformed."""
    entry = cached.get(key)
    if (isinstance(entry, dict) and isinstance(entry.get('flops'), (int, float))
            and entry['flops'] > 0 and isinstance(entry.get('load'), (int, float))):
        return {'flops': float(entry['flops']), 'load': float(entry['load'])}
    return None
