"""Seeded, stateless weight initialisers.

Each variable's seed is derived from the experiment seed and the variable's
*layer path* (e.g. `pipe/fc3/w`), never from creation order or device. So the
same params and seed give the same weights whatever the partitioning, which is
what makes a K=4 run comparable with a K=1 run, and what lets a checkpoint move
between partitionings.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Sequence

import tensorflow as tf

Initializer = Callable[[Sequence[int], tf.DType, tf.Tensor], tf.Tensor]


def seed_for(seed: int, path: str) -> tf.Tensor:
    """A stateless-RNG seed pair from an integer seed and a variable path."""
    key = f'{seed}/{path}'.encode()
    return tf.constant([zlib.crc32(key), zlib.crc32(key + b'#')], tf.int64)


def _fans(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) < 2:
        return max(1, int(shape[0]) if shape else 1), 1
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def glorot_uniform(shape, dtype, seed):
    fan_in, fan_out = _fans(shape)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return tf.random.stateless_uniform(shape, seed, -limit, limit, dtype=dtype)


def stacked_glorot_uniform(shape, dtype, seed):
    """glorot_uniform of each [in, out] matrix of a stack [n, ..., in, out].

    The leading dimensions count independent matrices (a mixture of experts' stacked
    weights), not a convolution's receptive field: each expert starts at the scale of
    a Dense of its own shape, not sqrt(n) smaller.
    """
    limit = math.sqrt(6.0 / (shape[-2] + shape[-1]))
    return tf.random.stateless_uniform(shape, seed, -limit, limit, dtype=dtype)


def he_normal(shape, dtype, seed):
    fan_in, _ = _fans(shape)
    return tf.random.stateless_truncated_normal(shape, seed, stddev=math.sqrt(2.0 / fan_in),
                                                dtype=dtype)


def gaussian(shape, dtype, seed, stddev=0.02):
    return tf.random.stateless_truncated_normal(shape, seed, stddev=stddev, dtype=dtype)


def zeros(shape, dtype, seed):
    del seed
    return tf.zeros(shape, dtype)


def ones(shape, dtype, seed):
    del seed
    return tf.ones(shape, dtype)


_BY_NAME: dict[str, Initializer] = {
    'glorot_uniform': glorot_uniform, 'stacked_glorot_uniform': stacked_glorot_uniform,
    'he_normal': he_normal, 'gaussian': gaussian, 'zeros': zeros, 'ones': ones}


def get(name: str) -> Initializer:
    """Looks an initialiser up by the name used in layer params."""
    if name not in _BY_NAME:
        raise ValueError(f'unknown initialiser {name!r}: use one of {sorted(_BY_NAME)}')
    return _BY_NAME[name]


NAMES = tuple(sorted(_BY_NAME))
