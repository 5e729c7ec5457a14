"""The machine's peak FLOP/s, measured once by a matmul probe and cached.

MFU is only as honest as its denominator. A datasheet number means nothing for a
CPU (it depends on the cores, the vector units, the clock under load and
oneDNN's kernels), so tfpipe measures the peak that TensorFlow itself reaches:
square matmuls of MATMUL_SIZE, the shape oneDNN and cuBLAS run fastest, as many
at once as the host has cores (the trainer's logical CPUs run single-threaded
ops side by side, so one matmul would measure one core), the best of several
calls. The figure is cached per machine (host name, processor, cores,
TensorFlow version, device type, dtype) in `cache_path()`, so every later run on
the same machine divides by the same number; a probe taken on a loaded machine
is low, so the cache keeps the highest of all probes. On GPUs and TPUs with a
known peak, give it instead (the trainer's --peak_flops): a datasheet figure is
the usual MFU denominator there. GPU probing is untested here (no GPU).
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from typing import Optional

import tensorflow as tf
from absl import logging

MATMUL_SIZE = 1024
CALLS = 5  # the first call traces and warms the caches; the best of the rest counts
CACHE_ENV = 'TFPIPE_CACHE_DIR'


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


def cached_peak(device_type: str = 'CPU', dtype: tf.DType = tf.float32,
                path: Optional[str] = None) -> tuple[float, bool]:
    """(peak FLOP/s of one device of `device_type`, whether it was measured just now).

    A CPU's device is the whole host (its logical devices share the cores); a
    GPU's is one GPU.
    """
    path = path or cache_path()
    key = machine_key(device_type, dtype)
    cached = _read(path)
    if isinstance(cached.get(key), (int, float)) and cached[key] > 0:
        return float(cached[key]), False
    if device_type == 'CPU':
        peak = measure('/CPU:0', dtype, parallel=_cores())
    else:
        peak = measure(f'/{device_type}:0', dtype)
    cached = _read(path)  # another process may have written meanwhile
    cached[key] = max(peak, float(cached.get(key) or 0))
    try:
        _write(path, cached)
    except OSError as e:  # a read-only home: the figure is still right for this run
        logging.warning('could not cache the peak FLOP/s in %s (%s): set $%s to a writable '
                        'directory, or the next run measures it again', path, e, CACHE_ENV)
    return cached[key], True
