"""Multi-head self-attention and a pre-LayerNorm Transformer block.

Both also run over packed sequences (several documents in one row, told apart
by segment ids, so no position attends across documents) and one step at a time
against a key/value cache (`ExtendStep`), which is what makes generating n
tokens cost n layer calls instead of n full forwards.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import tensorflow as tf

from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers.dense import check_last_dim
from tfpipe.layers.dropout import Dropout, apply_mask
from tfpipe.layers.normalization import LayerNorm
from tfpipe.layers.tensor_parallel_dense import ColumnParallelDense, RowParallelDense
from tfpipe.pipeline import tensor_parallel


def _size(x: tf.Tensor, axis: int):
    """The static size of `axis`, or the runtime one for a served request of any batch
    and length (tfpipe/export.py); the pipeline's batches always have static sizes."""
    return x.shape[axis] if x.shape[axis] is not None else tf.shape(x)[axis]


def split_heads(y: tf.Tensor, num_heads: int, head_dim: int) -> tf.Tensor:
    """[b, t, num_heads * head_dim] -> [b, num_heads, t, head_dim]."""
    b, t = _size(y, 0), _size(y, 1)
    return tf.transpose(tf.reshape(y, [b, t, num_heads, head_dim]), [0, 2, 1, 3])


def attend(q: tf.Tensor, k: tf.Tensor, v: tf.Tensor, allowed, dropout) -> tf.Tensor:
    """Softmax(q k^T / sqrt(head_dim)) v of heads [b, h, t, head_dim] where `allowed`
    (bool, broadcast to [b, h, tq, tk]; None: everywhere), with `dropout` applied to the
    weights; the context [b, tq, h * head_dim]. A tensor-parallel cell runs it on each
    device's heads (tfpipe/layers/tensor_parallel_attention.py)."""
    b, h, t, head_dim = _size(q, 0), q.shape[1], _size(q, 2), q.shape[3]
    logits = tf.matmul(q, k, transpose_b=True) / math.sqrt(head_dim)
    if allowed is not None:
        logits = tf.where(allowed, logits, tf.constant(-1e9, logits.dtype))
    probs = dropout(tf.nn.softmax(logits, axis=-1))
    return tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [b, t, h * head_dim])


def allowed_positions(length, causal: bool, segment_ids=None):
    """Which keys each query may attend to (bool, broadcast to [b, h, t, t]; None: all):
    the past and itself if `causal`, its own segment if `segment_ids` [b, t] are given."""
    allowed = None
    if causal:
        allowed = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)
    if segment_ids is not None:
        same = tf.equal(segment_ids[:, None, :, None], segment_ids[:, None, None, :])
        allowed = same if allowed is None else tf.logical_and(allowed, same)
    return allowed


def write_cache(cache: dict, heads: dict, positions: tf.Tensor) -> dict:
    """The key/value `cache` ([b, h, length, head_dim] each) with the new positions' `heads`
    ([b, h, n, head_dim]) written at `positions` [b, n]: a one-hot blend, exact, so a
    step's cost does not depend on how many steps came before it."""
    length = cache['key'].shape[2]
    slots = tf.one_hot(positions, length, dtype=cache['key'].dtype)  # [b, n, length]
    keep = (1 - tf.reduce_sum(slots, 1))[:, None, :, None]
    return {name: cache[name] * keep + tf.einsum('bnt,bhnd->bhtd', slots, heads[name])
            for name in ('key', 'value')}


def cached_positions(cache: dict, positions: tf.Tensor) -> tf.Tensor:
    """The cache slots each new position (at `positions` [b, n]) attends to: its own and
    every earlier one."""
    length = cache['key'].shape[2]
    return tf.range(length)[None, None, None, :] <= positions[:, None, :, None]


_PROJECTIONS = ('query', 'key', 'value')


class MultiHeadAttention(BaseLayer):
    """Self-attention over [batch, time, model_dim], optionally causal.

    Built in a tensor-parallel cell (tensor_parallel=T, see docs/tensor_parallel.md)
    it splits its heads over the cell's T devices, as Megatron-LM does: query, key
    and value are column-parallel (device t computes heads [t*h/T, (t+1)*h/T) from
    a copy of the input), each device attends over its own heads, and the output
    projection is row-parallel (one all-reduce of its partial sums onto the home
    device, where the bias is added). The weights keep Dense's names and whole
    shapes, so T=1 is the plain layer and checkpoints move between any T. The
    key/value cache is split by heads too: one cache per device.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('model_dim', 0, 'Width of the input and output.')
        p.Define('num_heads', 1, 'Number of heads; must divide model_dim (and be a multiple '
                 'of the pipeline\'s tensor_parallel).')
        p.Define('causal', False, 'Each position attends only to itself and the past.')
        p.Define('atten_dropout_keep_prob', 1.0, 'Keep probability on attention weights.')
        return p

    @classmethod
    def TensorParallelWidths(cls, p) -> list[int]:
        """Heads are split over T (tfpipe/tuning/tensor_split.py asks)."""
        return [p.num_heads]

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if p.model_dim < 1 or p.num_heads < 1 or p.model_dim % p.num_heads:
            raise ValueError(f'{self.path}: num_heads={p.num_heads} must be >= 1 and divide '
                             f'model_dim={p.model_dim}')
        self.group = tensor_parallel.current_group()
        size = self.group.size
        if p.num_heads % size:
            raise ValueError(f'{self.path}: num_heads={p.num_heads} is not divisible by '
                             f'tensor_parallel={size}: use a multiple of {size} heads, or set '
                             f'task.pipeline.tensor_parallel to a divisor of {p.num_heads}')
        # Children are built from fresh params: pass p.dtype on, or a float64 layer
        # would get float32 weights.
        for name in _PROJECTIONS:
            self.CreateChild(name, ColumnParallelDense.Params().Set(
                input_dim=p.model_dim, output_dim=p.model_dim, dtype=p.dtype))
        self.CreateChild('post', RowParallelDense.Params().Set(
            input_dim=p.model_dim, output_dim=p.model_dim, dtype=p.dtype))
        self.CreateChild('atten_dropout', Dropout.Params().Set(
            keep_prob=p.atten_dropout_keep_prob, dtype=p.dtype))

    @property
    def _local_heads(self) -> int:
        return self.params.num_heads // self.group.size

    def _ShardWeights(self, theta, t) -> list:
        """Device t's weights, flat: query w, b, key w, b, value w, b, then post w."""
        out = []
        for name in _PROJECTIONS:
            layer = self.children[name]
            out += [layer.Shards(theta[name], 'w')[t], layer.Shards(theta[name], 'b')[t]]
        return out + [self.post.Shards(theta['post'], 'w')[t]]

    def _ShardHeads(self, x, weights) -> dict:
        """Device t's query, key and value heads [b, heads / T, t, head_dim] of x."""
        p = self.params
        return {name: split_heads(self.children[name].ShardOutput(x, w, b), self._local_heads,
                                  p.model_dim // p.num_heads)
                for name, w, b in zip(_PROJECTIONS, weights[0:6:2], weights[1:6:2])}

    def _ShardContext(self, t, heads, key, value, allowed, post_w):
        """Device t's partial sum of the output projection: its heads' attention."""
        ctx = attend(heads['query'], key, value, allowed,
                     lambda probs: self._DropoutHeads(probs, t))
        return self.post.ShardPartial(ctx, post_w)

    def _DropoutHeads(self, probs, t):
        """Dropout on device t's heads [b, h / T, tq, tk] of the attention weights: its heads'
        slice of the whole mask, so every weight keeps its mask whatever T is."""
        whole = probs.shape[:1].concatenate([self.params.num_heads]).concatenate(probs.shape[2:])
        mask = self.atten_dropout.Mask(whole)
        if mask is None:
            return probs
        mask = mask[:, t * self._local_heads:(t + 1) * self._local_heads]
        return apply_mask(probs, mask, self.params.atten_dropout_keep_prob)

    def FProp(self, theta, x, segment_ids=None):
        """segment_ids [b, t] int: a position attends only within its own segment
        (packed documents); None: the whole row is one segment."""
        p = self.params
        check_last_dim(self, x, p.model_dim, 'model_dim')
        allowed = allowed_positions(_size(x, 1), p.causal, segment_ids)

        def shard(t, x, *weights):
            heads = self._ShardHeads(x, weights)
            return self._ShardContext(t, heads, heads['key'], heads['value'], allowed,
                                      weights[-1])
        # Each device's whole share (projections, attention, its partial sum) is one
        # `local` call, so its backward runs on that device too.
        partials = [self.group.local(t, functools.partial(shard, t), x_t,
                                     *self._ShardWeights(theta, t))
                    for t, x_t in enumerate(self.group.scatter(x))]
        return self.post.Finish(theta['post'], partials)

    def InitCache(self, batch: int, length: int, dtype: tf.DType) -> dict | list[dict]:
        """An empty key/value cache for `length` positions: on the layer's device (create
        it there), or with T > 1 a list of T caches of each device's heads, each on its
        device."""
        p = self.params
        shape = [batch, self._local_heads, length, p.model_dim // p.num_heads]
        caches = []
        for t in range(self.group.size):
            with self.group.device(t):
                caches.append({'key': tf.zeros(shape, dtype), 'value': tf.zeros(shape, dtype)})
        return caches if self.group.size > 1 else caches[0]

    def ExtendStep(self, theta, x, positions, cache):
        """Causal attention of the new positions x [b, n, d] (at `positions` [b, n] int32)
        over every cached position up to theirs; returns (output, updated cache).

        The new keys and values are written into the cache at their positions
        (`write_cache`), and the result equals FProp over the whole prefix.
        """
        p = self.params
        if not p.causal:
            raise ValueError(f'{self.path}: ExtendStep needs causal=True (a cached step cannot '
                             'see the future)')
        check_last_dim(self, x, p.model_dim, 'model_dim')
        caches = cache if isinstance(cache, (list, tuple)) else [cache]
        partials, new = [], []
        for t, (x_t, part) in enumerate(zip(self.group.scatter(x), caches)):
            with self.group.device(t):  # no gradient here: device scopes suffice
                weights = self._ShardWeights(theta, t)
                heads = self._ShardHeads(x_t, weights)
                new.append(write_cache(part, heads, positions))
                partials.append(self._ShardContext(
                    t, heads, new[-1]['key'], new[-1]['value'],
                    cached_positions(new[-1], positions), weights[-1]))
        out = self.post.Finish(theta['post'], partials)
        return out, (new if self.group.size > 1 else new[0])

    @classmethod
    def FPropMeta(cls, p, x_shape):
        b, t, d = tf.TensorShape(x_shape).as_list()
        return LayerMeta(4 * 2 * b * t * d * d + 2 * 2 * b * t * t * d, tf.TensorShape([b, t, d]))

    @classmethod
    def NumParams(cls, p):
        return 4 * (p.model_dim * p.model_dim + p.model_dim)


class TransformerBlock(BaseLayer):
    """x + Attention(LN(x)), then x + FFN(LN(x)), with residual dropout.

    In a tensor-parallel cell the attention splits its heads and the feed-forward
    its hidden layer over the cell's T devices; the LayerNorms, the residual adds,
    the dropouts on the residual branches and the output bias run on the home
    device on the whole activation (replicated weights, one copy).
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('model_dim', 0, 'Width of the residual stream.')
        p.Define('hidden_dim', 0, 'Width of the feed-forward hidden layer.')
        p.Define('num_heads', 1, 'Attention heads.')
        p.Define('causal', False, 'Causal self-attention (decoder).')
        p.Define('residual_dropout_keep_prob', 1.0, 'Keep probability on each residual branch.')
        p.Define('atten_dropout_keep_prob', 1.0, 'Keep probability on attention weights.')
        return p

    # tfpipe/tuning/tensor_split.py: the widths T must divide, and the activation
    # all-reduces per micro-batch forward (the attention's output, the feed-forward's).
    TENSOR_PARALLEL_ALL_REDUCES = 2

    @classmethod
    def TensorParallelWidths(cls, p) -> list[int]:
        """Heads (split over T) and the feed-forward's hidden width."""
        return [p.num_heads, p.hidden_dim]

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if p.hidden_dim < 1:
            raise ValueError(f'{self.path}: hidden_dim={p.hidden_dim} must be >= 1')
        # Children are built from fresh params: pass p.dtype on (see MultiHeadAttention).
        ln = LayerNorm.Params().Set(dim=p.model_dim, dtype=p.dtype)
        self.CreateChild('atten_ln', ln)
        self.CreateChild('atten', MultiHeadAttention.Params().Set(
            model_dim=p.model_dim, num_heads=p.num_heads, causal=p.causal,
            atten_dropout_keep_prob=p.atten_dropout_keep_prob, dtype=p.dtype))
        self.CreateChild('ffn_ln', ln)
        self._CreateFeedForward()
        drop = Dropout.Params().Set(keep_prob=p.residual_dropout_keep_prob, dtype=p.dtype)
        self.CreateChild('atten_dropout', drop)
        self.CreateChild('ffn_dropout', drop)

    def _CreateFeedForward(self) -> None:
        """Megatron's pair (tensor_parallel_dense.py): the hidden layer split over the
        cell's T devices, one all-reduce of ffn_out's partial sums; Dense at T=1."""
        p = self.params
        self.CreateChild('ffn_in', ColumnParallelDense.Params().Set(
            input_dim=p.model_dim, output_dim=p.hidden_dim, activation='relu', dtype=p.dtype))
        self.CreateChild('ffn_out', RowParallelDense.Params().Set(
            input_dim=p.hidden_dim, output_dim=p.model_dim, dtype=p.dtype))

    def _Residuals(self, theta, x, attend, paddings=None):
        """The block around `attend` (LN'd x -> attention output); paddings ([b, t], 1
        for padding, or None) reach the feed-forward."""
        def run(name, value):
            return self.children[name].FProp(theta[name], value)

        x = x + run('atten_dropout', attend(run('atten_ln', x)))
        return x + run('ffn_dropout', self._FeedForward(theta, run('ffn_ln', x), paddings))

    def _FeedForward(self, theta, x, paddings=None):
        """ffn_out(ffn_in(x)): with T > 1 each device computes its hidden columns and their
        partial sum in one `local` call (backward there too), then one all-reduce home.
        A position-wise feed-forward needs no paddings."""
        ffn_in, ffn_out = self.ffn_in, self.ffn_out
        weights = zip(ffn_in.Shards(theta['ffn_in'], 'w'), ffn_in.Shards(theta['ffn_in'], 'b'),
                      ffn_out.Shards(theta['ffn_out'], 'w'))

        def shard(x, w_in, b_in, w_out):
            return ffn_out.ShardPartial(ffn_in.ShardOutput(x, w_in, b_in), w_out)
        partials = [ffn_in.group.local(t, shard, x_t, *w)
                    for t, (x_t, w) in enumerate(zip(ffn_in.group.scatter(x), weights))]
        return ffn_out.Finish(theta['ffn_out'], partials)

    def FProp(self, theta, x, segment_ids=None):
        return self._Residuals(
            theta, x, lambda h: self.atten.FProp(theta['atten'], h, segment_ids))

    def ExtendStep(self, theta, x, positions, cache):
        """FProp of new positions against the attention's cache: (output, new cache)."""
        new = {}

        def attend(h):
            out, new['cache'] = self.atten.ExtendStep(theta['atten'], h, positions, cache)
            return out
        return self._Residuals(theta, x, attend), new['cache']

    @classmethod
    def FPropMeta(cls, p, x_shape):
        b, t, d = tf.TensorShape(x_shape).as_list()
        atten = MultiHeadAttention.FPropMeta(p, x_shape).flops
        return LayerMeta(atten + 2 * 2 * b * t * d * p.hidden_dim + 20 * b * t * d,
                         tf.TensorShape([b, t, d]))

    @classmethod
    def NumParams(cls, p):
        d, h = p.model_dim, p.hidden_dim
        return MultiHeadAttention.NumParams(p) + 4 * d + (d * h + h) + (h * d + d)


class PackedTransformerBlock(TransformerBlock):
    """A causal TransformerBlock over a packed activation.

    The activation is {'x': [b, t, d], 'segment_ids': [b, t] int, 'positions':
    [b, t] int}: the ids ride along from cell to cell (ints need no gradient), and
    attention stays inside each segment, so documents packed into one row do not
    see each other.
    """

    NESTED_ACTIVATIONS = True

    @classmethod
    def Params(cls):
        return super().Params().Set(causal=True)

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        if not self.params.causal:
            raise ValueError(f'{self.path}: PackedTransformerBlock is causal; set causal=True')

    def FProp(self, theta, act):
        return {**act, 'x': super().FProp(theta, act['x'], act['segment_ids'])}

    def InitCache(self, batch: int, length: int, dtype: tf.DType) -> dict:
        return self.atten.InitCache(batch, length, dtype)

    def ExtendStep(self, theta, act, cache):
        """New positions (one document per row) against the cache: (activation, cache)."""
        x, cache = super().ExtendStep(theta, act['x'], act['positions'], cache)
        return {**act, 'x': x}, cache

    @classmethod
    def FPropMeta(cls, p, shapes):
        meta = TransformerBlock.FPropMeta(p, shapes['x'])
        return dataclasses.replace(meta, out_shapes=dict(shapes))
