"""Top-k gating of a mixture of experts: which expert slot each token goes to, with what weight.

Pure functions on tensors, computed in float32 (float64 if the logits are): a bfloat16
softmax over experts rounds gates that differ by less than 1/128 to the same value, and
the argmax, the capacity order and the load-balancing loss all read those gates.

The maths, for one group of S tokens (`MoEFeedForward` makes one group of each call,
i.e. of each micro-batch) and E experts, follows GShard (Lepikhin et al. 2020,
Algorithm 1; Lingvo's `gshard_layers.Top2Gating`):

- gates = softmax(router logits) [S, E]; padding tokens get zero gates, no expert and no
  place in any count or mean.
- expert 1 = argmax of the gates. With top_k=1 (Switch Transformer) its combine weight
  is its raw gate g1. With top_k=2, expert 2 = argmax of the gates with expert 1 masked,
  and both gates are normalised by (g1 + g2) *before* any drop (so a token whose second
  expert is dropped keeps weight g1 / (g1 + g2), not 1). Optionally ('random' policy,
  GShard's) the second expert is kept only where uniform < g2 / threshold (threshold 0.5:
  with probability min(1, 2 g2)); the caller draws the uniforms, so these functions stay
  deterministic.
- capacity C = ceil(capacity_factor * top_k * S / E) slots per expert, S the group's
  token count *including* padding (static in training; in evaluation possibly known only
  at run time, as in a SavedModel signature of any batch and length).
- position of a token in its expert = the number of earlier assignments to that expert,
  counting the top-1 assignments of all tokens before any top-2 assignment (an exclusive
  cumulative sum over tokens). An assignment at position >= C is dropped; a token dropped
  by both experts leaves the layer as zeros, and the block's residual passes it on.
- load-balancing loss = E * sum_e m_e * f_e = E^2 * mean_e m_e * f_e, where m_e is the
  mean gate of expert e and f_e the fraction of tokens whose top-1 expert is e, both over
  non-padding tokens and before the capacity drop (Lingvo's and Switch's scaling: 1.0 for
  uniform routing; computed after the drop it would read low, Megatron-LM #1513).
- router z-loss (ST-MoE, Zoph et al. 2022) = mean over non-padding tokens of
  logsumexp(logits)^2.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Route:
    """Each token's k-th choice: `expert` [S] int32, `slot` [S] int32 (its position in
    that expert), `kept` [S] 1.0 where the choice fits the capacity (0 for a dropped or
    padding token, whose expert and slot then mean nothing) and `weight` [S], its
    combine weight (zero where not kept)."""
    expert: tf.Tensor
    slot: tf.Tensor
    kept: tf.Tensor
    weight: tf.Tensor


@dataclasses.dataclass(frozen=True)
class Gating:
    """The routing of one group of S tokens to E experts of C slots each.

    routes: one Route per choice (top_k of them): what the layer dispatches by index.
    load_balancing_loss, z_loss: scalars (unweighted).
    assigned: [E]: the choices of each expert before the capacity drop (a token's
      first and, kept, second choice; padding none), which the routes keep at most C of.
    `dispatch` and `combine` give GShard's dense [S, E, C] form of the same routing.
    """
    routes: tuple
    num_experts: int
    capacity: int | tf.Tensor
    load_balancing_loss: tf.Tensor
    z_loss: tf.Tensor
    assigned: tf.Tensor

    def _dense(self, values) -> tf.Tensor:
        return tf.add_n([
            v[:, None, None] * tf.one_hot(r.expert, self.num_experts, dtype=v.dtype)[:, :, None]
            * tf.one_hot(r.slot, self.capacity, dtype=v.dtype)[:, None, :]
            for r, v in zip(self.routes, values)])

    @property
    def dispatch(self) -> tf.Tensor:
        """[S, E, C] 0/1: token s fills slot c of expert e (GShard's dispatch mask)."""
        return self._dense([r.kept for r in self.routes])

    @property
    def combine(self) -> tf.Tensor:
        """[S, E, C]: the weight of that slot's output in token s's output."""
        return self._dense([r.weight for r in self.routes])


def router_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype gating runs in: float32, or float64 for float64 inputs."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def expert_capacity(capacity_factor: float, num_tokens: int | tf.Tensor, num_experts: int,
                    top_k: int) -> int | tf.Tensor:
    """Slots per expert: ceil(capacity_factor * top_k * num_tokens / num_experts).

    With capacity_factor 1 and perfectly balanced routing every assignment fits. A
    num_tokens known only at run time (an int32 tensor: evaluation of any shape) gives an
    int32 tensor, by the same float64 operations in the same order as the int's.
    """
    if isinstance(num_tokens, int):
        return math.ceil(capacity_factor * top_k * num_tokens / num_experts)
    n = tf.cast(num_tokens, tf.float64)
    return tf.cast(tf.math.ceil(capacity_factor * top_k * n / num_experts), tf.int32)


def load_balancing_loss(gates: tf.Tensor, top1_mask: tf.Tensor,
                        nonpadding: tf.Tensor) -> tf.Tensor:
    """E * sum_e mean_gate_e * top1_fraction_e over the non-padding tokens.

    gates [S, E] (zero on padding), top1_mask [S, E] one-hot before the capacity drop
    (zero on padding), nonpadding [S] 0/1. Only the mean gates carry a gradient.
    """
    num_experts = gates.shape[-1]
    count = tf.maximum(tf.reduce_sum(nonpadding), 1.0)
    mean_gates = tf.reduce_sum(gates, 0) / count
    fraction = tf.reduce_sum(top1_mask, 0) / count
    return num_experts * tf.reduce_sum(mean_gates * fraction)


def routing_statistics(gating: 'Gating') -> dict[str, tf.Tensor]:
    """What routing did to one group, to watch it: 'dropped_fraction', the share of
    the choices (token, expert) over capacity; 'expert_load' [E], each expert's share
    of the choices before the drop (1/E each when balanced)."""
    wanted = tf.reduce_sum(gating.assigned)
    total = tf.maximum(wanted, 1.0)
    kept = tf.add_n([tf.reduce_sum(r.kept) for r in gating.routes])
    return {'dropped_fraction': (wanted - kept) / total,
            'expert_load': gating.assigned / total}


def router_z_loss(logits: tf.Tensor, nonpadding: tf.Tensor) -> tf.Tensor:
    """Mean over non-padding tokens of logsumexp(logits)^2: keeps router logits small."""
    z = tf.reduce_logsumexp(logits, -1)
    count = tf.maximum(tf.reduce_sum(nonpadding), 1.0)
    return tf.reduce_sum(tf.square(z) * nonpadding) / count


def top_k_gating(logits: tf.Tensor, nonpadding: tf.Tensor, top_k: int,
                 capacity: int | tf.Tensor,
                 second_expert_uniform: Optional[tf.Tensor] = None,
                 second_expert_threshold: float = 0.5) -> Gating:
    """GShard's top-2 (or Switch's top-1) gating of router `logits` [S, E] (see module).

    nonpadding [S]: 1 for a real token, 0 for padding. second_expert_uniform [S] in
    [0, 1): keep a token's second expert only where uniform < g2 / threshold; None keeps
    every second expert (Lingvo's 'all' policy).
    """
    if top_k not in (1, 2):
        raise ValueError(f'top_k={top_k}: top-1 (Switch) and top-2 (GShard) gating are built; '
                         'set top_k to 1 or 2')
    logits = tf.convert_to_tensor(logits)
    dtype = logits.dtype
    num_experts = logits.shape[-1]
    if top_k > num_experts:
        raise ValueError(f'top_k={top_k} is above the {num_experts} experts: use top_k <= '
                         'num_experts')
    real = tf.cast(nonpadding, dtype)
    gates = tf.nn.softmax(logits, -1) * real[:, None]
    index_1 = tf.argmax(gates, -1, output_type=tf.int32)
    mask_1 = tf.one_hot(index_1, num_experts, dtype=dtype) * real[:, None]
    gate_1 = tf.reduce_sum(gates * mask_1, -1)
    choices = [(index_1, mask_1, gate_1)]
    if top_k == 2:
        others = gates * (1.0 - mask_1)
        index_2 = tf.argmax(others, -1, output_type=tf.int32)
        mask_2 = tf.one_hot(index_2, num_experts, dtype=dtype) * real[:, None]
        gate_2 = tf.reduce_sum(others * mask_2, -1)
        total = gate_1 + gate_2
        total = tf.where(total > 0, total, tf.ones_like(total))  # padding: both gates 0
        gate_2 /= total
        if second_expert_uniform is not None:
            kept = tf.cast(tf.cast(second_expert_uniform, dtype) <
                           gate_2 / second_expert_threshold, dtype)
            mask_2 *= kept[:, None]
        choices = [(index_1, mask_1, gate_1 / total), (index_2, mask_2, gate_2)]

    routes = []
    filled = tf.zeros([num_experts], dtype)  # slots taken per expert by earlier choices
    assigned = tf.add_n([tf.reduce_sum(mask, 0) for _, mask, _ in choices])
    for index, mask, gate in choices:
        position = tf.cumsum(mask, 0, exclusive=True) + filled[None, :]
        mask = mask * tf.cast(position < tf.cast(capacity, dtype), dtype)
        filled += tf.reduce_sum(mask, 0)
        kept = tf.reduce_sum(mask, -1)
        slot = tf.cast(tf.reduce_sum(position * mask, -1), tf.int32)
        routes.append(Route(expert=index, slot=slot, kept=kept, weight=gate * kept))
    return Gating(routes=tuple(routes), num_experts=num_experts, capacity=capacity,
                  load_balancing_loss=load_balancing_loss(gates, mask_1, real),
                  z_loss=router_z_loss(logits, real), assigned=assigned)
