"""What each ZeRO stage (`task.train.sharding`) changes in a planned configuration.

The planner plays one replica's pipeline; with R > 1 replicas each candidate layout is
tried at every stage the trainer builds for it (`stages`), its predicted peak and step
time adjusted here per cell (the planner puts one cell on each device):

memory at the step's peak (as `inspect_model` predicts it, docs/optimizer_sharding.md):
  slots at 1/R from stage 1 on; gradient sums whole at every stage, because a pipeline
  cell accumulates its micro-batches' gradients whole until its last backward (stage 2's
  1/R exists only between the reduce-scatter and the update); stage 3 keeps 1/R of the
  weights between steps and gathers the whole cell for the step, so its peak holds
  W/R + W: at the peak it costs W/R more than stage 2, and saves only between steps
  (`between_steps`).
time: each stage's collectives on a cell's weights, each costed like the T and P
  collectives (`simulator.collective_time`): the hand-over latency per collective plus
  the bytes each device sends over `bandwidth`. 'none' all-reduces the gradient sums
  (a ring: 2 (R-1)/R of the bytes); stage 1 adds the all-gather of the updated parts
  ((R-1)/R); stage 2 reduce-scatters (an all-to-all and a sum: (R-1)/R) and all-gathers;
  stage 3 all-gathers the weights before the step and reduce-scatters after it. The
  planner adds the difference from 'none' (which it never costed, so an R=1 plan and
  'none' stay as before), the largest over the cells: cell 0's come last in the step,
  the others' overlap the pipeline's drain and fill only partly. The update's saving
  (each replica updates 1/R) is not modelled. With expert parallelism P > 1 a member's
  expert slots, gradient sums and (stage 3) weights shard over its R/P group
  (`peak_delta`), while the collectives are costed over R on the member's weights, as at
  P=1: an expert part's all-gather among R/P members is overstated.
"""
from __future__ import annotations

from typing import Optional, Sequence

from tfpipe.pipeline.sharding import GRADIENTS, NONE, OPTIMIZER_STATES, STAGES, WEIGHTS
from tfpipe.tuning import simulator

# (collectives, ring-equivalent multiples of (R-1)/R of a cell's weight bytes) per stage.
_COLLECTIVES = {NONE: (1, 2), OPTIMIZER_STATES: (2, 3), GRADIENTS: (2, 2), WEIGHTS: (2, 2)}


def stages(replicas: int) -> tuple[str, ...]:
    """The stages to try: none at R=1 (nothing to shard over), else every stage. With T > 1
    a cell's weights per device are its shards' (`LayerProfile.per_device`), which stage 3
    cuts into R parts and gathers among the R replicas holding the same shard; with P > 1
    an expert weight into R/P parts among the replicas holding the same experts, as its
    peak is costed here (`peak_delta`); in one process and across trainer clients."""
    return STAGES if replicas > 1 else ()


def peak_delta(stage: str, replicas: int, weights: float, slots: float,
               whole_slots: Optional[float] = None,
               whole_weights: Optional[float] = None) -> float:
    """Bytes a cell's device holds at the step's peak at `stage` minus at 'none' (the cell's
    `weights` and `slots` bytes per device, unsharded). With expert parallelism P > 1,
    `slots` and `weights` are what a member holds unsharded (its E/P experts' and every
    other) and `whole_slots` and `whole_weights` the cell's at P=1: a member's expert
    slots shard over the R/P replicas holding them and the others over R, so from stage 1
    on it holds whole_slots / R (tfpipe/tuning/expert_parallel_memory.cut); at stage 3
    its weight parts likewise whole_weights / R, beside the gathered cell."""
    if stage == NONE:
        return 0.0
    held = (slots if whole_slots is None else whole_slots) / replicas
    return held - slots + weight_parts(stage, replicas, weights, whole_weights)


def weight_parts(stage: str, replicas: int, weights: float,
                 whole_weights: Optional[float] = None) -> float:
    """Bytes of the weight parts a device keeps at `stage`: 1/R of its cell's weights at
    stage 3 (beside the gathered cell during a step, alone between steps), else 0. With
    expert parallelism `whole_weights` is the cell's at P=1 (see `peak_delta`)."""
    if stage != WEIGHTS:
        return 0.0
    return (weights if whole_weights is None else whole_weights) / replicas


def between_steps(stage: str, replicas: int, weights: float, slots: float,
                  whole_weights: Optional[float] = None) -> tuple[float, float]:
    """(weights, slots) bytes a device holds between steps at `stage` (the gradient sums
    are freed after the update at every stage; `whole_weights` as in `weight_parts`)."""
    return (weight_parts(stage, replicas, weights, whole_weights) if stage == WEIGHTS
            else weights, slots if stage == NONE else slots / replicas)


def extra_seconds(stage: str, replicas: int, cell_weights: Sequence[float],
                  device: simulator.DeviceModel) -> float:
    """Seconds the stage's collectives add to a step over 'none''s all-reduce."""
    def seconds(name: str, weights: float) -> float:
        count, multiple = _COLLECTIVES[name]
        time = count * device.latency
        if device.bandwidth:
            time += multiple * (replicas - 1) / replicas * weights / device.bandwidth
        return time
    return max((seconds(stage, w) - seconds(NONE, w) for w in cell_weights), default=0.0)


def order(stage: Optional[str]) -> int:
    """Ties between stages go to the one that shards least."""
    return STAGES.index(stage or NONE)
