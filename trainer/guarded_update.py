"""The update half of the trainer's step, in a module of its own because the trainer,
`--mode=check_pipeline`, the optimizer tests and the step benchmarks all run this one
function rather than lighter copies of it."""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from tfpipe.optimizers import BaseOptimizer, clip_by_global_norm
from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer


def guarded_update(loss: tf.Tensor, replica_grads: Sequence[dict], clip_norm: Optional[float],
                   optimizers: Sequence[BaseOptimizer] | ShardedOptimizer,
                   replica_variables: Sequence[dict], lr: tf.Tensor,
                   global_step: tf.Variable) -> tf.Tensor:
    """The update half of the trainer's step; returns the global gradient norm.

    Global-norm clipping, then the optimizer's update and `global_step += 1` only
    when loss and norm are finite. The norm needs every gradient at once, which
    sets the step's peak memory, so benchmarks/pipeline_benchmark.py calls this
    same function rather than a lighter copy. With data-parallel replicas there
    is one gradient dict, optimizer and variable dict per replica: the gradients
    are all-reduced, so every replica clips by the same norm and applies the same
    update to its own copy; a ShardedOptimizer updates every replica's part. With
    sharded gradients (`task.train.sharding='gradients'`) `replica_grads` are each
    replica's own sums, not yet summed over replicas: they are reduce-scattered and
    the norm is summed over the parts.
    """
    if isinstance(optimizers, ShardedOptimizer) and optimizers.shards_gradients:
        # ZeRO stage 2: the replicas' own gradient sums, reduce-scattered here.
        clipped, norm = optimizers.ClipParts(optimizers.ReduceScatter(replica_grads), clip_norm)
    else:
        pairs = [clip_by_global_norm(grads, clip_norm) for grads in replica_grads]
        clipped, norm = [grads for grads, _ in pairs], pairs[0][1]
    finite = tf.math.is_finite(loss) & tf.math.is_finite(norm)

    def update():
        if isinstance(optimizers, ShardedOptimizer):
            optimizers.Apply(lr, clipped, replica_variables)
        else:
            for grads, optimizer, variables in zip(clipped, optimizers, replica_variables):
                optimizer.Apply(lr, grads, variables)
        global_step.assign_add(1)
        return tf.constant(True)

    tf.cond(finite, update, lambda: tf.constant(False))
    return norm
