"""Multi-head self-attention and a pre-LayerNorm Transformer block.

Both also run over packed sequences (several documents in one row, told apart
by segment ids, so no position attends across documents) and one step at a time
against a key/value cache (`ExtendStep`), which is what makes generating n
tokens cost n layer calls instead of n full forwards.
"""
from __future__ import annotations

import math

import tensorflow as tf

from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers.dense import Dense, check_last_dim
from tfpipe.layers.dropout import Dropout
from tfpipe.layers.normalization import LayerNorm


def _size(x: tf.Tensor, axis: int):
    """The static size of `axis`, or the runtime one for a served request of any batch
    and length (tfpipe/export.py); the pipeline's batches always have static sizes."""
    return x.shape[axis] if x.shape[axis] is not None else tf.shape(x)[axis]


class MultiHeadAttention(BaseLayer):
    """Self-attention over [batch, time, model_dim], optionally causal."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('model_dim', 0, 'Width of the input and output.')
        p.Define('num_heads', 1, 'Number of heads; must divide model_dim.')
        p.Define('causal', False, 'Each position attends only to itself and the past.')
        p.Define('atten_dropout_keep_prob', 1.0, 'Keep probability on attention weights.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if p.model_dim < 1 or p.num_heads < 1 or p.model_dim % p.num_heads:
            raise ValueError(f'{self.path}: num_heads={p.num_heads} must be >= 1 and divide '
                             f'model_dim={p.model_dim}')
        # Children are built from fresh params: pass p.dtype on, or a float64 layer
        # would get float32 weights.
        proj = Dense.Params().Set(input_dim=p.model_dim, output_dim=p.model_dim, dtype=p.dtype)
        for name in ('query', 'key', 'value', 'post'):
            self.CreateChild(name, proj)
        self.CreateChild('atten_dropout', Dropout.Params().Set(
            keep_prob=p.atten_dropout_keep_prob, dtype=p.dtype))

    def _Heads(self, theta, x, name):
        """Projection `name` of x [b, t, model_dim] as [b, heads, t, head_dim]."""
        p = self.params
        b, t = _size(x, 0), _size(x, 1)
        y = self.children[name].FProp(theta[name], x)
        return tf.transpose(tf.reshape(y, [b, t, p.num_heads, p.model_dim // p.num_heads]),
                            [0, 2, 1, 3])

    def _Attend(self, theta, q, k, v, allowed):
        """Softmax(q k^T / sqrt(d)) v where `allowed` (bool, broadcast to [b, h, tq, tk])."""
        p = self.params
        b, t = _size(q, 0), _size(q, 2)
        logits = tf.matmul(q, k, transpose_b=True) / math.sqrt(p.model_dim // p.num_heads)
        if allowed is not None:
            logits = tf.where(allowed, logits, tf.constant(-1e9, logits.dtype))
        probs = tf.nn.softmax(logits, axis=-1)
        probs = self.atten_dropout.FProp(theta['atten_dropout'], probs)
        ctx = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [b, t, p.model_dim])
        return self.post.FProp(theta['post'], ctx)

    def FProp(self, theta, x, segment_ids=None):
        """segment_ids [b, t] int: a position attends only within its own segment
        (packed documents); None: the whole row is one segment."""
        p = self.params
        check_last_dim(self, x, p.model_dim, 'model_dim')
        t = _size(x, 1)
        allowed = None
        if p.causal:
            allowed = tf.linalg.band_part(tf.ones([t, t], tf.bool), -1, 0)
        if segment_ids is not None:
            same = tf.equal(segment_ids[:, None, :, None], segment_ids[:, None, None, :])
            allowed = same if allowed is None else tf.logical_and(allowed, same)
        q, k, v = (self._Heads(theta, x, name) for name in ('query', 'key', 'value'))
        return self._Attend(theta, q, k, v, allowed)

    def InitCache(self, batch: int, length: int, dtype: tf.DType) -> dict:
        """An empty key/value cache for `length` positions (create it on the layer's device)."""
        p = self.params
        shape = [batch, p.num_heads, length, p.model_dim // p.num_heads]
        return {'key': tf.zeros(shape, dtype), 'value': tf.zeros(shape, dtype)}

    def ExtendStep(self, theta, x, positions, cache):
        """Causal attention of the new positions x [b, n, d] (at `positions` [b, n] int32)
        over every cached position up to theirs; returns (output, updated cache).

        The new keys and values are written into the cache at their positions (a
        one-hot blend, exact), so a step's cost does not depend on how many steps
        came before it, and its result equals FProp over the whole prefix.
        """
        p = self.params
        if not p.causal:
            raise ValueError(f'{self.path}: ExtendStep needs causal=True (a cached step cannot '
                             'see the future)')
        check_last_dim(self, x, p.model_dim, 'model_dim')
        length = cache['key'].shape[2]
        slots = tf.one_hot(positions, length, dtype=x.dtype)  # [b, n, length]
        keep = (1 - tf.reduce_sum(slots, 1))[:, None, :, None]
        new = {}
        for name in ('key', 'value'):
            written = tf.einsum('bnt,bhnd->bhtd', slots, self._Heads(theta, x, name))
            new[name] = cache[name] * keep + written
        allowed = tf.range(length)[None, None, None, :] <= positions[:, None, :, None]
        out = self._Attend(theta, self._Heads(theta, x, 'query'), new['key'], new['value'],
                           allowed)
        return out, new

    @classmethod
    def FPropMeta(cls, p, x_shape):
        b, t, d = tf.TensorShape(x_shape).as_list()
        return LayerMeta(4 * 2 * b * t * d * d + 2 * 2 * b * t * t * d, tf.TensorShape([b, t, d]))

    @classmethod
    def NumParams(cls, p):
        return 4 * (p.model_dim * p.model_dim + p.model_dim)


class TransformerBlock(BaseLayer):
    """x + Attention(LN(x)), then x + FFN(LN(x)), with residual dropout."""

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
        self.CreateChild('ffn_in', Dense.Params().Set(
            input_dim=p.model_dim, output_dim=p.hidden_dim, activation='relu', dtype=p.dtype))
        self.CreateChild('ffn_out', Dense.Params().Set(
            input_dim=p.hidden_dim, output_dim=p.model_dim, dtype=p.dtype))
        drop = Dropout.Params().Set(keep_prob=p.residual_dropout_keep_prob, dtype=p.dtype)
        self.CreateChild('atten_dropout', drop)
        self.CreateChild('ffn_dropout', drop)

    def _Residuals(self, theta, x, attend):
        """The block around `attend` (LN'd x -> attention output)."""
        def run(name, value):
            return self.children[name].FProp(theta[name], value)

        x = x + run('atten_dropout', attend(run('atten_ln', x)))
        h = run('ffn_out', run('ffn_in', run('ffn_ln', x)))
        return x + run('ffn_dropout', h)

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
        return LayerMeta(meta.flops, dict(shapes))
