"""Multi-head self-attention and a pre-LayerNorm Transformer block."""
from __future__ import annotations

import math

import tensorflow as tf

from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers.dense import Dense, check_last_dim
from tfpipe.layers.dropout import Dropout
from tfpipe.layers.normalization import LayerNorm


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

    def FProp(self, theta, x):
        p = self.params
        check_last_dim(self, x, p.model_dim, 'model_dim')
        # A served batch has no static size (tfpipe/export.py); the pipeline's always does.
        b = x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]
        t = x.shape[1]
        head_dim = p.model_dim // p.num_heads

        def heads(name):
            y = self.children[name].FProp(theta[name], x)
            return tf.transpose(tf.reshape(y, [b, t, p.num_heads, head_dim]), [0, 2, 1, 3])

        q, k, v = heads('query'), heads('key'), heads('value')
        logits = tf.matmul(q, k, transpose_b=True) / math.sqrt(head_dim)
        if p.causal:
            allowed = tf.linalg.band_part(tf.ones([t, t], tf.bool), -1, 0)
            logits = tf.where(allowed, logits, tf.constant(-1e9, logits.dtype))
        probs = tf.nn.softmax(logits, axis=-1)
        probs = self.atten_dropout.FProp(theta['atten_dropout'], probs)
        ctx = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [b, t, p.model_dim])
        return self.post.FProp(theta['post'], ctx)

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

    def FProp(self, theta, x):
        def run(name, value):
            return self.children[name].FProp(theta[name], value)

        h = run('atten', run('atten_ln', x))
        x = x + run('atten_dropout', h)
        h = run('ffn_out', run('ffn_in', run('ffn_ln', x)))
        return x + run('ffn_dropout', h)

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
