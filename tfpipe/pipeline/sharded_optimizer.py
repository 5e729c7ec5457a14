"""Optimizer states sharded across data-parallel replicas (ZeRO stage 1).

With `num_replicas=R` every replica holds the whole model and, unsharded, a
whole copy of the optimizer's slots: Adam's two moments are 8 of the 16 bytes
per parameter that a device holds beyond activations. Sharded, as in ZeRO
stage 1 and Megatron's distributed optimizer, replica r keeps the slots of
its own 1/R of every variable, updates only that part of the weights, and the
updated parts are all-gathered so every replica holds the whole new weights:
the state per parameter falls to 4 + 4 + 8/R bytes.

Layout: a variable of n elements is flattened and replica r owns elements
[r*s, min((r+1)*s, n)) with s = ceil(n/R), so only the last parts are short
(or empty when n < R) and R need not divide n. A part is padded to s for the
all-gather, which concatenates equal pieces (one buffer per cell and dtype).

Gradients: TensorFlow has no reduce-scatter on CPUs (collective_reduce_scatter_v2
hangs between logical CPUs and fails across processes), so the reduce-scatter
is the pipeline's all-reduce, of which each replica keeps its part. Holding the
whole summed gradient also keeps global-norm clipping and the NaN guard
exact: every replica computes the same norm from it, as unsharded.

Slots of the variable's shape (Adam's m and v, RMSProp's, SGD's momentum,
Adafactor's m and unfactored v) are sharded. Adafactor's factored moments vr
and vc are row and column means over the whole gradient (rows + columns
numbers for a rows x columns matrix): every replica keeps them whole and
updates them from the whole gradient, identically; its update clipping
needs the RMS of the whole update, summed over the parts by a scalar
all-reduce. So every optimizer's update equals the unsharded one up to
rounding (tested within 1e-5; not always to the bit, as a kernel may round the
elements of a part differently from those of the whole variable).

Checkpoints hold one whole copy of each slot under the unsharded key
(`optimizer/_slots/pipe-fc3-w/m`): a slot saves the concatenation of its
parts and restores by cutting, so a checkpoint moves between any R, sharded
or not.

Collectives are TensorFlow's v1 ops (`all_reduce`, `all_gather`), which work
between logical CPUs of one process and across worker processes; like the
pipeline's all-reduce they must be built inside a tf.function. `Apply` builds
each replica's part in turn (`_apply_replica`) with collective keys agreed for
the whole step, the seam at which one client per replica would build only its
own.
"""
from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops
from tensorflow.python.trackable import base as trackable

from tfpipe.hyperparams import InstantiableParams
from tfpipe.optimizers import BaseOptimizer, Grads, Variables, Whole, cast_args, slot_key
from tfpipe.pipeline import replicas

__all__ = ['ShardedOptimizer', 'shard_bounds']


def shard_bounds(size: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, stop) of each replica's part of a flattened variable of `size` elements."""
    s = math.ceil(size / num_shards)
    return [(min(r * s, size), min((r + 1) * s, size)) for r in range(num_shards)]


class _Slot(trackable.Trackable):
    """One slot of one variable across replicas, checkpointed as one whole tensor.

    `parts[r]` lives on replica r's copy of the variable's device: a flat part
    (`sharded`) or a whole copy (Adafactor's factored moments).
    """

    def __init__(self, shape: tf.TensorShape, parts: list[tf.Variable], sharded: bool):
        self.shape, self.parts, self.sharded = shape, parts, sharded

    def value(self) -> tf.Tensor:
        """The whole slot, as the unsharded optimizer would hold it."""
        with tf.device(self.parts[0].device):
            if not self.sharded:
                return self.parts[0].read_value()
            return tf.reshape(tf.concat([p.read_value() for p in self.parts], 0), self.shape)

    def _serialize_to_tensors(self) -> dict:
        return {trackable.VARIABLE_VALUE_KEY: self.value()}

    def _restore_from_tensors(self, restored_tensors: dict):
        whole = restored_tensors[trackable.VARIABLE_VALUE_KEY]
        if not self.sharded:
            return tf.group([p.assign(whole) for p in self.parts])
        flat = tf.reshape(whole, [-1])
        bounds = shard_bounds(self.shape.num_elements(), len(self.parts))
        return tf.group([p.assign(flat[start:stop])
                         for p, (start, stop) in zip(self.parts, bounds)])


class _Part(Whole):
    """Replica r's flat part of a variable, for the optimizer's rule (see `Whole`)."""

    def __init__(self, grad: tf.Tensor, weight: tf.Tensor, bounds: tuple[int, int],
                 total) -> None:
        super().__init__(grad, weight)
        self._bounds, self._total = bounds, total

    def cut(self, x: tf.Tensor) -> tf.Tensor:
        start, stop = self._bounds
        return tf.reshape(x, [-1])[start:stop]

    def total(self, x: tf.Tensor) -> tf.Tensor:
        return self._total(x)


class ShardedOptimizer(tf.Module):
    """The optimizer of `params` over R replicas' variables, each keeping 1/R of the slots.

    Checkpoints like the unsharded optimizer (`iterations`, `_slots`), so the two
    restore into each other under any R.
    """

    def __init__(self, params: InstantiableParams, replica_variables: Sequence[Variables]):
        rule = params.Instantiate()
        super().__init__(name=rule.name)
        with trackable.no_automatic_dependency_tracking_scope(self):
            self._rule: BaseOptimizer = rule  # its rule only: slots and step are kept here
        self.iterations = rule.iterations
        self._num_replicas = len(replica_variables)
        self._shapes = {path: tf.TensorShape(var.shape)
                        for path, var in replica_variables[0].items()}
        for r, variables in enumerate(replica_variables[1:], 1):
            if {p: tf.TensorShape(v.shape) for p, v in variables.items()} != self._shapes:
                raise ValueError(f'ShardedOptimizer: replica {r} has other variables than '
                                 'replica 0; pass every replica\'s ReplicaVariablesByPath()')
        slots = {}
        with tf.init_scope():
            for path in sorted(self._shapes):
                slots[slot_key(path)] = {
                    name: self._new_slot(path, name, tf.TensorShape(shape), replica_variables)
                    for name, shape in rule.SlotShapes(self._shapes[path]).items()}
        self._slots = slots
        # The devices holding a variable's copies: one collective group per cell.
        self._group_devices = {path: tuple(v[path].device for v in replica_variables)
                               for path in self._shapes}
        self._keys: dict = {}  # collective instance keys of the step being built

    def _new_slot(self, path: str, name: str, shape: tf.TensorShape,
                 replica_variables: Sequence[Variables]) -> _Slot:
        sharded = shape == self._shapes[path]
        bounds = shard_bounds(shape.num_elements(), self._num_replicas)
        parts = []
        for r, variables in enumerate(replica_variables):
            var = variables[path]
            part_shape = [bounds[r][1] - bounds[r][0]] if sharded else shape
            with tf.device(var.device):
                parts.append(tf.Variable(tf.zeros(part_shape, var.dtype), trainable=False,
                                         name=f'{path}/{name}/replica_{r}'))
        return _Slot(shape, parts, sharded)

    @property
    def params(self) -> InstantiableParams:
        return self._rule.params

    def GetSlot(self, path: str, name: str) -> tf.Tensor:
        """The whole slot `name` of the variable at `path` (its parts joined)."""
        return self._slots[slot_key(path)][name].value()

    def SlotParts(self, path: str, name: str) -> list[tf.Variable]:
        """The variables holding slot `name` of `path`, one per replica."""
        return list(self._slots[slot_key(path)][name].parts)

    def Apply(self, lr: tf.Tensor, replica_grads: Sequence[Grads],
              replica_variables: Sequence[Variables]) -> None:
        """One update of every replica's copy from its summed gradients (in a tf.function).

        `replica_grads[r]` are the gradients summed over replicas, held by replica
        r (every replica's are equal); None gradients are skipped.
        """
        if len(replica_grads) != self._num_replicas or \
                len(replica_variables) != self._num_replicas:
            raise ValueError(f'ShardedOptimizer: got {len(replica_grads)} gradient dicts and '
                             f'{len(replica_variables)} variable dicts for {self._num_replicas} '
                             'replicas; pass one of each per replica')
        unknown = sorted(set(replica_grads[0]) - set(self._shapes))
        if unknown:
            raise ValueError(f'ShardedOptimizer: no slots for {unknown}; build it with '
                             'the variables it will update')
        step = self.iterations.assign_add(1)
        self._keys = {}
        pieces = [self._apply_replica(r, lr, step, replica_grads[r], replica_variables[r])
                  for r in range(self._num_replicas)]
        for group in pieces[0]:
            self._gather(group, [p[group] for p in pieces], replica_variables)

    def _key(self, name: tuple) -> int:
        """The instance key of collective `name` in this step, the same for every replica."""
        if name not in self._keys:
            self._keys[name] = replicas.new_instance_key()
        return self._keys[name]

    def _apply_replica(self, r: int, lr: tf.Tensor, step: tf.Tensor, grads: Grads,
                      variables: Variables) -> dict:
        """Replica r's update of its parts; returns {(devices, dtype): [(path, new part)]}."""
        out: dict = {}
        for path in sorted(grads):
            grad, var = grads[path], variables[path]
            if grad is None:
                continue
            devices = self._group_devices[path]
            group = replicas.group_key(devices)
            n = self._shapes[path].num_elements()
            start, stop = shard_bounds(n, self._num_replicas)[r]
            with tf.device(var.device), tf.name_scope(f'shard_update_{r}'):
                lr_, step_, grad_ = cast_args(lr, step, grad, var.dtype)
                weight = var.read_value()

                def total(x, path=path, group=group):
                    if self._num_replicas == 1:
                        return x
                    return collective_ops.all_reduce(x, self._num_replicas, group,
                                                     self._key((path, 'total')), 'Add', 'Id',
                                                     communication_hint='auto')

                part = _Part(grad_, weight, (start, stop), total)
                slots = {name: slot.parts[r]
                         for name, slot in self._slots[slot_key(path)].items()}
                new = part.cut(weight) - self._rule.Delta(lr_, step_, part.cut(grad_), slots,
                                                         part)
                padded = tf.pad(new, [[0, math.ceil(n / self._num_replicas) - (stop - start)]])
            out.setdefault((devices, var.dtype), []).append((path, padded))
        return out

    def _gather(self, group: tuple, pieces: Sequence[list], variables: Sequence[Variables]):
        """All-gathers one cell's updated parts (one buffer per dtype) into every copy."""
        devices, _ = group
        num = self._num_replicas
        key = replicas.group_key(devices)
        instance = self._key(('gather',) + group)
        sizes = [piece.shape[0] for _, piece in pieces[0]]
        for r in range(num):
            with tf.device(devices[r]), tf.name_scope(f'shard_gather_{r}'):
                packed = tf.concat([piece for _, piece in pieces[r]], 0)
                if num > 1:
                    packed = collective_ops.all_gather(packed, num, key, instance,
                                                       communication_hint='auto')
                rows = tf.reshape(packed, [num, sum(sizes)])  # row r: replica r's parts
                for (path, _), column in zip(pieces[r], tf.split(rows, sizes, axis=1)):
                    var = variables[r][path]
                    flat = tf.reshape(column, [-1])[:self._shapes[path].num_elements()]
                    var.assign(tf.reshape(flat, self._shapes[path]))
