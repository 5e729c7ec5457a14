"""A replica's part of a sharded variable: the layout of the parts, the slot that holds
them, and the view of its part that an optimizer's rule updates.

Split from tfpipe/pipeline/sharded_optimizer.py, which runs the update (collectives,
clipping, across clients): what a part *is* (its bounds, how a slot saves and restores
whole from its parts) is one concept, shared with stage 3's weight shards
(sharded_weights.py), and reads nothing of how the update is scheduled.
"""
from __future__ import annotations

import math
from typing import Optional

import tensorflow as tf
from tensorflow.python.trackable import base as trackable

from tfpipe.optimizers import Whole

__all__ = ['Part', 'Slot', 'as_rows', 'client_bounds', 'join_rows', 'shard_bounds']

def shard_bounds(size: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, stop) of each replica's part of a flattened variable of `size` elements."""
    s = math.ceil(size / num_shards)
    return [(min(r * s, size), min((r + 1) * s, size)) for r in range(num_shards)]


def client_bounds(size: int, count: int, expert_parallel: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of each of `count` trainer clients' part of a whole flattened slot of
    `size` elements. An expert weight's slot (`expert_parallel` P > 1) is whole over all
    E experts: client c holds expert rank k = c % P, whose size/P elements the count/P
    clients holding it ({c' : c' % P == k}, strided) shard among them, so client c's part
    is shard c // P of rank k's elements, offset by the k ranks before. Each element is
    held by exactly one client either way, so the parts of all clients make the whole."""
    per_rank = size // expert_parallel
    shards = shard_bounds(per_rank, count // expert_parallel)
    out = []
    for c in range(count):
        offset = (c % expert_parallel) * per_rank
        start, stop = shards[c // expert_parallel]
        out.append((offset + start, offset + stop))
    return out


def join_rows(rows: tf.Tensor, bounds: list[tuple[int, int]]) -> tf.Tensor:
    """The whole flat value from `rows` [count, n] (row c: client c's part of it, padded to
    n) and every client's `bounds` in it (client_bounds)."""
    order = sorted(range(len(bounds)), key=lambda c: bounds[c])
    return tf.concat([rows[c, :bounds[c][1] - bounds[c][0]] for c in order], 0)


def as_rows(grad: tf.Tensor, size: int, num_shards: int) -> tf.Tensor:
    """[num_shards, size]: row s is shard s's part of the flat `grad`, zero-padded."""
    flat = tf.reshape(grad, [-1])
    return tf.reshape(tf.pad(flat, [[0, size * num_shards - flat.shape[0]]]), [num_shards, size])


class Slot(trackable.Trackable):
    """One slot of one variable, checkpointed as one whole tensor.

    `parts[i]` lives on local replica i's copy of the variable's device: the flat
    elements `bounds[i]` (`sharded`) or a whole copy (Adafactor's factored
    moments). In one process the parts cover the slot; a trainer client holds
    one part (`clients`: where each client's lies), and the whole is `gathered`
    while its chief saves.
    """

    def __init__(self, shape: tf.TensorShape, parts: list[tf.Variable],
                 bounds: list[tuple[int, int]], sharded: bool,
                 clients: Optional[list[tuple[int, int]]] = None):
        self.shape, self.parts, self.bounds, self.sharded = shape, parts, bounds, sharded
        # Across trainer clients: every client's bounds of the whole (client_bounds).
        self.clients = clients if sharded else None
        self.complete = self.clients is None
        self.gathered: Optional[tf.Tensor] = None  # the whole slot while a client's chief saves
        self.restored: Optional[tf.Tensor] = None  # the whole slot a chief read, until sent

    @property
    def dtype(self) -> tf.DType:
        return self.parts[0].dtype

    @property
    def device(self) -> str:
        return self.parts[0].device

    def read_value(self) -> tf.Tensor:
        """The whole slot, as the unsharded optimizer would hold it (named as a variable's
        read, so that a split weight's slots join as its shards do: variable_shards)."""
        return self.value()

    def assign(self, whole: tf.Tensor):
        """Sets the whole slot: each local part gets its elements."""
        return self._restore_from_tensors({trackable.VARIABLE_VALUE_KEY: whole})

    def value(self) -> tf.Tensor:
        """The whole slot, as the unsharded optimizer would hold it."""
        with tf.device(self.parts[0].device):
            if not self.complete:
                return self._gathered_or_empty()
            if not self.sharded:
                return self.parts[0].read_value()
            return tf.reshape(tf.concat([p.read_value() for p in self.parts], 0), self.shape)

    def _gathered_or_empty(self) -> tf.Tensor:
        """A client's whole slot while its chief saves, else an empty tensor: a restore
        serializes too, but reads only the dtype and device; a save outside
        `ShardedOptimizer.GatherSlots` would write the empty tensor, which no restore
        accepts (it fits no slot), rather than a wrong slot. Of the slot's rank, so that
        a split weight's slots join (variable_shards) into an empty tensor too."""
        if self.gathered is not None:
            return self.gathered
        return tf.zeros([0] * max(1, self.shape.rank), self.parts[0].dtype)

    def _serialize_to_tensors(self) -> dict:
        return {trackable.VARIABLE_VALUE_KEY: self.value()}

    def _restore_from_tensors(self, restored_tensors: dict):
        whole = restored_tensors[trackable.VARIABLE_VALUE_KEY]
        if not self.sharded:
            return tf.group([p.assign(whole) for p in self.parts])
        if not self.complete:
            self.restored = whole  # the other clients' parts: ReceiveSlots sends them
        flat = tf.reshape(whole, [-1])
        return tf.group([p.assign(flat[start:stop])
                         for p, (start, stop) in zip(self.parts, self.bounds)])


class Part(Whole):
    """Replica r's flat part of a variable, for the optimizer's rule (see `Whole`).

    With sharded gradients (ZeRO stage 2) the replica holds only its part of the
    summed gradient, `own`; the whole `grad` is then all-gathered by `gather` when
    a rule reads it (Adafactor's factored row and column moments), else never.
    With sharded weights (stage 3) likewise its part of the weight, `own_weight`,
    and `weight` is gathered (`gather_weight`) only when read (Adafactor's
    parameter scale).
    """

    def __init__(self, grad: Optional[tf.Tensor], weight: Optional[tf.Tensor],
                 bounds: tuple[int, int], total, own: Optional[tf.Tensor] = None, gather=None,
                 shape: Optional[tf.TensorShape] = None, own_weight: Optional[tf.Tensor] = None,
                 gather_weight=None) -> None:
        self._grad, self._weight = grad, weight
        self._bounds, self._total, self._own, self._gather = bounds, total, own, gather
        self._shape, self._own_weight, self._gather_weight = shape, own_weight, gather_weight

    @property
    def grad(self) -> tf.Tensor:
        if self._grad is None:
            self._grad = self._gather(self._own)
        return self._grad

    @property
    def weight(self) -> tf.Tensor:
        if self._weight is None:
            self._weight = self._gather_weight(self._own_weight)
        return self._weight

    @property
    def shape(self) -> tf.TensorShape:
        return self._shape if self._shape is not None else self.weight.shape

    def own_grad(self) -> tf.Tensor:
        """The part of the summed gradient this replica updates with."""
        return self.cut(self._grad) if self._own is None else self._own

    def own_weight(self) -> tf.Tensor:
        """The part of the weight this replica updates."""
        return self.cut(self.weight) if self._own_weight is None else self._own_weight

    def cut(self, x: tf.Tensor) -> tf.Tensor:
        start, stop = self._bounds
        return tf.reshape(x, [-1])[start:stop]

    def total(self, x: tf.Tensor) -> tf.Tensor:
        return self._total(x)
