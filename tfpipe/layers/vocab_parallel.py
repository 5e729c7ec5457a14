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

from tfpipe.base_layer import BaseLayer
from tfpipe.layers.dense import check_last_dim, projection_meta, projection_params
from tfpipe.pipeline import tensor_parallel
from tfpipe.variable_shards import shard_name

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


def lookup_parts(tables: Sequence[tf.Tensor], ids: tf.Tensor,
                 ranges: Sequence[tuple[int, int]],
                 devices: Optional[Sequence[str]] = None) -> list:
    """Each device's part of the rows `ids` of a table whose row shards are `tables`: its
    own rows, zeros for ids another device holds; their sum is the lookup."""
    parts = []
    for t, (table, (start, stop)) in enumerate(zip(tables, ranges)):
        with _on(devices, t):
            local, inside = _local_ids(tf.identity(ids), start, stop)
            rows = tf.gather(table, local)
            parts.append(rows * tf.cast(inside, rows.dtype)[..., None])
    return parts


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


def whole(logits) -> tf.Tensor:
    """Logits as one tensor [.., V]: `logits` itself, or a list of vocabulary shards
    (a tensor-parallel `VocabLogits`' output) concatenated where the caller's device
    scope puts it."""
    if isinstance(logits, (list, tuple)):
        return gather(logits)
    return logits


def is_split(logits) -> bool:
    """Is `logits` a list of vocabulary shards (T > 1) rather than one tensor?"""
    return isinstance(logits, (list, tuple))


class VocabLogits(BaseLayer):
    """Logits over a vocabulary, x @ w + b, whose output can be the softmax of a tied
    embedding: Dense's variables (same names, shapes, initial values), so T=1 is Dense.

    Built in a tensor-parallel cell (tensor_parallel=T > 1) it splits the vocabulary
    over the cell's T devices as `Embedding` does (`vocab_ranges`: the same rows, so a
    tie to the embedding ties shard to shard) and returns the T logits shards, each on
    its device, never gathered in training: `CrossEntropy` takes them as they are.
    Evaluation, generation and serving take `whole(logits)`.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Width of the input (last dimension).')
        p.Define('vocab_size', 0, 'Number of logits (the vocabulary).')
        p.Define('use_bias', True, 'Add a bias.')
        p.Define('weight_init', 'glorot_uniform', 'Initialiser name for w.')
        p.Define('weight_layout', 'oi', "'oi': w is [vocab_size, input_dim], an Embedding "
                 "table's layout (tie it with {'logits/w': 'embedding/emb'}); 'io': "
                 '[input_dim, vocab_size].')
        return p

    @classmethod
    def TensorParallelWidths(cls, p) -> list[int]:
        """None: the vocabulary is split unevenly, so any T fits (tensor_split.py asks)."""
        return []

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if p.input_dim < 1 or p.vocab_size < 1:
            raise ValueError(f'{self.path}: input_dim={p.input_dim} and vocab_size='
                             f'{p.vocab_size} must both be >= 1')
        if p.weight_layout not in ('io', 'oi'):
            raise ValueError(f"{self.path}: weight_layout={p.weight_layout!r}: use 'oi' "
                             "([vocab_size, input_dim]) or 'io' ([input_dim, vocab_size])")
        self.group = tensor_parallel.current_group()
        self.ranges = split_vocabulary(self, p.vocab_size, self.group.size)
        sizes = [stop - start for start, stop in self.ranges]
        oi = p.weight_layout == 'oi'
        shape = [p.vocab_size, p.input_dim] if oi else [p.input_dim, p.vocab_size]
        self.CreateVariableShards('w', shape, 0 if oi else 1, self.group.devices,
                                  p.weight_init, sizes=sizes)
        if p.use_bias:
            self.CreateVariableShards('b', [p.vocab_size], 0, self.group.devices, 'zeros',
                                      sizes=sizes)

    def _Shards(self, theta: dict, name: str) -> list:
        size = self.group.size
        return [theta[shard_name(name, t, size)] for t in range(size)]

    def FProp(self, theta, x):
        """Logits [.., V], or with T > 1 the list of T shards [.., stop_t - start_t]."""
        p = self.params
        check_last_dim(self, x, p.input_dim, 'input_dim')
        weights = [self._Shards(theta, 'w')]
        if p.use_bias:
            weights.append(self._Shards(theta, 'b'))
        # Each device's logits in one `local` call: their gradient is computed there too.
        out = [self.group.local(t, self._ShardLogits, copy, *w)
               for t, (copy, *w) in enumerate(zip(self.group.scatter(x), *weights))]
        return out if self.group.size > 1 else out[0]

    def _ShardLogits(self, x, w, b=None):
        """One device's logits x @ w_t (+ b_t), over its ids."""
        p = self.params
        rows = tf.reshape(x, [-1, p.input_dim]) if x.shape.rank != 2 else x
        y = tf.matmul(rows, w, transpose_b=p.weight_layout == 'oi')
        if x.shape.rank != 2:
            y = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [tf.shape(y)[-1]]], 0))
        return tf.nn.bias_add(y, b) if b is not None else y

    def CrossEntropy(self, logits, labels: tf.Tensor) -> tf.Tensor:
        """Softmax cross-entropy [..] of this layer's output against int `labels` [..]:
        with T > 1 over the vocabulary shards where they are (`cross_entropy`)."""
        if not is_split(logits):
            return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return cross_entropy(logits, labels, self.ranges, self._AllReduce, self.group.devices)

    def _AllReduce(self, parts: Sequence[tf.Tensor], op: str) -> list:
        """The group's all-reduce; 'max' as an all-gather of the parts' maxima (the
        group's collectives sum), so every device gets the largest."""
        if op == 'sum':
            return self.group.all_reduce(parts)
        gathered = self.group.all_gather([p[..., None] for p in parts], -1)
        out = []
        for t, g in enumerate(gathered):
            with self.group.device(t):
                out.append(tf.reduce_max(g, -1))
        return out

    @classmethod
    def FPropMeta(cls, p, x_shape):
        return projection_meta(x_shape, p.input_dim, p.vocab_size)

    @classmethod
    def NumParams(cls, p):
        return projection_params(p.input_dim, p.vocab_size, p.use_bias)


def split_vocabulary(layer: BaseLayer, vocab_size: int, size: int) -> list[tuple[int, int]]:
    """`vocab_ranges` for a layer of a tensor-parallel cell, with its path in the error."""
    try:
        return vocab_ranges(vocab_size, size)
    except ValueError as e:
        raise ValueError(f'{layer.path}: {e}: lower task.pipeline.tensor_parallel') from None
