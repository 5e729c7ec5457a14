"""The experts of a mixture-of-experts layer: all of them here, or 1/P over an expert group.

`MoEFeedForward` routes its tokens to expert slots [E, C, D] and hands them to
`ExpertStack.FProp`, which returns the experts' outputs [E, C, D]. Outside an
expert group (P=1) the stack holds all E experts ([E, D, H], [E, H, D]) and runs
them as one batched matmul. Built inside `expert_parallel.building(group)` with P
members (a PipeliningLayer with `expert_parallel=P` does that per replica), member i
holds experts [i*E/P, (i+1)*E/P) only (variables [E/P, ...], under the same names
as the whole ones) and:

1. cuts its slots [E, C, D] into P chunks [E/P, C, D], chunk j for member j's experts;
2. all-to-alls them: it receives, for its own E/P experts, the C slots of each of
   the P members, [P, E/P, C, D], i.e. P*C slots per local expert;
3. runs its experts on them;
4. all-to-alls the outputs back, so each member gets its own slots' outputs [E, C, D]
   in the order it sent them, and combines them as P=1 would.

Routing, capacity and the auxiliary losses stay with the member's own tokens (the
layer computes them before this step), so they do not change with P, and every
expert sees exactly the slots it would see at P=1: the outputs, and each expert's
gradient once summed over the R/P replicas that hold it, are those of P=1. Each
member draws the whole P=1 initial value and keeps its slice, so every P starts
from the same weights.
"""
from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tfpipe import initializers
from tfpipe.base_layer import BaseLayer
from tfpipe.pipeline import expert_parallel

# name -> (shape given E, D, H; initializer)
_WEIGHTS = {
    'wi': (lambda e, d, h: [e, d, h], 'stacked_glorot_uniform'),
    'bi': (lambda e, d, h: [e, h], 'zeros'),
    'wo': (lambda e, d, h: [e, h, d], 'stacked_glorot_uniform'),
    'bo': (lambda e, d, h: [e, d], 'zeros'),
}


class ExpertStack:
    """One MoE layer's experts (or its member's share of them) and how to run them."""

    def __init__(self, layer: BaseLayer, num_experts: int, model_dim: int, hidden_dim: int,
                 activation: Callable[[tf.Tensor], tf.Tensor]):
        self.group = expert_parallel.current_group()
        expert_parallel.check_num_experts(num_experts, self.group.size, layer.path)
        self._name = layer.path
        self._act = activation
        p, rank = self.group.size, self.group.rank
        local = num_experts // p
        self._layer = layer
        for name, (shape_of, init) in _WEIGHTS.items():
            var = layer.CreateVariable(name, shape_of(local, model_dim, hidden_dim), init)
            if p > 1:  # this member's slice of the whole P=1 initial value
                expert_parallel.mark_expert_variable(var)
                whole = initializers.get(init)(
                    shape_of(num_experts, model_dim, hidden_dim), var.dtype,
                    initializers.seed_for(layer._seed, f'{layer.path}/{name}'))
                var.assign(whole[rank * local:(rank + 1) * local])

    @property
    def variables(self) -> list[tf.Variable]:
        """The expert weights as the layer holds them now, at any P (P=1 marks none as
        experts). Read by name, never kept here: ZeRO stage 3 swaps them for parts
        (tfpipe/pipeline/sharded_weights.py), and a reference would keep the whole ones."""
        return [self._layer.theta[name] for name in _WEIGHTS]

    def FProp(self, theta: dict, slots: tf.Tensor) -> tf.Tensor:
        """The experts' outputs [E, C, D] for this member's slots [E, C, D]."""
        p = self.group.size
        if p == 1:
            return self._Run(theta, slots)
        e, c, d = slots.shape
        local = e // p
        received = expert_parallel.all_to_all(tf.reshape(slots, [p, local, c, d]), self.group,
                                              f'{self._name}/dispatch')
        # [P, E/P, C, D] -> per local expert its P*C slots, member by member.
        mine = tf.reshape(tf.transpose(received, [1, 0, 2, 3]), [local, p * c, d])
        outputs = tf.transpose(tf.reshape(self._Run(theta, mine), [local, p, c, d]),
                               [1, 0, 2, 3])
        back = expert_parallel.all_to_all(outputs, self.group, f'{self._name}/combine')
        return tf.reshape(back, [e, c, d])

    def _Run(self, theta: dict, slots: tf.Tensor) -> tf.Tensor:
        """The stacked feed-forwards on slots [e, n, D] of the e experts held here."""
        hidden = self._act(tf.einsum('ecd,edh->ech', slots, theta['wi']) + theta['bi'][:, None])
        return tf.einsum('ech,ehd->ecd', hidden, theta['wo']) + theta['bo'][:, None]


def expert_variables(layer: BaseLayer) -> list[tf.Variable]:
    """The expert weights of every ExpertStack in a built layer and its children, at any P:
    what the planner divides by each P it tries (tfpipe/tuning/expert_parallel_memory.py)."""
    found = [var for value in vars(layer).values() if isinstance(value, ExpertStack)
             for var in value.variables]
    for child in layer.children.values():
        found += expert_variables(child)
    return found
