"""Floating-point operations of one training step: what MFU and HFU divide by time.

Model FLOPs follow PaLM's appendix B: the work the model needs per step,
whatever the implementation does to get there, so that two frameworks (or two
recompute policies) compare on one scale. A training step is one forward and
one backward, and the backward of a matmul costs twice its forward, so

    model FLOPs = 3 x forward FLOPs.

The forward FLOPs are each layer's `FPropMeta` (a multiply-add counts 2) at the
step's input shapes. For a Transformer block that is 2 x (4d^2 + 2dh) per token for
the weights and 4td for the attention scores and their weighted sum, so 3 x
forward is PaLM's 6N + 12LHQT per token, plus LayerNorm and residual adds (20d
per token, under 0.5% of a block of width 768). An embedding lookup costs
nothing; a tied softmax's matmul is counted where it runs.

Hardware FLOPs add what the implementation really runs beyond that: one more
forward of every cell that recomputes its activations in the backward pass
(recompute 'always' makes HFU 4/3 of MFU), and the work a layer runs beyond its
model FLOPs (`LayerMeta.model_flops`): a mixture of experts counts its router and
each token's top_k experts as model FLOPs (the dense model of its active
parameters, as GShard and Switch report), while the empty capacity slots its
experts also compute are hardware FLOPs only. Counting them (and the einsum
dispatch it then ran) as model FLOPs made the tiny MoE LM report 51% MFU beside
the dense LM's 8% at the same tokens/s.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import tensorflow as tf

from tfpipe.base_layer import body_metas
from tfpipe.hyperparams import Params
from tfpipe.pipeline.cell import recompute_flags


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step over the inputs it was computed for."""

    model: float
    hardware: float


def step_flops(body: Sequence[Params], balance: Sequence[int], recompute: str,
               input_shapes: Any) -> StepFlops:
    """Model and hardware FLOPs of one step of a pipeline's body at `input_shapes`.

    `input_shapes` is the structure the pipeline takes (a shape or a dict of
    them) with the batch that the step processes: the whole mini-batch of this
    process, every replica's share and every micro-batch included. Raises
    NotImplementedError (naming the layer) when a layer has no `FPropMeta`.
    """
    metas = body_metas(body, input_shapes)
    forward = [float(meta.flops) for meta in metas]
    recomputed, start = 0.0, 0
    for size, again in zip(balance, recompute_flags(recompute, len(balance))):
        if again:
            recomputed += sum(forward[start:start + size])
        start += size
    return StepFlops(model=3 * sum(float(meta.needed_flops) for meta in metas),
                     hardware=3 * sum(forward) + recomputed)


def input_shapes(inputs: Any) -> Any:
    """The shapes of a pipeline input structure, for `step_flops`."""
    return tf.nest.map_structure(lambda t: tf.TensorShape(t.shape), inputs)


def utilisation(flops: float, steps_per_sec: float, peak_flops: Optional[float]
                ) -> Optional[float]:
    """The fraction of `peak_flops` (FLOP/s) that `flops` per step at that rate uses."""
    if not peak_flops:
        return None
    return flops * steps_per_sec / peak_flops
