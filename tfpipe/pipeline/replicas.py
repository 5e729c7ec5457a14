"""Data parallel x pipeline: R replicas of the K cells, gradients all-reduced per cell.

With `num_replicas=R` a PipeliningLayer holds R copies of its K cells on R*K
devices. Replica 0's layers are the layer's own children: they alone make up
`theta`, `VariablesByPath` and checkpoints, so a checkpoint holds one copy of
each variable and restores into any R and K. Replicas 1..R-1 are *mirrors*
built from the same params under the same layer paths, hence with the same
initial weights (initialisers are seeded by path).

A mini-batch is cut into R*M micro-batches exactly as an R=1 pipeline with
R*M micro-batches would cut it, and replica r runs micro-batches
[r*M, (r+1)*M) (fewer when the batch is small). So one replicated step is the
step of one pipeline over the whole mini-batch: the loss is averaged over all
N examples, Dropout masks keep their global example index and BatchNorm's
moving statistics combine every replica's micro-batches.

Each cell's weight gradients are summed over the R devices that hold that
cell with TensorFlow's collective all-reduce (`collective_ops.all_reduce`:
a ring on CPUs, NCCL on GPUs where TensorFlow picks it). A ring moves
2(R-1)/R of the gradient bytes in and out of every device whatever R is,
where gathering on one device would move R-1 copies into that device. The
gradients of one cell are packed into one buffer per dtype, so a step
launches one collective per (cell, dtype) rather than one per variable.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Callable, ContextManager, Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops  # the public tf.distribute wraps these

from tfpipe import fprop_context
from tfpipe.base_layer import BaseLayer
from tfpipe.pipeline import microbatch, partition
from tfpipe.pipeline import ties as ties_lib
from tfpipe.pipeline.cell import Cell, cell_dtypes

_lock = threading.Lock()
_group_keys: dict[tuple[str, ...], int] = {}
# Keys of this process's groups of its own devices (a replica's, a tensor-parallel cell's):
# from 2**30 up, above the keys of the groups that span trainer clients (across_clients.
# group_key), and 2**20 apart per task of the group's first device, because the collective
# leader (client 0) resolves every client's groups by key: trainer clients of a tensor-
# parallel pipeline each have a cell group of their own devices, which a shared key would
# join into one (and the first device's group across clients, at a key below 2**30).
_FIRST_LOCAL_GROUP_KEY, _GROUP_KEYS_PER_TASK = 2 ** 30, 2 ** 20
_instance_keys = itertools.count(1)


def mirror_cells(pipe: BaseLayer, pipeline_params: Any, balance: Sequence[int],
                 devices: Sequence[Sequence[str]], recompute: Sequence[bool],
                 ties: Sequence[ties_lib.Tie] = (),
                 building: Callable[[Sequence[str]], ContextManager] = None) -> list[Cell]:
    """One replica's cells: the body's layers built again on `devices` (per device
    slot, its tensor-parallel devices, home first), not adopted (cell k on slot k
    mod K, as the pipeline's own cells), tied among themselves as the pipeline's own
    layers are. `building(devices)`: the scope a slot's layers are built in."""
    cell_layers = []
    for k, (start, stop) in enumerate(partition.cell_ranges(balance)):
        slot = devices[k % len(devices)]
        with tf.device(slot[0]), (building or _no_scope)(slot):
            cell_layers.append([pipe.BuildDetachedChild(p.name, p)
                                for p in pipeline_params.body[start:stop]])
    ties_lib.tie(ties, cell_layers)
    return [Cell(k, devices[k % len(devices)][0], layers, recompute[k],
                 *cell_dtypes(k, len(balance), pipeline_params), ties=ties,
                 shard_devices=devices[k % len(devices)])
            for k, layers in enumerate(cell_layers)]


def _no_scope(devices: Sequence[str]) -> ContextManager:
    return contextlib.nullcontext()


def theta_of(cells: Sequence[Cell]) -> dict:
    """The theta of a replica's cells, shaped like the pipeline's own theta."""
    return {layer.params.name: layer.theta for cell in cells for layer in cell.layers}


def variables_of(cells: Sequence[Cell]) -> dict[str, tf.Variable]:
    """Every variable of a replica's cells by layer path (the checkpoint's keys)."""
    out: dict[str, tf.Variable] = {}
    for cell in cells:
        for layer in cell.layers:
            out.update(layer.VariablesByPath())
    return out


def micro_batch_groups(batch: int, num_micro_batches: int, num_replicas: int,
                       where: str) -> list[range]:
    """Which of the R*M micro-batches each replica runs, as index ranges.

    Contiguous and in order, so replica r's examples follow replica r-1's and
    the merge of all outputs is the mini-batch order. A batch smaller than R
    would leave a replica idle with nothing to all-reduce: refused.
    """
    if batch < num_replicas:
        raise ValueError(f'{where}: a batch of {batch} example(s) cannot feed num_replicas='
                         f'{num_replicas}: give each replica at least one example (a larger '
                         'batch) or use fewer replicas')
    count = len(microbatch.micro_batch_sizes(batch, num_replicas * num_micro_batches))
    groups, start = [], 0
    for size in microbatch.micro_batch_sizes(count, num_replicas):
        groups.append(range(start, start + size))
        start += size
    return groups


def examples_of_group(batch: int, num_micro_batches: int, num_replicas: int, replica: int,
                      where: str) -> range:
    """The examples of the mini-batch that `replica` runs: its group's micro-batches.

    Contiguous, so an input can hand each replica (or trainer client) only its
    own examples and the micro-batches cut from them are the very ones cut
    from the whole mini-batch.
    """
    group = micro_batch_groups(batch, num_micro_batches, num_replicas, where)[replica]
    sizes = microbatch.micro_batch_sizes(batch, num_replicas * num_micro_batches)
    start = sum(sizes[:group.start])
    return range(start, start + sum(sizes[group.start:group.stop]))


def group_key(devices: Sequence[str]) -> int:
    """One collective group per set of devices, stable for the life of the process, its key
    no other process's (trainer client's) group has."""
    key = tuple(devices)
    with _lock:
        if key not in _group_keys:
            task = tf.DeviceSpec.from_string(key[0]).task or 0
            _group_keys[key] = (_FIRST_LOCAL_GROUP_KEY + task * _GROUP_KEYS_PER_TASK
                                + len(_group_keys))
        return _group_keys[key]


def new_instance_key() -> int:
    """A collective instance key no other collective of this process uses."""
    with _lock:
        return next(_instance_keys)


def all_reduce_sum(per_replica: Sequence[Sequence[tf.Tensor]],
                   devices: Sequence[str]) -> list[list[tf.Tensor]]:
    """Sums tensor i over replicas; replica r gets the sum on `devices[r]`.

    Tensors of one dtype are packed into one flat buffer, reduced by one
    collective and cut back, so every replica receives the same bits.
    """
    num = len(per_replica)
    if num == 1:
        return [list(per_replica[0])]
    out: list[list] = [[None] * len(per_replica[0]) for _ in range(num)]
    # Per dtype and per the devices the tensors lie on: a weight shard's gradients
    # (tensor parallelism) are reduced on the shard's devices, never the cell's.
    by_dtype: dict[tuple, list[int]] = {}
    for i, t in enumerate(per_replica[0]):
        where = tuple(_device(per_replica[r][i]) or devices[r] for r in range(num))
        by_dtype.setdefault((t.dtype, where), []).append(i)
    for (_, where), indices in by_dtype.items():
        group = group_key(where)
        shapes = [per_replica[0][i].shape for i in indices]
        sizes = [s.num_elements() for s in shapes]
        instance = new_instance_key()
        for r in range(num):
            with tf.device(where[r]), tf.name_scope(f'all_reduce_{r}'):
                packed = tf.concat([tf.reshape(per_replica[r][i], [-1]) for i in indices], 0)
                summed = collective_ops.all_reduce(packed, num, group, instance, 'Add', 'Id',
                                                   communication_hint='auto')
                for i, piece, shape in zip(indices, tf.split(summed, sizes), shapes):
                    out[r][i] = tf.reshape(piece, shape)
    return out


def sum_to(per_replica: Sequence[Sequence[tf.Tensor]], device: str) -> list[tf.Tensor]:
    """Sums tensor i over replicas on one device (the broadcast-theta form's gradient)."""
    if len(per_replica) == 1:
        return list(per_replica[0])
    out = []
    for parts in zip(*per_replica):  # a weight shard's sum on replica 0's shard device
        with tf.device(_device(parts[0]) or device), tf.name_scope('replica_sum'):
            out.append(tf.add_n(list(parts)))
    return out


def _device(t: tf.Tensor) -> str:
    """A graph tensor's device as set when built ('' eagerly, or when unset)."""
    return '' if tf.executing_eagerly() else getattr(t, 'device', '')


def apply_batch_stats(replica_cells: Sequence[Sequence[Cell]],
                      sinks: Sequence[Sequence[fprop_context.BatchStatsSink]]) -> None:
    """One moving-statistics update per BatchNorm from every replica's micro-batches.

    Every replica applies the same combined statistics, in global micro-batch
    order, to its own copy of the layer, so the copies stay identical and equal
    to a full-batch update.
    """
    for k in range(len(replica_cells[0])):
        by_path: dict[str, list] = {}
        for replica_sinks in sinks:
            for layer, stats in replica_sinks[k].records.values():
                by_path.setdefault(layer.path, []).extend(stats)
        for cells, replica_sinks in zip(replica_cells, sinks):
            with tf.device(cells[k].device), tf.name_scope(f'cell_{k}/batch_stats'):
                for layer, _ in replica_sinks[k].records.values():
                    layer.ApplyBatchStatistics(by_path[layer.path])


def sync(replica_variables: Sequence[dict[str, tf.Variable]],
         source: Callable[[int, tf.Variable], int] = lambda r, var: 0) -> None:
    """Copies replica 0's values into every mirror (after a restore, or a user's assign);
    `source(r, var)`: the replica whose value replica r's `var` takes instead (expert
    parallelism: the replica holding the same experts)."""
    for r, mirror in enumerate(replica_variables[1:], 1):
        for path, var in mirror.items():
            src = source(r, var)
            if src != r:
                with tf.device(var.device):
                    var.assign(replica_variables[src][path])


def sync_slots(optimizers: Sequence[Any], replica_variables: Sequence[dict[str, tf.Variable]],
               source: Callable[[int, tf.Variable], int] = lambda r, var: 0) -> None:
    """`sync` for the optimizers (one `BaseOptimizer` per replica, built over
    `replica_variables`): each mirror's step count is replica 0's, and the slots of each of
    its variables are those of replica `source(r, var)` (expert parallelism: the member
    of group 0 that restored the same experts' slots)."""
    for r, (optimizer, mirror) in enumerate(zip(optimizers[1:], replica_variables[1:]), 1):
        optimizer.iterations.assign(optimizers[0].iterations)
        for path, var in mirror.items():
            src = source(r, var)
            for name in optimizer.SlotShapes(var.shape) if src != r else ():
                slot = optimizer.GetSlot(path, name)
                with tf.device(slot.device):
                    slot.assign(optimizers[src].GetSlot(path, name))
