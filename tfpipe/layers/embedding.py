"""Token and position embeddings."""
from __future__ import annotations

import math

import tensorflow as tf

from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers import vocab_parallel
from tfpipe.pipeline import tensor_parallel
from tfpipe.variable_shards import shard_name


class Embedding(BaseLayer):
    """int ids [..] -> vectors [.., embedding_dim], optionally scaled by sqrt(dim).

    Built in a tensor-parallel cell (tensor_parallel=T > 1) the table is split by
    rows over the cell's T devices (`vocab_parallel`: uneven when T does not divide
    the vocabulary, no padding): each device looks up the ids it holds and one
    all-reduce onto the home device sums the parts. Checkpoints hold the whole table.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 0, 'Number of ids.')
        p.Define('embedding_dim', 0, 'Width of each vector.')
        p.Define('scale_sqrt_depth', False, 'Multiply by sqrt(embedding_dim) (Transformer).')
        p.Define('weight_init', 'gaussian', 'Initialiser name for the table.')
        return p

    @classmethod
    def TensorParallelWidths(cls, p) -> list[int]:
        """None: the vocabulary is split unevenly, so any T fits (tensor_split.py asks)."""
        return []

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if p.vocab_size < 1 or p.embedding_dim < 1:
            raise ValueError(f'{self.path}: vocab_size={p.vocab_size} and embedding_dim='
                             f'{p.embedding_dim} must both be >= 1')
        self.group = tensor_parallel.current_group()
        self.ranges = vocab_parallel.split_vocabulary(self, p.vocab_size, self.group.size)
        self.CreateVariableShards('emb', [p.vocab_size, p.embedding_dim], 0, self.group.devices,
                                  p.weight_init, sizes=[b - a for a, b in self.ranges])

    def FProp(self, theta, ids):
        if ids.dtype.is_floating:
            raise ValueError(f'{self.path}: Embedding takes integer ids, got {ids.dtype}')
        size = self.group.size
        if size == 1:
            out = tf.gather(theta['emb'], ids)
        else:
            # Each device's part in one `local` call: its gradient is computed there too.
            out = self.group.reduce_to_home([
                self.group.local(t, lambda table, t=t: vocab_parallel.lookup_parts(
                    [table], ids, self.ranges[t:t + 1])[0], theta[shard_name('emb', t, size)])
                for t in range(size)])
        if self.params.scale_sqrt_depth:
            out *= math.sqrt(self.params.embedding_dim)
        return out

    @classmethod
    def FPropMeta(cls, p, ids_shape):
        shape = tf.TensorShape(ids_shape)
        return LayerMeta(shape.num_elements() * p.embedding_dim,
                         shape.concatenate([p.embedding_dim]))

    @classmethod
    def NumParams(cls, p):
        return p.vocab_size * p.embedding_dim


class PositionEmbedding(BaseLayer):
    """Adds a learned vector per position: [batch, time, dim] -> same shape."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('max_length', 0, 'Longest sequence the table covers.')
        p.Define('embedding_dim', 0, 'Width of each vector.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if p.max_length < 1 or p.embedding_dim < 1:
            raise ValueError(f'{self.path}: max_length={p.max_length} and embedding_dim='
                             f'{p.embedding_dim} must both be >= 1')
        self.CreateVariable('pos', [p.max_length, p.embedding_dim], 'gaussian')

    def FProp(self, theta, x):
        length = x.shape[1]
        if length > self.params.max_length:
            raise ValueError(f'{self.path}: sequence length {length} exceeds p.max_length='
                             f'{self.params.max_length}; raise max_length')
        return x + theta['pos'][:length]

    @classmethod
    def FPropMeta(cls, p, x_shape):
        shape = tf.TensorShape(x_shape)
        return LayerMeta(shape.num_elements(), shape)

    @classmethod
    def NumParams(cls, p):
        return p.max_length * p.embedding_dim


class PackedPositionEmbedding(PositionEmbedding):
    """Adds the vector of each token's own position, read from a packed activation.

    {'x': [b, t, d], 'positions': [b, t] int, ...}: positions restart at 0 in
    every document packed into a row, so a document is embedded the same
    wherever it sits in the row.
    """

    NESTED_ACTIVATIONS = True

    def FProp(self, theta, act):
        return {**act, 'x': act['x'] + tf.gather(theta['pos'], act['positions'])}

    @classmethod
    def FPropMeta(cls, p, shapes):
        return LayerMeta(tf.TensorShape(shapes['x']).num_elements(), dict(shapes))
