"""The update half of the trainer's step, in a module of its own because the trainer,
`--mode=check_pipeline`, the optimizer tests and the step benchmarks all run this one
function rather than lighter copies of it."""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from tfpipe.optimizers import (BaseOptimizer, clip_by_global_norm, clip_by_norm_of,
                               squared_norm)
from tfpipe.pipeline import across_clients
from tfpipe.pipeline.expert_parallel import is_expert_variable, sum_over_client_group
from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer


def guarded_update(loss: tf.Tensor, replica_grads: Sequence[dict], clip_norm: Optional[float],
                   optimizers: Sequence[BaseOptimizer] | ShardedOptimizer,
                   replica_variables: Sequence[dict], lr: tf.Tensor,
                   global_step: tf.Variable, expert_parallel: int = 1,
                   peers: Optional[across_clients.Peers] = None,
                   device: str = '') -> tf.Tensor:
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
    the norm is summed over the parts. With expert parallelism (`expert_parallel` P > 1 in
    one process) replica r holds the gradients of expert rank r % P only, so the global
    norm sums each rank's expert squares once (replicas 0..P-1) beside replica 0's others:
    the P=1 run's norm, by which every replica clips. Across trainer clients (`peers`
    with P > 1, each client one replica) a client's expert squares are summed over its
    expert group on `device`, beside the all-reduced others: the same norm.
    """
    if isinstance(optimizers, ShardedOptimizer) and optimizers.shards_gradients:
        # ZeRO stage 2: the replicas' own gradient sums, reduce-scattered here.
        clipped, norm = optimizers.ClipParts(optimizers.ReduceScatter(replica_grads), clip_norm)
    elif peers is not None and peers.expert_parallel > 1:
        norm = _norm_over_expert_clients(replica_grads[0], replica_variables[0], peers, device)
        clipped = [clip_by_norm_of(replica_grads[0], clip_norm, norm)]
    elif expert_parallel > 1:
        norm = _norm_over_experts(replica_grads, replica_variables, expert_parallel)
        clipped = [clip_by_norm_of(grads, clip_norm, norm) for grads in replica_grads]
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


def _norm_over_experts(replica_grads: Sequence[dict], replica_variables: Sequence[dict],
                       expert_parallel: int) -> tf.Tensor:
    """The global gradient norm at P > 1: replica 0's non-expert gradients (all-reduced,
    equal on every replica) and each expert rank's gradients once (replicas 0..P-1)."""
    first = replica_variables[0]
    shared = {path: g for path, g in replica_grads[0].items()
              if not is_expert_variable(first.get(path))}
    squares = [squared_norm(shared)]
    for grads, variables in zip(replica_grads[:expert_parallel],
                                replica_variables[:expert_parallel]):
        squares.append(squared_norm({path: g for path, g in grads.items()
                                     if is_expert_variable(variables.get(path))}))
    return tf.sqrt(tf.add_n(squares))


def _norm_over_expert_clients(grads: dict, variables: dict, peers: across_clients.Peers,
                              device: str) -> tf.Tensor:
    """The global gradient norm of one client at P > 1: its non-expert gradients (summed
    over all clients, equal on each) and its expert rank's gradients, whose squares the
    P clients of its expert group add up, so that each rank counts once."""
    expert = {path: g for path, g in grads.items() if is_expert_variable(variables.get(path))}
    shared = {path: g for path, g in grads.items() if path not in expert}
    with tf.device(device):
        experts = sum_over_client_group(peers, squared_norm(expert), device)
        return tf.sqrt(squared_norm(shared) + experts)
