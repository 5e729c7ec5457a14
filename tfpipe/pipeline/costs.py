"""Per-layer costs for automatic balancing: parameters, flops, memory or measured time.

The partitioner only sees a list of numbers; this module turns the body's
layer params into one. By parameter count and by flops nothing is built (both
come from the layer classes' `NumParams` / `FPropMeta`), which matters for a
model too big for one device. By time, the body is built once on one device,
each layer's forward is timed, and the throwaway layers are dropped.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.base_layer import apply_layer, body_metas
from tfpipe.hyperparams import Params

PARTITION_BY = ('params', 'flops', 'memory', 'time')


def by_params(body: Sequence[Params]) -> list[float]:
    return [float(p.cls.NumParams(p)) for p in body]


def by_flops(body: Sequence[Params], input_shape: Any) -> list[float]:
    return [float(meta.flops) for meta in body_metas(body, input_shape)]


def by_memory(body: Sequence[Params], input_shape: Any, bytes_per_element: int = 4) -> list[float]:
    """Bytes each layer keeps during a training step: weights, their gradient sum and
    its mini-batch output activation (float32 unless told otherwise).

    Balancing by this evens out the peak memory per device, which matters when
    the model is cut because it does not fit, not because it is slow.
    """
    out = []
    for p, meta in zip(body, body_metas(body, input_shape)):
        activation = sum(s.num_elements() for s in tf.nest.flatten(meta.out_shapes))
        out.append(float(bytes_per_element * (2 * p.cls.NumParams(p) + activation)))
    return out


def by_time(body: Sequence[Params], sample: Any, device: str, repeats: int = 5) -> list[float]:
    """Fastest wall time of each layer's forward on `sample`, in eval mode: other
    processes' load only slows a call down, so on a shared machine the fastest of a few
    calls is the steadiest estimate of the layer's own cost."""
    from tfpipe.layers.composite import Sequential  # local: composite imports base_layer only

    with tf.device(device):
        seq = Sequential.Params().Set(name='timing', body=list(body)).Instantiate()
        costs = []
        x = sample
        with fprop_context.evaluation():
            for layer in seq.layers:
                fn = tf.function(lambda theta, v, layer=layer: apply_layer(layer, theta, v))
                y = fn(layer.theta, x)  # trace and warm up
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    tf.nest.map_structure(lambda t: t.numpy(), fn(layer.theta, x))
                    times.append(time.perf_counter() - start)
                costs.append(float(np.min(times)))
                x = y
    return costs


def sample_input(shape: Sequence[int], dtype: tf.DType) -> tf.Tensor:
    """A stand-in input for timing: zeros for ids, normal noise for floats."""
    if dtype.is_floating:
        return tf.random.stateless_normal(list(shape), [0, 0], dtype=dtype)
    return tf.zeros(list(shape), dtype)
