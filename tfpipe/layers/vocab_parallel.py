"""A vocabulary split over the T devices of a tensor-parallel cell (Megatron-LM's).

The embedding table [V, d] and the tied softmax weight are cut by rows: device t
holds ids [start_t, stop_t). T need not divide V (the byte vocabulary is 258):
the split is uneven, sizes differing by at most one (258 over 4: 65, 65, 64, 64),
so there is no padding row at all, nothing to mask out of the softmax and
nothing to drop from a checkpoint; the shards concatenated are the whole table.

Lookup: each device gathers the ids it owns (zeros elsewhere) and one all-reduce
sums the parts. Cross-entropy never gathers the logits [b, t, V]: three
all-reduces of [b, t] values (the max, the sum of exponentials, the target's
logit) give log-sum-exp minus the target logit on every device, and the
backward (softmax_t - one_hot_t) * dy is local to each device.

The functions take one tensor per device and an `all_reduce(tensors, op)`
(op 'sum' or 'max'; one result per device) so the math is the same whether the
reduction is a TensorFlow collective among a cell's devices or, in unit tests,
an add_n.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow as tf

AllReduce = Callable[[Sequence[tf.Tensor], str], list]


def vocab_ranges(vocab_size: int, num_shards: int) -> list[tuple[int, int]]:
    """(start, stop) of each device's ids: contiguous, sizes differing by at most one."""
    if num_shards < 1 or vocab_size < num_shards:
        raise ValueError(f'a vocabulary of {vocab_size} cannot be split over {num_shards} '
                         'devices: give every device at least one id')
    base, extra = divmod(vocab_size, num_shards)
    bounds = [0]
    for t in range(num_shards):
        bounds.append(bounds[-1] + base + (1 if t < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))


def _on(devices: Optional[Sequence[str]], t: int):
    return tf.device(devices[t] if devices else None)


def _local_ids(ids: tf.Tensor, start: int, stop: int) -> tuple[tf.Tensor, tf.Tensor]:
    """(ids - start clipped into the shard, whether each id is this shard's)."""
    inside = tf.logical_and(ids >= start, ids < stop)
    return tf.clip_by_value(ids - start, 0, stop - start - 1), inside


def lookup(tables: Sequence[tf.Tensor], ids: tf.Tensor, ranges: Sequence[tuple[int, int]],
           all_reduce: AllReduce, devices: Optional[Sequence[str]] = None) -> list:
    """Rows `ids` of the table whose row shards are `tables`: one result per device."""
    parts = []
    for t, (table, (start, stop)) in enumerate(zip(tables, ranges)):
        with _on(devices, t):
            local, inside = _local_ids(ids, start, stop)
            rows = tf.gather(table, local)
            parts.append(rows * tf.cast(inside, rows.dtype)[..., None])
    return all_reduce(parts, 'sum')


def cross_entropy(logits: Sequence[tf.Tensor], labels: tf.Tensor,
                  ranges: Sequence[tuple[int, int]], all_reduce: AllReduce,
                  devices: Optional[Sequence[str]] = None) -> tf.Tensor:
    """Softmax cross-entropy [..] of vocabulary-split `logits` (shard t: [.., stop_t -
    start_t]) against int `labels` [..]; the result is on the first device.

    The same value as tf.nn.sparse_softmax_cross_entropy_with_logits over the
    concatenated logits; its gradient (softmax - one_hot) * dy is computed per
    shard without communication (the custom gradient), as Megatron-LM does.
    """
    num = len(logits)

    @tf.custom_gradient
    def xent(*shards):
        maxima = []
        for t, shard in enumerate(shards):
            with _on(devices, t):
                maxima.append(tf.reduce_max(shard, -1))
        maxima = all_reduce(maxima, 'max')
        shifted, sum_exp, target = [], [], []
        for t, (shard, (start, stop)) in enumerate(zip(shards, ranges)):
            with _on(devices, t):
                s = shard - maxima[t][..., None]
                local, inside = _local_ids(labels, start, stop)
                shifted.append(s)
                sum_exp.append(tf.reduce_sum(tf.exp(s), -1))
                picked = tf.gather(s, local, batch_dims=labels.shape.rank)
                target.append(tf.where(inside, picked, tf.zeros_like(picked)))
        sum_exp = all_reduce(sum_exp, 'sum')
        target = all_reduce(target, 'sum')
        log_z = []
        for t in range(num):
            with _on(devices, t):
                log_z.append(tf.math.log(sum_exp[t]))
        with _on(devices, 0):
            loss = log_z[0] - target[0]

        def grad(dy):
            grads = []
            for t, (s, (start, stop)) in enumerate(zip(shifted, ranges)):
                with _on(devices, t):
                    probs = tf.exp(s - log_z[t][..., None])
                    local, inside = _local_ids(labels, start, stop)
                    hot = tf.one_hot(local, stop - start, dtype=s.dtype) * tf.cast(
                        inside, s.dtype)[..., None]
                    grads.append((probs - hot) * dy[..., None])
            return grads

        return loss, grad

    return xent(*logits)


def gather(logits: Sequence[tf.Tensor], device: Optional[str] = None) -> tf.Tensor:
    """The whole logits [.., V] on `device` (evaluation, generation, serving: where the
    argmax, top-k or log-probs of every id are needed)."""
    with tf.device(device):
        return tf.concat(list(logits), -1)
