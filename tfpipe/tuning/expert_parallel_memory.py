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
from typing import Any, Optional, Sequence

import tensorflow as tf

from tfpipe.base_layer import body_metas
from tfpipe.hyperparams import Params
from tfpipe.layers import moe_gating
from tfpipe.pipeline import expert_parallel
from tfpipe.tuning.profile import LayerProfile
from tfpipe.tuning.tensor_parallel_memory import variable_bytes

# The exchange's buffers per MoE layer and micro-batch, in units of E x C x D values.
EXCHANGE_BUFFERS = 4


def degree(pipeline: Params) -> int:
    """The pipeline params' P (1 for a pipeline class without expert parallelism)."""
    return pipeline.expert_parallel if 'expert_parallel' in pipeline else 1


def member_profiles(pipe: Any, profiles: Sequence[LayerProfile],
                    optimizer: Optional[Params] = None) -> list[LayerProfile]:
    """`profiles` (one per body layer, P=1) with parameter and slot bytes cut to what one
    member of the built `pipe` holds: an MoE layer's E/P experts, every other weight whole."""
    if degree(pipe.params) == 1:
        return list(profiles)
    rule = optimizer.Instantiate() if optimizer is not None else None
    layers = [layer for cell in pipe.replica_cells[0] for layer in cell.layers]
    out = []
    for profile, layer in zip(profiles, layers):
        held = [0.0, 0.0]  # (weights, slots) of this member
        whole = [0.0, 0.0]  # the same at P=1
        for var in layer.VariablesByPath().values():
            if not var.trainable:
                continue
            shape = var.shape
            if expert_parallel.is_expert_variable(var):
                shape = [var.shape[0] * degree(pipe.params), *var.shape[1:]]
            for i, r in enumerate((None, rule)):
                held[i] += variable_bytes(var.shape, var.dtype, r)
                whole[i] += variable_bytes(shape, var.dtype, r)
        weights, slots = (h / w if w else 1.0 for h, w in zip(held, whole))
        out.append(dataclasses.replace(profile, param_bytes=profile.param_bytes * weights,
                                       slot_bytes=profile.slot_bytes * slots))
    return out


def all_to_all_bytes(pipeline: Params, balance: Sequence[int],
                     micro_batch_shapes: Any) -> list[float]:
    """Per cell (`balance` of the pipeline's params), the bytes its MoE layers' all-to-alls
    add to a backward's working set on one micro-batch of `micro_batch_shapes` (the
    pipeline's input shapes at one micro-batch); zeros at P=1."""
    if degree(pipeline) == 1:
        return [0.0] * len(balance)  # without asking every layer for its FPropMeta
    out, start = [], 0
    metas = body_metas(pipeline.body, micro_batch_shapes)
    for size in balance:
        total = 0.0
        for i in range(start, start + size):
            p = pipeline.body[i]
            if 'num_experts' not in p:
                continue
            shapes = micro_batch_shapes if i == 0 else metas[i - 1].out_shapes
            x = tf.TensorShape(shapes['x'] if isinstance(shapes, dict) else shapes)
            tokens = math.prod(x[:-1].as_list())
            capacity = moe_gating.expert_capacity(p.capacity_factor, tokens, p.num_experts,
                                                  p.top_k)
            dtype = tf.as_dtype(pipeline.fprop_dtype or p.dtype)
            total += EXCHANGE_BUFFERS * p.num_experts * capacity * p.model_dim * dtype.size
        out.append(total)
        start += size
    return out


def twin(pipeline: Params, balance: Sequence[int]) -> Any:
    """A P=1, R=1 pipeline of the same body, `balance`, micro-batches and recompute, whose
    cells run alone: where a member's working sets are measured."""
    return pipeline.Copy().Set(expert_parallel=1, num_replicas=1,
                               balance=list(balance)).Instantiate()
