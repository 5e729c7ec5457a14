"""Auxiliary losses carried through the pipeline: recorded per cell and micro-batch,
differentiated beside each cell's outputs, reported summed.

A layer records a loss in the context's `fprop_context.AuxLossSink` (a mixture of
experts' load-balancing and router z-losses) for the tokens of the call it computes:
in a pipeline, one micro-batch. The pipeline weights micro-batch m's value as it
weights that micro-batch's share of the main loss:

    aux = sum over replicas, micro-batches m: (b_m / N) * aux_m

b_m the examples of micro-batch m, N those of the (global) mini-batch. So K cells at
M micro-batches equal K=1 at the same M and the plain body run on each micro-batch,
and with equal micro-batches aux is the mean of aux_m. M itself changes the value
(an expert's capacity and the loss's statistics are per call), as it would for any
loss of a statistic of the micro-batch.

Gradient: the backward of cell k on micro-batch m differentiates the cell's outputs
with their incoming gradients and, beside them, each loss value the cell recorded,
with the coefficient upstream x b_m / N: upstream is the loss's weight in
ForwardBackward (which optimises main + weighted aux), or the gradient the caller's
tape gives the reported value under FProp. A recomputing cell records its losses
again while it recomputes, for that differentiation only; the values reported are
the forward's, so nothing is counted twice.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from tfpipe import fprop_context

Key = tuple[str, str]  # (path of the layer that recorded it, loss name)
Record = tuple[Key, tf.Tensor, Optional[float]]  # (key, unweighted value, weight or None)


def records_of(sink: fprop_context.AuxLossSink) -> list[Record]:
    """A sink's records as (key, value, weight)."""
    return [((path, name), value, weight) for path, name, value, weight in sink.records]


def coefficients(records: Sequence[Record], upstream: Optional[dict[Key, Any]],
                 fraction: float) -> list[Optional[tf.Tensor]]:
    """Per record, the output gradient of its value in micro-batch m's backward:
    upstream x fraction (b_m / N) in the value's dtype.

    upstream: per key, the gradient of the reported (summed) value; None: each
    record's weight. None for a key without one (an unused report).
    """
    out = []
    for key, value, weight in records:
        # A statistic (weight None) is reported only, never differentiated.
        grad = None if weight is None else weight if upstream is None else upstream.get(key)
        out.append(None if grad is None else
                   tf.cast(grad, value.dtype) * tf.constant(fraction, value.dtype))
    return out


def targets(records: Sequence[Record], upstream: Optional[dict[Key, Any]],
            fraction: float) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """The loss values a backward differentiates and their output gradients
    (`coefficients`), without those left out."""
    return select(records, coefficients(records, upstream, fraction))


def select(records: Sequence[Record],
           grads: Sequence[Optional[tf.Tensor]]) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """(values, output gradients) of the records whose gradient is not None."""
    pairs = [(value, g) for (_, value, _), g in zip(records, grads) if g is not None]
    return [v for v, _ in pairs], [g for _, g in pairs]


def under(records: Sequence[Record], layer_path: str) -> list[Record]:
    """The records of the layer at `layer_path` or of a layer nested in it."""
    return [r for r in records if r[0][0] == layer_path or r[0][0].startswith(layer_path + '/')]


def summed(records_by_micro_batch: Sequence[Sequence[Record]],
           fractions: Sequence[float]) -> dict[Key, tuple[tf.Tensor, float]]:
    """{key: (sum over micro-batches of fraction x value, weight)} in first-seen order."""
    out: dict[Key, tuple[tf.Tensor, float]] = {}
    for records, fraction in zip(records_by_micro_batch, fractions):
        for key, value, weight in records:
            part = value * tf.constant(fraction, value.dtype)
            out[key] = (out[key][0] + part, weight) if key in out else (part, weight)
    return out


def merge(reports: Sequence[dict[Key, tuple[tf.Tensor, float]]],
          device: str) -> dict[Key, tuple[tf.Tensor, float]]:
    """The replicas' reports summed per key, on `device`."""
    out: dict[Key, tuple[list, float]] = {}
    for report in reports:
        for key, (value, weight) in report.items():
            out.setdefault(key, ([], weight))[0].append(value)
    with tf.device(device), tf.name_scope('aux_losses'):
        return {key: (tf.add_n(values), weight) for key, (values, weight) in out.items()}


def record_into(sink: Optional[fprop_context.AuxLossSink],
                report: dict[Key, tuple[tf.Tensor, float]]) -> None:
    """Puts the pipeline's summed losses into the caller's sink (if it has one)."""
    if sink is None:
        return
    for (path, name), (value, weight) in report.items():
        sink.add(path, name, value, weight)
