"""One replica per trainer process: the collectives that make R clients one step.

With several trainer clients (tfpipe/clients.py) each process builds one replica
of the K cells on its own devices. The step stays the step of one pipeline over
R*M micro-batches because every client cuts the global mini-batch into the same
R*M micro-batches and runs the r-th group of M (global offsets, so Dropout masks
keep their global example index), and three things are summed across clients
by TensorFlow's collective runtime (`collective_ops.all_reduce`: a ring on CPUs,
NCCL on GPUs where TensorFlow picks it):

- each cell's weight gradients, on that cell's device, packed into one buffer
  per dtype (one collective per cell and dtype, as `replicas.all_reduce_sum`);
- the loss (each client's part is already divided by the global batch size);
- each BatchNorm's per-micro-batch statistics: every client writes its rows
  into a zero table of all R*M micro-batches, and the sum hands every client
  the whole table, so all apply the same full-batch moving-statistics update.
  Adding zeros is exact, so the table is bit for bit the statistics themselves.

With `task.train.shard_optimizer_states` the updated weight shards are
all-gathered across clients too (`all_gather`; tfpipe/pipeline/sharded_optimizer.py);
with task.train.sharding='gradients' the gradients are reduce-scattered instead of
all-reduced (tfpipe/pipeline/reduce_scatter.py: all_to_all_v2 and a local sum).

Keys: the collectives on local device d form the group of device d on every
client (its group key is a function of d's type and index). Instance keys come
from one counter in trace order: every client traces the same step functions in
the same order, so the keys agree without messages.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import ContextManager, Iterator, Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops  # the public tf.distribute wraps these

from tfpipe import fprop_context, variable_shards
from tfpipe.pipeline.cell import Cell

_lock = threading.Lock()
_instance_keys = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class Peers:
    """This process is client `index` of `count`, each holding one replica; with
    `expert_parallel` P > 1, consecutive clients form groups of P that share the
    experts of every MoE layer (tfpipe/pipeline/expert_parallel.py)."""
    count: int
    index: int
    expert_parallel: int = 1

    @property
    def is_chief(self) -> bool:
        return self.index == 0


def next_instance() -> int:
    """The next collective instance key; every client draws them in the same trace order."""
    with _lock:
        return next(_instance_keys)


def group_key(device: str, members: Sequence[int] = ()) -> int:
    """The same key for local device d on every client, one per device type and index;
    with `members` (ascending client indices, a subgroup: an expert group, or the clients
    holding the same experts), one per device and member set, the same on each member."""
    spec = tf.DeviceSpec.from_string(device)
    key = 1 + (spec.device_index or 0) + (0 if spec.device_type == 'CPU' else 100000)
    if not members:
        return key
    # A subgroup is consecutive (an expert group) or strided (the same experts): its
    # kind, first member and device identify it among the groups any client forms.
    strided = len(members) > 1 and members[1] - members[0] > 1
    return 1_000_000 * (1 + members[0]) + 500_000 * strided + key


def all_reduce_sum(peers: Peers, tensors: Sequence[tf.Tensor], device: str,
                   timeout: float = 0, members: Sequence[int] = ()) -> list[tf.Tensor]:
    """Sums each tensor over the clients (or only over `members`, ascending client
    indices that include this one), on this client's `device`.

    Tensors of one dtype are packed into one flat buffer, so every client
    receives the same bits from one collective per dtype. `timeout` (seconds, 0:
    none) raises DeadlineExceededError when a peer never joins.
    """
    out: list = [None] * len(tensors)
    by_dtype: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    with tf.device(device), tf.name_scope('across_clients'):
        for indices in by_dtype.values():
            shapes = [tensors[i].shape for i in indices]
            sizes = [s.num_elements() for s in shapes]
            packed = tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], 0)
            summed = collective_ops.all_reduce(packed, len(members) or peers.count,
                                               group_key(device, members),
                                               next_instance(), 'Add', 'Id',
                                               communication_hint='auto', timeout=timeout)
            for i, piece, shape in zip(indices, tf.split(summed, sizes), shapes):
                out[i] = tf.reshape(piece, shape)
    return out


def all_gather(peers: Peers, tensor: tf.Tensor, device: str,
               members: Sequence[int] = ()) -> tf.Tensor:
    """[count, n]: row r is client r's 1-D `tensor` (n elements on every client), on
    this client's `device`; with `members` (ascending client indices that include this
    one) row i is members[i]'s.

    TensorFlow ranks a group's members by device name, task numerically
    (CollectiveParamResolverLocal), and each client has one device in the group,
    so the rank of a client is its task index: rows come in client order.
    """
    count = len(members) or peers.count
    with tf.device(device), tf.name_scope('across_clients'):
        gathered = collective_ops.all_gather(tensor, count, group_key(device, members),
                                             next_instance(), communication_hint='auto')
        return tf.reshape(gathered, [count, -1])


def apply_batch_stats(peers: Peers, cells: Sequence[Cell],
                      sinks: Sequence[fprop_context.BatchStatsSink], group: range,
                      num_micro_batches: int) -> None:
    """One moving-statistics update per BatchNorm from every client's micro-batches.

    `group` is this client's range of the `num_micro_batches` global micro-batches.
    """
    for cell, sink in zip(cells, sinks):
        records = list(sink.records.values())
        if not records:
            continue
        with tf.device(cell.device), tf.name_scope(f'cell_{cell.index}/batch_stats'):
            tables = []
            for _, stats in records:
                rows = tf.stack([tf.concat([tf.reshape(c, [1]), m, v], 0)
                                 for c, m, v in stats])
                tables.append(tf.pad(rows, [[group.start, num_micro_batches - group.stop],
                                            [0, 0]]))
            tables = all_reduce_sum(peers, tables, cell.device)
            for (layer, stats), table in zip(records, tables):
                dim = stats[0][1].shape[0]
                layer.ApplyBatchStatistics([(row[0], row[1:1 + dim], row[1 + dim:])
                                            for row in tf.unstack(table)])


def broadcast_from_chief(peers: Peers, variables: Sequence[tf.Variable], device: str) -> None:
    """Gives every client the chief's values of `variables` (call inside a tf.function).

    The chief contributes its values and the others zeros, so the sum is the
    chief's values exactly: a broadcast built from the all-reduce that works
    across processes on every device type.
    """
    with tf.device(device):
        values = [v.read_value() if peers.is_chief else tf.zeros(v.shape, v.dtype)
                  for v in variables]
    for var, value in zip(variables, all_reduce_sum(peers, values, device)):
        var.assign(value)


class SplitValues:
    """Values the clients hold in parts (variable_shards.ClientPart: a client's experts
    and their slots, its part of each stage-3 weight), which only the chief reads and
    writes in checkpoints, whole: at each save every client sends the chief its parts
    (`Gathered`), and at start every client takes its part of what the chief restored
    (`ChiefValues`, then `Receive` inside the tf.function that broadcasts the chief's
    other state), so clients need no shared file system. A fresh run keeps each client's
    initial part. `parts` must come in an order every client agrees on."""

    def __init__(self, peers: Peers, parts: Sequence[variable_shards.ClientPart]):
        self._peers = peers
        self._parts = list(parts)
        self._held = {id(p.part) for p in self._parts}

    def holds(self, variable: tf.Variable) -> bool:
        """Whether `variable` is a part (its value is not the chief's to broadcast)."""
        return id(variable) in self._held

    def Gathered(self) -> ContextManager:
        """Every client's parts joined now (an all-gather: call on every client at once),
        whole on the chief for the save made inside the context."""
        for part, rows in zip(self._parts, self._gather() if self._parts else []):
            part.gathered = part.join(rows) if self._peers.is_chief else None
        return self._clearing()

    @contextlib.contextmanager
    def _clearing(self) -> Iterator[None]:
        try:
            yield
        finally:
            for part in self._parts:
                part.gathered = None

    @tf.function(autograph=False)
    def _gather(self) -> list[tf.Tensor]:
        return [all_gather(self._peers, tf.reshape(p.part, [-1]), p.part.device)
                for p in self._parts]

    def ChiefValues(self) -> list[tf.Tensor]:
        """What this client gives `Receive`: on a chief that restored, 1 then each whole
        it read; elsewhere zeros."""
        restored = self._peers.is_chief and all(p.restored is not None for p in self._parts)
        out = [tf.constant(float(restored))]
        for p in self._parts:
            out.append(tf.convert_to_tensor(p.restored) if restored
                       else tf.zeros(p.shape, p.dtype))
            p.restored = None
        return out

    def Receive(self, chief_values: Sequence[tf.Tensor]) -> None:
        """Each client's part of the chief's restored values, if it restored (inside a
        tf.function run by every client at once; `chief_values` from ChiefValues())."""
        if not self._parts:
            return
        flag, *wholes = all_reduce_sum(self._peers, chief_values, self._parts[0].part.device)
        for p, whole in zip(self._parts, wholes):
            with tf.device(p.part.device):
                p.part.assign(tf.where(flag > 0, p.cut(whole), p.part.read_value()))
