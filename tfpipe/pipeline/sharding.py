"""Which model state the data-parallel replicas shard: `task.train.sharding` (ZeRO stages).

- 'none': every replica holds whole weights, gradient sums and optimizer slots.
- 'optimizer_states' (ZeRO stage 1): each replica keeps the slots of 1/R of every
  variable and updates that part; the updated parts are all-gathered.
- 'gradients' (ZeRO stage 2): also 1/R of each summed gradient, reduce-scattered
  after the cell's last backward instead of all-reduced.
- 'weights' (ZeRO stage 3): also 1/R of each weight between steps, all-gathered
  once per step before the cell's first forward (tfpipe/pipeline/sharded_weights.py),
  or with `task.train.regather_per_micro_batch` in each task of a recomputing cell.
In tfpipe/pipeline/sharded_optimizer.py; docs/optimizer_sharding.md.

The older switch `task.train.shard_optimizer_states=True` still means
'optimizer_states' (also at R=1, as before, where it changes nothing); set with
another stage it is a contradiction and refused.
"""
from __future__ import annotations

import difflib

from tfpipe.hyperparams import Params

NONE, OPTIMIZER_STATES, GRADIENTS, WEIGHTS = 'none', 'optimizer_states', 'gradients', 'weights'
STAGES = (NONE, OPTIMIZER_STATES, GRADIENTS, WEIGHTS)


def stage_of(train: Params, count: int) -> str:
    """The stage `train` (task.train) asks for over `count` replicas (in one process, or
    one per trainer client); ValueError (one line) for an unknown or
    unbuilt stage, a contradiction (also regather_per_micro_batch at a stage other than
    'weights'), or a stage at R=1. With expert parallelism P > 1 an expert weight's slots
    (stage 1), gradient sums (stage 2) and weights (stage 3) shard over the R/P replicas
    holding the same experts, in one process or across clients (the strided set of
    clients c' with c' % P == c % P)."""
    name = train.sharding
    if train.regather_per_micro_batch and name != WEIGHTS:
        raise ValueError(f'task.train.regather_per_micro_batch=True with task.train.sharding='
                         f"{name!r}: only stage 3 gathers weights; set sharding='weights' or "
                         'regather_per_micro_batch=False')
    if name not in STAGES:
        close = difflib.get_close_matches(str(name), STAGES, n=1)
        hint = f' (did you mean {close[0]!r}?)' if close else ''
        raise ValueError(f'unknown task.train.sharding={name!r}{hint}: use one of '
                         f'{list(STAGES)}')
    stage = OPTIMIZER_STATES if train.shard_optimizer_states else name
    if train.shard_optimizer_states:
        if name not in (NONE, OPTIMIZER_STATES):
            raise ValueError(f'task.train.shard_optimizer_states=True contradicts task.train.'
                             f'sharding={name!r}: set only task.train.sharding (stage '
                             f"{name!r} shards the optimizer states too)")
        return OPTIMIZER_STATES
    if name != NONE and count == 1:
        raise ValueError(f'task.train.sharding={name!r} with 1 replica does nothing (there is '
                         "nothing to shard over): set task.pipeline.num_replicas (or run "
                         "several trainer clients) above 1, or task.train.sharding='none'")
    return name
