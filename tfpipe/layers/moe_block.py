"""A packed causal Transformer block whose feed-forward is a mixture of experts.

GShard's and Switch Transformer's language models replace the feed-forward of every
other block by an MoE layer; this is that block. Everything but the feed-forward is
PackedTransformerBlock's (attention within segments, residuals, KV-cached
ExtendStep). Padding (segment id 0) is never routed nor counted in the auxiliary
losses, which the layer records in the context's sink (tfpipe/pipeline/aux_losses.py
carries them through a pipeline).
"""
from __future__ import annotations

import tensorflow as tf

from tfpipe.base_layer import sum_metas
from tfpipe.layers.attention import MultiHeadAttention, PackedTransformerBlock
from tfpipe.layers.mixture_of_experts import MoEFeedForward

# The MoE params the block passes on (hidden_dim is each expert's width).
MOE_PARAMS = ('num_experts', 'top_k', 'capacity_factor', 'eval_capacity_factor',
              'aux_loss_weight', 'z_loss_weight')


class PackedMoETransformerBlock(PackedTransformerBlock):
    """PackedTransformerBlock with an MoEFeedForward of `num_experts` experts of width
    `hidden_dim` as its feed-forward (child 'moe')."""

    @classmethod
    def Params(cls):
        p = super().Params()
        moe = MoEFeedForward.Params()
        for name in MOE_PARAMS:
            p.Define(name, moe.Get(name), f'The MoE feed-forward\'s {name}.')
        return p

    def _CreateFeedForward(self) -> None:
        p = self.params
        self.CreateChild('moe', self._MoEParams(p).Set(dtype=p.dtype))

    def _FeedForward(self, theta, x, paddings=None):
        return self.moe.FProp(theta['moe'], x, paddings)

    def FProp(self, theta, act):
        segment_ids = act['segment_ids']
        paddings = tf.cast(tf.equal(segment_ids, 0), act['x'].dtype)
        x = self._Residuals(theta, act['x'], lambda h: self.atten.FProp(theta['atten'], h,
                                                                        segment_ids), paddings)
        return {**act, 'x': x}

    @classmethod
    def FPropMeta(cls, p, shapes):
        b, t, d = tf.TensorShape(shapes['x']).as_list()
        return sum_metas([MultiHeadAttention.FPropMeta(p, shapes['x']),
                          MoEFeedForward.FPropMeta(cls._MoEParams(p), shapes['x'])],
                         dict(shapes), 20 * b * t * d)

    @classmethod
    def NumParams(cls, p):
        return (MultiHeadAttention.NumParams(p) + 4 * p.model_dim +
                MoEFeedForward.NumParams(cls._MoEParams(p)))

    @classmethod
    def _MoEParams(cls, p):
        """The 'moe' child's params from the block's."""
        moe = MoEFeedForward.Params().Set(model_dim=p.model_dim, hidden_dim=p.hidden_dim)
        for name in MOE_PARAMS:
            moe.Set(**{name: p.Get(name)})
        return moe
