"""Predicted bytes per device with expert parallelism: a member's experts and its exchange.

Layer profiles (profile.py) are measured with every expert on one device (P=1). With
`expert_parallel=P` each replica holds E/P experts of every MoE layer, so its weights,
gradient sums and optimizer slots of those layers shrink to the member's variables:
`member_profiles` reads them from the built pipeline (replica 0's, every member holds
as many) and scales each profile's parameter and slot bytes to them.

A member's cell cannot run alone to have its working set measured: its all-to-all
waits for the other members. Its experts compute on [E/P, P x C] slots, the size of
P=1's [E, C], so the working sets are measured on a P=1 twin of the pipeline
(`twin`, same body, balance, micro-batches and recompute) and what P adds is the
exchange: per MoE layer and micro-batch the received dispatch [P, E/P, C, D], its
re-layout for the local experts, the outputs' re-layout back and the received combine,
4 x E x C x D values (`all_to_all_bytes`; C from the layer's capacity factor and its
tokens per micro-batch). An estimate from shapes, beside the measured working set.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tfpipe.base_layer import body_metas
from tfpipe.hyperparams import Params
from tfpipe.layers import moe_experts, moe_gating
from tfpipe.pipeline import expert_parallel, partition
from tfpipe.tuning.profile import LayerProfile
from tfpipe.tuning.tensor_parallel_memory import variable_bytes

# The exchange's buffers per MoE layer and micro-batch, in units of E x C x D values.
EXCHANGE_BUFFERS = 4


def degree(pipeline: Params) -> int:
    """The pipeline params' P (1 for a pipeline class without expert parallelism)."""
    return pipeline.expert_parallel if 'expert_parallel' in pipeline else 1


def expert_fractions(pipe: Any, optimizer: Optional[Params] = None
                     ) -> list[tuple[float, float]]:
    """Per body layer of the built `pipe` (any P), the share of its P=1 weight bytes and of
    its P=1 slot bytes (of `optimizer`) that are expert weights: what P divides."""
    p = degree(pipe.params)
    rule = optimizer.Instantiate() if optimizer is not None else None
    out = []
    for layer in (layer for cell in pipe.replica_cells[0] for layer in cell.layers):
        experts = [0.0, 0.0]  # (weights, slots) of the experts at P=1
        whole = [0.0, 0.0]  # the same of every trainable variable
        ids = {id(var) for var in moe_experts.expert_variables(layer)}
        for var in layer.VariablesByPath().values():
            if not var.trainable:
                continue
            expert = id(var) in ids
            shape = [var.shape[0] * p, *var.shape[1:]] if expert else var.shape
            for i, r in enumerate((None, rule)):
                size = variable_bytes(shape, var.dtype, r)
                whole[i] += size
                experts[i] += size if expert else 0.0
        out.append(tuple(e / w if w else 0.0 for e, w in zip(experts, whole)))
    return out


def cut(profiles: Sequence[LayerProfile], fractions: Sequence[tuple[float, float]],
        p: int, sharded_slots: bool = False) -> list[LayerProfile]:
    """`profiles` (P=1) with parameter and slot bytes cut to what one member holds at `p`:
    1/p of each layer's expert share (`fractions`, `expert_fractions`), the rest whole.
    With `sharded_slots` (ZeRO stages 1 and 2) the slots stay P=1's: a member's E/P
    experts' slots shard over the R/P replicas holding them and the others over all R, so
    a replica holds 1/R of P=1's slots, which the memory model's division by R gives."""
    if p == 1:
        return list(profiles)
    return [dataclasses.replace(profile, param_bytes=profile.param_bytes * (1 - w + w / p),
                                slot_bytes=profile.slot_bytes * (
                                    1 if sharded_slots else 1 - s + s / p))
            for profile, (w, s) in zip(profiles, fractions)]


def member_profiles(pipe: Any, profiles: Sequence[LayerProfile],
                    optimizer: Optional[Params] = None,
                    sharded_slots: bool = False) -> list[LayerProfile]:
    """`profiles` (one per body layer, P=1) with parameter and slot bytes cut to what one
    member of the built `pipe` holds: an MoE layer's E/P experts, every other weight whole
    (slots: see `cut`)."""
    if degree(pipe.params) == 1:
        return list(profiles)
    return cut(profiles, expert_fractions(pipe, optimizer), degree(pipe.params), sharded_slots)


def whole_weight_scales(pipe: Any, profiles: Sequence[LayerProfile]) -> list[float]:
    """Per cell of the built `pipe`, its weight bytes at P=1 over a member's (`profiles`,
    cut by `member_profiles`): what ZeRO stage 3 cuts into R parts, since a member's E/P
    experts are cut over the R/P replicas holding them (sharding_plan.weight_parts)."""
    p = degree(pipe.params)
    fractions = expert_fractions(pipe) if p > 1 else [(0.0, 0.0)] * len(profiles)
    out = []
    for start, stop in partition.cell_ranges(pipe.balance):
        member = sum(profiles[i].param_bytes for i in range(start, stop))
        whole = sum(profiles[i].param_bytes / (1 - fractions[i][0] + fractions[i][0] / p)
                    for i in range(start, stop))
        out.append(whole / member if member else 1.0)
    return out


def buffer_bytes(pipeline: Params, micro_batch_shapes: Any) -> list[float]:
    """Per body layer, the bytes of one all-to-all buffer (E x C x D values: a member's
    dispatch or combine) on one micro-batch of `micro_batch_shapes`; 0 for a layer
    without experts. C follows the layer's capacity factor and its tokens."""
    metas = body_metas(pipeline.body, micro_batch_shapes)
    out = []
    for i, p in enumerate(pipeline.body):
        if 'num_experts' not in p:
            out.append(0.0)
            continue
        shapes = micro_batch_shapes if i == 0 else metas[i - 1].out_shapes
        x = tf.TensorShape(shapes['x'] if isinstance(shapes, dict) else shapes)
        tokens = math.prod(x[:-1].as_list())
        capacity = moe_gating.expert_capacity(p.capacity_factor, tokens, p.num_experts,
                                              p.top_k)
        dtype = tf.as_dtype(pipeline.fprop_dtype or p.dtype)
        out.append(float(p.num_experts * capacity * p.model_dim * dtype.size))
    return out


def all_to_all_bytes(pipeline: Params, balance: Sequence[int],
                     micro_batch_shapes: Any) -> list[float]:
    """Per cell (`balance` of the pipeline's params), the bytes its MoE layers' all-to-alls
    add to a backward's working set on one micro-batch of `micro_batch_shapes` (the
    pipeline's input shapes at one micro-batch); zeros at P=1."""
    if degree(pipeline) == 1:
        return [0.0] * len(balance)  # without asking every layer for its FPropMeta
    return exchange_working_bytes(buffer_bytes(pipeline, micro_batch_shapes), balance)


def exchange_working_bytes(buffers: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Per cell of `balance`, EXCHANGE_BUFFERS x its layers' all-to-all buffers."""
    return [EXCHANGE_BUFFERS * sum(buffers[start:stop])
            for start, stop in partition.cell_ranges(balance)]


def twin(pipeline: Params, balance: Sequence[int]) -> Any:
    """A P=1, R=1 pipeline of the same body, `balance`, micro-batches and recompute, whose
    cells run alone: where a member's working sets are measured."""
    return pipeline.Copy().Set(expert_parallel=1, num_replicas=1,
                               balance=list(balance)).Instantiate()


@dataclasses.dataclass(frozen=True)
class ExpertLayers:
    """What expert parallelism changes of a body, for the planner to try each P.

    `fractions`: per body layer, the expert share of its P=1 weight and slot bytes
    (`expert_fractions`); `buffers(micro)`: per body layer, one all-to-all buffer's bytes
    at a micro-batch of `micro` examples (`buffer_bytes`, 0 without experts);
    `num_experts`: E of each MoE layer; `replicas`: R, out of which the groups are carved.
    """

    replicas: int
    num_experts: tuple[int, ...]
    fractions: tuple[tuple[float, float], ...]
    buffers: Callable[[float], Sequence[float]]

    def check(self, p: int) -> int:
        """`p` when it divides R and every E, else the one-line ValueError naming the fix."""
        expert_parallel.check_expert_parallel(p, self.replicas, 'planner')
        for e in self.num_experts:
            expert_parallel.check_num_experts(e, p, 'planner')
        return p

    def degrees(self) -> list[int]:
        """Every P the plan may use: the divisors of R that divide every E."""
        return [p for p in range(1, self.replicas + 1)
                if self.replicas % p == 0 and all(e % p == 0 for e in self.num_experts)]


def expert_layers(pipe: Any, optimizer: Optional[Params], sample: Any,
                  replicas: int) -> Optional[ExpertLayers]:
    """The built `pipe`'s ExpertLayers (None without MoE layers), its buffers at a micro-batch
    of `micro` examples shaped as `sample` (the pipeline's input, any batch; an uneven
    split's largest micro-batch, ceil(micro), counts)."""
    body = pipe.params.body
    num_experts = tuple(p.num_experts for p in body if 'num_experts' in p)
    if not num_experts or 'expert_parallel' not in pipe.params:
        return None
    cache: dict[int, list[float]] = {}

    def buffers(micro: float) -> list[float]:
        rows = math.ceil(micro)
        if rows not in cache:
            cache[rows] = buffer_bytes(pipe.params, tf.nest.map_structure(
                lambda t: tf.TensorShape([rows, *t.shape[1:]]), sample))
        return cache[rows]

    return ExpertLayers(replicas, num_experts, tuple(expert_fractions(pipe, optimizer)),
                        buffers)
