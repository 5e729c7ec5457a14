"""Activation functions by the name used in layer params."""
from __future__ import annotations

from typing import Callable

import tensorflow as tf

_BY_NAME: dict[str, Callable[[tf.Tensor], tf.Tensor]] = {
    'none': tf.identity,
    'relu': tf.nn.relu,
    'gelu': tf.nn.gelu,
    'tanh': tf.tanh,
    'sigmoid': tf.sigmoid,
    'swish': tf.nn.silu,
}
NAMES = tuple(sorted(_BY_NAME))


def get(name: str, where: str) -> Callable[[tf.Tensor], tf.Tensor]:
    if name not in _BY_NAME:
        raise ValueError(f'{where}: unknown activation {name!r}; use one of {list(NAMES)}')
    return _BY_NAME[name]
