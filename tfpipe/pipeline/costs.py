"""Per-layer costs for automatic balancing: parameters, flops, memory or measured time,
and the balance of a pipeline's params from them (`balance_of`).

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

from tfpipe import devices as devices_lib
from tfpipe import fprop_context
from tfpipe.base_layer import apply_layer, body_metas
from tfpipe.hyperparams import Params
from tfpipe.pipeline import partition

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


def balance_of(p: Params) -> list[int]:
    """Layers per cell of a PipeliningLayer's params: its balance (checked), or one
    solved from the costs its partition_by names (num_cells x virtual_stages cells)."""
    if p.balance is not None:
        if p.num_cells is not None and p.num_cells != len(p.balance):
            raise ValueError(f'num_cells={p.num_cells} disagrees with balance {p.balance}; '
                             'set only one of them')
        return partition.validate_balance(p.balance, len(p.body))
    if p.num_cells is None:
        raise ValueError('balance is None and num_cells is None: give balance=[...] '
                         'or num_cells=K for automatic balance')
    if p.partition_by not in PARTITION_BY:
        raise ValueError(f'unknown partition_by {p.partition_by!r}; use one of '
                         f'{list(PARTITION_BY)}')
    if p.partition_by == 'params':
        layer_costs = by_params(p.body)
    elif p.input_shape is None:
        raise ValueError(f"partition_by={p.partition_by!r} needs p.input_shape (the "
                         "mini-batch shape, batch first), or use partition_by='params'")
    elif p.partition_by == 'flops':
        layer_costs = by_flops(p.body, tf.TensorShape(p.input_shape))
    elif p.partition_by == 'memory':
        layer_costs = by_memory(p.body, tf.TensorShape(p.input_shape))
    else:
        first = devices_lib.resolve(None if p.devices is None else list(p.devices)[:1], 1)[0]
        layer_costs = by_time(p.body, sample_input(p.input_shape, p.input_dtype), first)
    return partition.solve_balance(layer_costs, p.num_cells * p.virtual_stages)
