"""A mixture-of-experts feed-forward (GShard): the drop-in for a Transformer block's FFN.

E experts, each a feed-forward model_dim -> hidden_dim -> model_dim of its own, with
their weights stacked ([E, D, H], [E, H, D]) so that all experts run as one batched
matmul. A learned router [D, E] picks each token's top-1 or top-2 experts
(`moe_gating`, in float32 even when the layer computes in bfloat16); tokens are
dispatched to [E, C, D] expert slots by index (a scatter; GShard's einsum with the
dense dispatch mask costs FLOPs quadratic in the tokens), the experts
run (`moe_experts`: here, or spread over an expert group of replicas by all-to-all),
and each token's output is the combine-weighted sum of its slots' outputs. A
token over capacity gets zeros from a dropped expert; in a Transformer block the
residual around the feed-forward passes it on unchanged.

Capacity is per call, i.e. per micro-batch in a pipeline: C = ceil(capacity_factor *
top_k * S / E) with S the call's tokens (batch x time, padding included), and the
load-balancing statistics are those of the call's tokens too. A pipeline with M
micro-batches therefore routes M groups of S = B/M tokens, not one of B (megablocks #85
asks that this be said). Training and evaluation have separate capacity factors,
picked by `fprop_context.current().training`.

The auxiliary losses (GShard's load balancing, optionally the router z-loss) are
recorded in `fprop_context.current().aux_losses` rather than returned: FProp keeps the
one-tensor output every layer has, so the layer fits `apply_layer`, Sequential,
Residual and a pipeline cell unchanged, and whoever differentiates the forward (one
place, the cell's forward and recomputing backward) collects the sink's `total()` from
all MoE layers at once. Without a sink in the context the losses are not collected.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers import activations, moe_experts, moe_gating
from tfpipe.layers.dense import check_last_dim
from tfpipe.layers.dropout import stateless_uniform_slice

SECOND_EXPERT_POLICIES = ('all', 'random')


def _places(route: moe_gating.Route) -> tf.Tensor:
    return tf.stack([route.expert, route.slot], -1)


def dispatch(x: tf.Tensor, gating: moe_gating.Gating) -> tf.Tensor:
    """Tokens x [S, D] to expert slots [E, C, D]; empty slots 0.

    By index (a scatter of each kept choice), not by GShard's einsum with the dense
    [S, E, C] mask: the einsum's 2 S E C D FLOPs grow with the square of the tokens (C
    grows with S) and were nine tenths of the tiny MoE LM's step. A dropped choice adds
    zeros to a slot of its expert, so it changes nothing."""
    d = x.shape[-1]
    places = tf.concat([_places(r) for r in gating.routes], 0)
    rows = tf.concat([x * tf.cast(r.kept, x.dtype)[:, None] for r in gating.routes], 0)
    return tf.scatter_nd(places, rows, tf.stack([gating.num_experts,
                                                 tf.cast(gating.capacity, tf.int32), d]))


def combine(expert_outputs: tf.Tensor, gating: moe_gating.Gating,
            weighted: bool = True) -> tf.Tensor:
    """Each token's output [S, D]: its kept choices' slot outputs [E, C, D] (a gather),
    weighted by their combine weights (`weighted=False`: by 1)."""
    dtype = expert_outputs.dtype
    return tf.add_n([tf.gather_nd(expert_outputs, _places(r))
                     * tf.cast(r.weight if weighted else r.kept, dtype)[:, None]
                     for r in gating.routes])


class MoEFeedForward(BaseLayer):
    """GShard's mixture-of-experts feed-forward over [..., model_dim] (see module)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('model_dim', 0, 'Width of the input and output.')
        p.Define('hidden_dim', 0, 'Hidden width of each expert.')
        p.Define('num_experts', 0, 'Number of experts E.')
        p.Define('top_k', 2, 'Experts per token: 2 (GShard) or 1 (Switch Transformer).')
        p.Define('capacity_factor', 2.0, 'Training capacity per expert, per call (micro-batch): '
                 'C = ceil(capacity_factor * top_k * tokens / num_experts); > 0.')
        p.Define('eval_capacity_factor', 2.0, 'capacity_factor in evaluation; > 0.')
        p.Define('second_expert_policy', 'all', "Top-2 only: 'all' dispatches every token to "
                 "its second expert; 'random' (GShard) keeps it with probability min(1, g2 / "
                 'second_expert_threshold) in training (all of them in evaluation).')
        p.Define('second_expert_threshold', 0.5, "The 'random' policy's threshold.")
        p.Define('aux_loss_weight', 0.01, 'Weight of the load-balancing loss in the training '
                 'loss (GShard, Switch: 1e-2).')
        p.Define('z_loss_weight', 0.0, 'Weight of the router z-loss (ST-MoE: 1e-3); 0: off.')
        p.Define('activation', 'relu', f'Activation of the experts\' hidden layer, one of '
                 f'{activations.NAMES}.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        for name in ('model_dim', 'hidden_dim', 'num_experts'):
            if p.Get(name) < 1:
                raise ValueError(f'{self.path}: {name}={p.Get(name)} must be >= 1; set it in '
                                 'the MoEFeedForward params')
        if p.top_k not in (1, 2):
            raise ValueError(f'{self.path}: top_k={p.top_k}: set top_k=2 (GShard) or 1 (Switch)')
        if p.top_k > p.num_experts:
            raise ValueError(f'{self.path}: top_k={p.top_k} is above num_experts='
                             f'{p.num_experts}: set top_k <= num_experts or add experts')
        for name in ('capacity_factor', 'eval_capacity_factor'):
            if not p.Get(name) > 0:
                raise ValueError(f'{self.path}: {name}={p.Get(name)} must be > 0 (1.0 fits '
                                 'perfectly balanced routing; 2.0 is usual)')
        if p.second_expert_policy not in SECOND_EXPERT_POLICIES:
            raise ValueError(f'{self.path}: second_expert_policy={p.second_expert_policy!r}: '
                             f'use one of {SECOND_EXPERT_POLICIES}')
        self._act = activations.get(p.activation, self.path)
        self._key = zlib.crc32(f'{self._seed}/{self.path}'.encode())
        e, d, h = p.num_experts, p.model_dim, p.hidden_dim
        self.CreateVariable('router_w', [d, e])
        # All E experts, or this replica's E/P of them under expert parallelism.
        self._experts = moe_experts.ExpertStack(self, e, d, h, self._act)

    def FProp(self, theta, inputs, paddings: Optional[tf.Tensor] = None):
        """inputs [..., model_dim] -> the experts' output of the same shape.

        paddings (inputs' shape without the last dimension; 1 = padding, 0 = a real
        token; None: no padding): padding tokens are never routed, take no slot and
        count in no statistic; their output is zeros. For a packed activation pass
        `tf.cast(segment_ids == 0, dtype)`.
        """
        p = self.params
        check_last_dim(self, inputs, p.model_dim, 'model_dim')
        shape = inputs.shape
        static = shape.is_fully_defined()
        ctx = fprop_context.current()
        if shape.rank is None or shape.rank < 2 or (
                not static and (ctx.training or self._experts.group.size > 1)):
            raise ValueError(f'{self.path}: training and expert parallelism need a static '
                             f'input shape [batch, ..., model_dim] (the capacity and the '
                             f'all-to-all are sized per call), got {shape}; give the input a '
                             'fixed batch and length')
        # Evaluation on one device takes any shape (a SavedModel's serving signature):
        # the capacity then follows the call's token count at run time.
        tokens = math.prod(shape[:-1]) if static else tf.reduce_prod(tf.shape(inputs)[:-1])
        x = tf.reshape(inputs, [-1, p.model_dim])
        real = tf.ones([tokens]) if paddings is None else 1.0 - tf.reshape(
            tf.cast(paddings, tf.float32), [-1])
        gating = self._Route(theta, x, real, tokens // shape[0] if static else None)
        slots = dispatch(x, gating)
        outputs = self._experts.FProp(theta, slots)
        sink = fprop_context.current().aux_losses
        if sink is not None:
            sink.record(self, 'load_balancing_loss', gating.load_balancing_loss,
                        p.aux_loss_weight)
            if p.z_loss_weight:
                sink.record(self, 'z_loss', gating.z_loss, p.z_loss_weight)
            for name, value in moe_gating.routing_statistics(gating).items():
                sink.record_statistic(self, name, value)
        return tf.reshape(combine(outputs, gating),
                          shape if static else tf.shape(inputs))

    def _Route(self, theta, x: tf.Tensor, real: tf.Tensor,
               per_example: Optional[int]) -> moe_gating.Gating:
        """The gating of the tokens x [S, D] (real [S]: 1 for a non-padding token;
        per_example tokens to an example, for the 'random' policy's draw in training;
        None where S is known only at run time, in evaluation)."""
        p = self.params
        dtype = moe_gating.router_dtype(x.dtype)
        logits = tf.matmul(tf.cast(x, dtype), tf.cast(theta['router_w'], dtype))
        ctx = fprop_context.current()
        factor = p.capacity_factor if ctx.training else p.eval_capacity_factor
        tokens = x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]
        capacity = moe_gating.expert_capacity(factor, tokens, p.num_experts, p.top_k)
        uniform = None
        if p.top_k == 2 and p.second_expert_policy == 'random' and ctx.training:
            if ctx.step is None:
                raise ValueError(
                    f"{self.path}: second_expert_policy='random' in training needs the global "
                    'step to draw: wrap the call in `with tfpipe.fprop_context.training('
                    'step=global_step):`')
            # Per token of the mini-batch, like Dropout's masks: the same draw whatever
            # the micro-batching, and again in a recomputed forward.
            uniform = stateless_uniform_slice(self._key, ctx.step,
                                              ctx.example_offset * per_example, tokens)
        return moe_gating.top_k_gating(logits, tf.cast(real, dtype), p.top_k, capacity,
                                       uniform, p.second_expert_threshold)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        """Router, experts (over all C slots) and the combine's weighting at the training
        capacity (dispatch and combine move rows by index: no FLOPs); model FLOPs: the
        router and each token's top_k experts, as a dense model of the active parameters
        would run them (the empty slots are the implementation's: HFU, not MFU)."""
        x_shape = tf.TensorShape(x_shape)
        tokens = math.prod(x_shape[:-1].as_list())
        e, d, h = p.num_experts, p.model_dim, p.hidden_dim
        c = moe_gating.expert_capacity(p.capacity_factor, tokens, e, p.top_k)
        router = 2 * tokens * d * e
        flops = router + 2 * 2 * e * c * d * h + 2 * p.top_k * tokens * d
        return LayerMeta(flops, x_shape, router + p.top_k * tokens * 2 * 2 * d * h)

    @classmethod
    def NumParams(cls, p):
        e, d, h = p.num_experts, p.model_dim, p.hidden_dim
        return d * e + e * (d * h + h + h * d + d)
