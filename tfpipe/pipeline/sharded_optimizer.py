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

Gradients (stage 1): the pipeline's all-reduce, of which each replica keeps its
part; every replica computes the same global norm from the whole sums, as
unsharded. With `shard_gradients` (ZeRO stage 2, task.train.sharding=
'gradients') the pipeline hands each replica's own sums instead
(PipeliningLayer.DeferGradientSum) and `ReduceScatter` leaves replica r the sum
of its part only (tfpipe/pipeline/reduce_scatter.py: TensorFlow's own op is
NCCL-only); `ClipParts` keeps global-norm clipping and the NaN guard exact by
summing the parts' squares over the replicas; Adafactor's factored moments
all-gather the whole gradient of their variable when the rule reads it.

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
or not. A weight split over a tensor-parallel cell's T devices (`w_shard0`
.. on its devices, tfpipe/variable_shards.py) has one such slot per shard;
the checkpoint joins them, as the unsharded optimizer does, into one whole
slot under the whole weight's key (`pipe-fc3-w/m`), so it also moves between
any T. Adafactor updates a split weight's shards together, its statistics
reduced over the shards (tfpipe/split_statistics.py) and its update's RMS
over the replicas' parts too; its factored moments, whole per replica, are
per shard split like the weight or held whole by every shard, and save as the
T=1 slot.

With expert parallelism (`expert_parallel` P > 1) replica r holds
the experts of rank r % P, whose gradient is summed only over the R/P replicas
holding the same experts; their slots (and at stage 2 their gradient sums) shard
over that group, as the other weights' over all R: each weight's shard group is
the replicas that sum its gradient (`_shard_group`), so its update needs no other
replica. An expert weight has one slot per rank; checkpoints join the P into the
whole slot ([E, ...], as the unsharded optimizer's JoinReplicaSlots), so a sharded
P=2 checkpoint moves to P=1 unsharded and back. Across clients (client c holds expert
rank c % P) an expert weight's group is the strided set of clients holding the same
experts (`_clients`), and each client's Slot is its range of the whole slot over all E
experts (shard_parts.client_bounds), so the chief saves it whole like the others.

Collectives are TensorFlow's v1 ops (`all_reduce`, `all_gather`), which work
between logical CPUs of one process and across processes; like the pipeline's
all-reduce they must be built inside a tf.function. In one process `Apply`
builds each replica's shard in turn with collective keys agreed for the whole
step.

Across trainer clients (`peers`, tfpipe/clients.py: one replica per process)
client r holds shard r only, and the collectives span the processes
(tfpipe/pipeline/across_clients.py). A client's slot is then not whole
anywhere, so the chief's checkpoint needs the others' parts: `GatherSlots`
(run by every client at each save) all-gathers them, and the chief saves the
whole slots, as every other run does. Restoring, the chief keeps the whole
slots it read until `ReceiveSlots` (every client, at start) hands each client
its part, so clients need no shared file system.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops
from tensorflow.python.trackable import base as trackable

from tfpipe.hyperparams import InstantiableParams
from tfpipe.optimizers import (BaseOptimizer, Grads, UpdateChains, Variables, cast_args,
                               check_split_weights, checkpointed_slots, slot_key, whole_slots)
from tfpipe.pipeline import across_clients, expert_parallel as expert_parallel_lib
from tfpipe.pipeline import reduce_scatter, replicas
from tfpipe.pipeline.shard_parts import (Part, Slot, as_rows, client_bounds, join_rows,
                                        shard_bounds)
from tfpipe.split_statistics import Split, groups

__all__ = ['ShardedOptimizer']


class ShardedOptimizer(tf.Module):
    """The optimizer of `params` over R replicas' variables, each keeping 1/R of the slots.

    `replica_variables` are this process's replicas: all R of them, or, as trainer
    client `peers.index` of `peers.count`, its one. Checkpoints like the
    unsharded optimizer (`iterations`, `_slots`), so the two restore into each
    other under any R. `shard_gradients` (ZeRO stage 2): `Apply` takes each
    replica's part of the summed gradients (`ReduceScatter`, `ClipParts`).
    `weight_shapes` (stage 3, path -> the whole weight's shape): `replica_variables`
    are the replicas' parts of the weights (tfpipe/pipeline/sharded_weights.py),
    which `Apply` updates in place, gathering nothing; gradients are sharded too.
    `expert_parallel` P > 1: an expert weight's slots shard over the R/P replicas
    holding the same experts (its gradient is summed over them only), in P slots per
    name (one per expert rank), which checkpoints join whole ([E, ...]); across clients
    over the clients holding the same experts, each client's Slot saving whole.
    """

    def __init__(self, params: InstantiableParams, replica_variables: Sequence[Variables],
                 peers: Optional[across_clients.Peers] = None, shard_gradients: bool = False,
                 weight_shapes: Optional[dict[str, tf.TensorShape]] = None,
                 expert_parallel: int = 1):
        rule = params.Instantiate()
        super().__init__(name=rule.name)
        with trackable.no_automatic_dependency_tracking_scope(self):
            self._rule: BaseOptimizer = rule  # its rule only: slots and step are kept here
            self._peers = peers
        if peers is not None and len(replica_variables) != 1:
            raise ValueError(f'ShardedOptimizer: a trainer client holds one replica, got '
                             f'{len(replica_variables)} variable dicts; pass its own only')
        check_split_weights(rule, replica_variables[0])
        self.iterations = rule.iterations
        self._num_local = len(replica_variables)
        # The shard each local replica holds, of how many.
        self._shards = [peers.index] if peers else list(range(self._num_local))
        self._num_shards = peers.count if peers else self._num_local
        self._shapes = dict(weight_shapes) if weight_shapes is not None else {
            path: tf.TensorShape(var.shape) for path, var in replica_variables[0].items()}
        for r, variables in enumerate(replica_variables[1:], 1):
            if {p: tf.TensorShape(v.shape) for p, v in variables.items()} != {
                    p: tf.TensorShape(v.shape) for p, v in replica_variables[0].items()}:
                raise ValueError(f'ShardedOptimizer: replica {r} has other variables than '
                                 'replica 0; pass every replica\'s ReplicaVariablesByPath()')
        # The devices holding a variable's local copies: one collective group per cell.
        self._group_devices = {path: tuple(v[path].device for v in replica_variables)
                               for path in self._shapes}
        # [local replica] -> the local replicas that share its slots of a variable: all,
        # or for an expert weight those holding the same experts. Across clients, the
        # clients sharing them (`_clients`): () for all, or an expert weight's strided set.
        everyone = tuple(range(self._num_local))
        self._members = {path: [everyone] * self._num_local for path in self._shapes}
        self._clients: dict[str, tuple[int, ...]] = dict.fromkeys(self._shapes, ())
        self._expert_parallel = expert_parallel
        for path, var in replica_variables[0].items():
            if expert_parallel == 1 or not expert_parallel_lib.is_expert_variable(var):
                continue
            if peers is not None:
                self._clients[path] = tuple(expert_parallel_lib.expert_data_parallel(
                    peers.count, expert_parallel, peers.index))
            else:
                self._members[path] = [
                    tuple(expert_parallel_lib.expert_data_parallel(self._num_local,
                                                                   expert_parallel, r))
                    for r in range(self._num_local)]
        # {first member: {slot key: {name: Slot}}}: replica 0's slots, then those of the
        # expert weights' other ranks (checkpointed joined into replica 0's: whole_slots).
        slot_sets: dict[int, dict] = {}
        with tf.init_scope():
            for path in sorted(self._shapes):
                for members in sorted(set(self._members[path])):
                    slot_sets.setdefault(members[0], {})[slot_key(path)] = {
                        name: self._new_slot(path, name, tf.TensorShape(shape),
                                             replica_variables, members)
                        for name, shape in rule.SlotShapes(self._shapes[path]).items()}
        self._slots = slot_sets[0]
        with trackable.no_automatic_dependency_tracking_scope(self):
            self._slot_sets = slot_sets
        self._whole_slots = whole_slots(
            replica_variables[0], self._slots, rule.SlotShapes,
            [(replica_variables[first], held) for first, held in slot_sets.items() if first])
        self._keys: dict = {}  # collective instance keys of the step being built
        self.shards_weights = weight_shapes is not None
        self.shards_gradients = shard_gradients or self.shards_weights

    def _new_slot(self, path: str, name: str, shape: tf.TensorShape,
                 replica_variables: Sequence[Variables], members: tuple[int, ...]) -> Slot:
        """Slot `name` of `path` over the local replicas `members` (a part on each)."""
        sharded = shape == self._shapes[path]
        bounds = [self._bounds_of(path, r, shape.num_elements()) for r in members]
        parts = []
        for r, (start, stop) in zip(members, bounds):
            var = replica_variables[r][path]
            part_shape = [stop - start] if sharded else shape
            with tf.device(var.device):
                parts.append(tf.Variable(tf.zeros(part_shape, var.dtype), trainable=False,
                                         name=f'{path}/{name}/replica_{self._shards[r]}'))
        if not (self.spans_clients and sharded):
            return Slot(shape, parts, bounds, sharded)
        # A client's part of the whole slot, saved whole: an expert weight's over all E
        # experts (the P ranks' slots joined), as one process's checkpoints hold it.
        if self._clients[path]:
            ranks = self._expert_parallel
            shape = tf.TensorShape([ranks * shape[0], *shape[1:]])
            clients = client_bounds(shape.num_elements(), self._num_shards, ranks)
        else:
            clients = client_bounds(shape.num_elements(), self._num_shards)
        return Slot(shape, parts, [clients[self._peers.index]], sharded, clients)

    def _shard_group(self, path: str, r: int) -> tuple[tuple, int, int]:
        """((the devices of the replicas sharing local replica r's slots of `path`, across
        clients the clients sharing them: () for all), r's shard among them, their
        number: across clients, the clients')."""
        members = self._members[path][r]
        devices = tuple(self._group_devices[path][m] for m in members)
        if self._peers is not None:
            clients = self._clients[path]
            if clients:
                return (devices, clients), clients.index(self._peers.index), len(clients)
            return (devices, ()), self._peers.index, self._peers.count
        return (devices, ()), members.index(r), len(members)

    def _slots_of(self, path: str, r: int) -> dict[str, tf.Variable]:
        """{name: local replica r's part} of the slots of `path`."""
        index = self._members[path][r].index(r)
        return {name: slot.parts[index] for name, slot in self._slots_of_replica(path, r).items()}

    def _trackable_children(self, save_type='checkpoint', **kwargs):
        return checkpointed_slots(super()._trackable_children(save_type, **kwargs), save_type)

    @property
    def params(self) -> InstantiableParams:
        return self._rule.params

    @property
    def spans_clients(self) -> bool:
        """Whether the shards live in several trainer clients (else all in this process)."""
        return self._peers is not None and self._num_shards > 1

    def GetSlot(self, path: str, name: str, replica: int = 0) -> tf.Tensor:
        """The whole slot `name` of the variable at `path` as local replica `replica` holds
        it unsharded (its parts joined; on a trainer client only inside GatherSlots())."""
        return self._slots_of_replica(path, replica)[name].value()

    def SlotParts(self, path: str, name: str, replica: int = 0) -> list[tf.Variable]:
        """The variables holding slot `name` of `path` over the replicas sharing local
        replica `replica`'s (every local replica, or an expert weight's R/P), one each."""
        return list(self._slots_of_replica(path, replica)[name].parts)

    def SlotBytes(self) -> tuple[int, int]:
        """(bytes of slots held by each local replica, bytes of the slots an unsharded
        replica holds: of its own experts only, with expert parallelism)."""
        held = whole = 0
        for path in sorted(self._shapes):
            shapes = self._rule.SlotShapes(self._shapes[path])
            for name, slot in sorted(self._slots_of_replica(path, 0).items()):
                size = slot.parts[0].dtype.size
                held += slot.parts[0].shape.num_elements() * size
                whole += tf.TensorShape(shapes[name]).num_elements() * size
        return held, whole

    def _slots_of_replica(self, path: str, r: int) -> dict[str, Slot]:
        """{name: Slot} of `path` that local replica r holds a part of."""
        return self._slot_sets[self._members[path][r][0]][slot_key(path)]

    def _all_slots(self) -> list[Slot]:
        return [s[name] for _, s in sorted(self._slots.items()) for name in sorted(s)]

    def ReduceScatter(self, replica_grads: Sequence[Grads]) -> list[Grads]:
        """Each local replica's part of the gradients summed over the replicas sharing its
        slots (stage 2): all replicas, or an expert weight's R/P.

        `replica_grads[i]`: local replica i's own gradient sums, not yet summed over
        replicas (whole shapes). Returns, per local replica, {path: its flat part}
        (`shard_bounds`; None stays None). One reduce-scatter per cell, dtype and group:
        each variable padded to equal rows, one per member, the cell's rows side by side.
        """
        out = [dict.fromkeys(grads) for grads in replica_grads]
        by_group: dict = {}  # {(group, dtype): (members, [path])}
        for path in sorted(p for p, g in replica_grads[0].items() if g is not None):
            for members in sorted(set(self._members[path])):
                group = self._shard_group(path, members[0])[0]
                by_group.setdefault((group, replica_grads[0][path].dtype),
                                    (members, []))[1].append(path)
        for ((devices, clients), _), (members, paths) in by_group.items():
            count = self._count((devices, clients))
            sizes = [self._padded_size(p, members[0]) for p in paths]
            rows = []
            for device, i in zip(devices, members):
                with tf.device(device), tf.name_scope(f'shard_grads_{i}'):
                    rows.append(tf.concat([as_rows(replica_grads[i][p], size, count)
                                           for p, size in zip(paths, sizes)], 1))
            summed = reduce_scatter.reduce_scatter_sum(
                rows, devices, self._peers if self.spans_clients else None, clients)
            for device, i, flat in zip(devices, members, summed):
                with tf.device(device):
                    for path, piece in zip(paths, tf.split(flat, sizes)):
                        start, stop = self._bounds_of(path, i)
                        out[i][path] = piece[:stop - start]
        return out

    def ClipParts(self, replica_parts: Sequence[Grads], max_norm: Optional[float]
                  ) -> tuple[list[Grads], tf.Tensor]:
        """`clip_by_global_norm` of gradient parts (from ReduceScatter): the norm of the
        whole gradients, exact, from each replica's sum of squares of its parts and one
        scalar sum over the replicas. A NaN in any part makes the norm NaN on every
        replica, so the trainer's NaN guard skips the step everywhere."""
        homes = [self._group_devices[min(self._shapes)][i] for i in range(self._num_local)]
        squares = []
        for parts, home in zip(replica_parts, homes):
            own = [g for _, g in sorted(parts.items()) if g is not None]
            local = []
            for g in own:
                with tf.device(g.device):
                    local.append(tf.reduce_sum(tf.square(tf.cast(g, tf.float32))))
            with tf.device(home):
                squares.append(tf.add_n(local) if local else tf.constant(0.0))
        if self.spans_clients:
            totals = across_clients.all_reduce_sum(self._peers, squares, homes[0])
        else:  # every replica adds the same scalars in the same order: the same bits
            totals = []
            for home in homes:
                with tf.device(home):
                    totals.append(tf.add_n(squares))
        norms = [tf.sqrt(total) for total in totals]
        if not max_norm:
            return [dict(parts) for parts in replica_parts], norms[0]
        clipped = []
        for parts, norm in zip(replica_parts, norms):
            scale = max_norm / tf.maximum(norm, max_norm)
            clipped.append({path: None if g is None else g * tf.cast(scale, g.dtype)
                            for path, g in parts.items()})
        return clipped, norms[0]

    def _bounds_of(self, path: str, r: int, size: Optional[int] = None) -> tuple[int, int]:
        """[start, stop) of local replica r's part of the variable at `path` (or of a slot
        of `size` elements)."""
        _, shard, count = self._shard_group(path, r)
        return shard_bounds(self._shapes[path].num_elements() if size is None else size,
                            count)[shard]

    def _padded_size(self, path: str, r: int) -> int:
        """The elements of local replica r's part of `path` padded for an all-gather."""
        return math.ceil(self._shapes[path].num_elements() / self._shard_group(path, r)[2])

    def Apply(self, lr: tf.Tensor, replica_grads: Sequence[Grads],
              replica_variables: Sequence[Variables]) -> None:
        """One update of every local replica's copy from its summed gradients (in a
        tf.function).

        `replica_grads[r]` are the gradients summed over replicas, held by local
        replica r (every replica's are equal); None gradients are skipped.
        """
        if len(replica_grads) != self._num_local or len(replica_variables) != self._num_local:
            raise ValueError(f'ShardedOptimizer: got {len(replica_grads)} gradient dicts and '
                             f'{len(replica_variables)} variable dicts for {self._num_local} '
                             'local replicas; pass one of each per replica')
        unknown = sorted(set(replica_grads[0]) - set(self._shapes))
        if unknown:
            raise ValueError(f'ShardedOptimizer: no slots for {unknown}; build it with '
                             'the variables it will update')
        step = self.iterations.assign_add(1)
        self._keys = {}
        chains = UpdateChains()
        pieces = [self._apply_replica(r, lr, step, replica_grads[r], replica_variables[r],
                                      chains)
                  for r in range(self._num_local)]
        if self.shards_weights:  # each replica keeps its updated part: nothing to gather
            for r, replica_pieces in enumerate(pieces):
                for path, padded in (pair for group in replica_pieces.values() for pair in group):
                    with tf.device(replica_variables[r][path].device):
                        replica_variables[r][path].assign(padded)
            return
        by_group: dict = {}  # {(devices, dtype): {local replica: its pieces}}
        for r, replica_pieces in enumerate(pieces):
            for group, items in replica_pieces.items():
                by_group.setdefault(group, {})[r] = items
        for group, held in by_group.items():
            self._gather(group, held, replica_variables)

    def _key(self, name: tuple) -> int:
        """The instance key of collective `name` in this step, the same for every replica."""
        if name not in self._keys:
            self._keys[name] = replicas.new_instance_key()
        return self._keys[name]

    def _count(self, group: tuple) -> int:
        """The shards' holders of `group` (_shard_group): the local devices, or across
        clients its clients (all when none are named)."""
        devices, clients = group
        if self._peers is not None:
            return len(clients) or self._num_shards
        return len(devices)

    def _sum(self, x: tf.Tensor, name: tuple, group: tuple) -> tf.Tensor:
        """`x` summed over the shards' holders of `group` (_shard_group)."""
        count = self._count(group)
        if count == 1:
            return x
        devices, clients = group
        if self._peers is not None:
            return across_clients.all_reduce_sum(self._peers, [x], devices[0],
                                                 members=clients)[0]
        return collective_ops.all_reduce(x, count, replicas.group_key(devices),
                                         self._key((devices,) + name), 'Add', 'Id',
                                         communication_hint='auto')

    def _all_gather(self, packed: tf.Tensor, name: tuple, group: tuple) -> tf.Tensor:
        """[shards, n]: row s is the 1-D `packed` of shard s's holder among `group`
        (_shard_group: devices in one process, or clients)."""
        count = self._count(group)
        if count == 1:
            return packed[tf.newaxis]
        devices, clients = group
        if self._peers is not None:
            return across_clients.all_gather(self._peers, packed, devices[0], clients)
        gathered = collective_ops.all_gather(packed, count, replicas.group_key(devices),
                                             self._key((devices,) + name),
                                             communication_hint='auto')
        return tf.reshape(gathered, [count, -1])

    def _apply_replica(self, r: int, lr: tf.Tensor, step: tf.Tensor, grads: Grads,
                       variables: Variables, chains: UpdateChains) -> dict:
        """Local replica r's update of its parts; returns {(devices, dtype): [(path, new part)]}.

        A weight split over a tensor-parallel cell's devices is updated with all its shards
        at once when the rule reads whole-weight statistics (split_statistics.groups). The
        weights are updated in `chains` (optimizers.UpdateChains, replica r's lane), so at
        most as many hold their update's temporaries at once as the host runs ops."""
        out: dict = {}
        for paths, axis in groups(grads, variables, self._rule.WHOLE_WEIGHT_STATISTICS):
            with tf.name_scope(f'shard_update_{r}'), tf.device(variables[paths[0]].device), \
                    chains.next(variables[paths[0]].device, lane=r) as done:
                cast = [self._part(r, lr, step, grads[path], variables[path], path)
                        for path in paths]
                (lr_, step_, _), parts = cast[0], [part for _, _, part in cast]
                split = Split(parts, [variables[path].device for path in paths], axis)
                slots = [self._slots_of(path, r) for path in paths]
                deltas = self._rule.Deltas(lr_, step_,
                                           split.each(lambda p: p.own_grad(), parts),
                                           slots, split)
                for path, part, delta in zip(paths, parts, deltas):
                    with tf.device(variables[path].device):
                        new = part.own_weight() - delta
                        padded = tf.pad(new, [[0, self._padded_size(path, r) - new.shape[0]]])
                    out.setdefault((self._shard_group(path, r)[0], new.dtype), []).append(
                        (path, padded))
                    done.append(padded)
        return out

    def _part(self, r: int, lr: tf.Tensor, step: tf.Tensor, grad: tf.Tensor,
              var: tf.Variable, path: str) -> tuple[tf.Tensor, tf.Tensor, Part]:
        """lr and step in the variable's dtype and local replica r's part of the variable at
        `path`, for the rule (on its device)."""
        group = self._shard_group(path, r)[0]
        start, stop = self._bounds_of(path, r)
        with tf.device(var.device):
            lr_, step_, grad_ = cast_args(lr, step, grad, var.dtype)

            def total(x):
                return self._sum(x, (path, 'total'), group)

            if not self.shards_gradients:
                return lr_, step_, Part(grad_, var.read_value(), (start, stop), total)

            def gather(own, what):  # a whole summed gradient or weight, for a rule reading it
                shape = self._shapes[path]
                with tf.device(var.device):
                    padded = tf.pad(own, [[0, self._padded_size(path, r) - own.shape[0]]])
                    rows = self._all_gather(padded, (path, what), group)
                    return tf.reshape(tf.reshape(rows, [-1])[:shape.num_elements()], shape)

            def gather_grad(own):
                return gather(own, 'grad')

            if not self.shards_weights:
                return lr_, step_, Part(None, var.read_value(), (start, stop), total, grad_,
                                         gather_grad)
            return lr_, step_, Part(None, None, (start, stop), total, grad_, gather_grad,
                                     self._shapes[path], var.read_value()[:stop - start],
                                     lambda own: gather(own, 'weight'))

    def _gather(self, group: tuple, pieces: dict[int, list], variables: Sequence[Variables]):
        """All-gathers one cell's updated parts (one buffer per dtype) into every copy held
        by the group's replicas (`pieces`: {local replica: its [(path, padded part)]})."""
        holders, dtype = group  # (devices, clients): _shard_group
        sizes = [piece.shape[0] for _, piece in next(iter(pieces.values()))]
        for device, (r, own) in zip(holders[0], sorted(pieces.items())):
            with tf.device(device), tf.name_scope(f'shard_gather_{r}'):
                packed = tf.concat([piece for _, piece in own], 0)
                rows = self._all_gather(packed, ('gather', holders, dtype), holders)
                for (path, _), column in zip(own, tf.split(rows, sizes, axis=1)):
                    var = variables[r][path]
                    flat = tf.reshape(column, [-1])[:self._shapes[path].num_elements()]
                    var.assign(tf.reshape(flat, self._shapes[path]))

    # -- Across clients: whole slots for the chief's checkpoint -------------------------

    def _sharded_slots_by_group(self) -> dict:
        """{(device, dtype): [sharded slot]} of this client, in an order every client shares."""
        out: dict = {}
        for slot in self._all_slots():
            if slot.sharded:
                out.setdefault((slot.parts[0].device, slot.parts[0].dtype), []).append(slot)
        return out

    @tf.function
    def _gathered_slots(self) -> list[tf.Tensor]:
        out = []
        for (device, _), slots in self._sharded_slots_by_group().items():
            with tf.device(device), tf.name_scope('gather_slots'):
                sizes = [max(stop - start for start, stop in s.clients) for s in slots]
                packed = tf.concat([tf.pad(s.parts[0].read_value(),
                                           [[0, size - s.parts[0].shape[0]]])
                                    for s, size in zip(slots, sizes)], 0)
                rows = self._all_gather(packed, (), ((device,), ()))
                for slot, column in zip(slots, tf.split(rows, sizes, axis=1)):
                    out.append(tf.reshape(join_rows(column, slot.clients), slot.shape))
        return out

    def GatherSlots(self) -> contextlib.AbstractContextManager:
        """All-gathers the sharded slots across the clients: every client calls it at the
        same point (each save). Inside the returned context the slots save whole.

        One all-gather per cell and dtype; each client holds the whole slots
        until the context is left (others drop them at once).
        """
        return self._serving(self._gathered_slots() if self.spans_clients else [])

    @contextlib.contextmanager
    def _serving(self, values: list[tf.Tensor]) -> Iterator[None]:
        slots = [s for group in self._sharded_slots_by_group().values() for s in group]
        for slot, value in zip(slots, values):
            slot.gathered = value
        try:
            yield
        finally:
            for slot in slots:
                slot.gathered = None

    def ChiefSlots(self) -> list[tf.Tensor]:
        """What this client gives `ReceiveSlots`: on the chief each sharded slot whole as
        it knows it (restored, else its own part among zeros), elsewhere zeros."""
        out = []
        for slots in self._sharded_slots_by_group().values():
            for slot in slots:
                part = slot.parts[0]
                with tf.device(part.device):
                    if not self._peers.is_chief:
                        value = tf.zeros(slot.shape, part.dtype)
                    elif slot.restored is not None:
                        value = tf.convert_to_tensor(slot.restored)
                    else:
                        start, stop = slot.bounds[0]
                        value = tf.reshape(tf.pad(part, [[start, slot.shape.num_elements()
                                                          - stop]]), slot.shape)
                out.append(value)
                slot.restored = None
        return out

    def ReceiveSlots(self, chief_slots: Sequence[tf.Tensor]) -> None:
        """Every client's part of the chief's slots (inside a tf.function run by every
        client at once; `chief_slots` from ChiefSlots()): the sum of the chief's whole
        values and the others' zeros, cut. Whole slots (Adafactor's factored moments)
        travel with the chief's other state."""
        values = iter(chief_slots)
        for (device, _), slots in self._sharded_slots_by_group().items():
            summed = across_clients.all_reduce_sum(self._peers, [next(values) for _ in slots],
                                                   device)
            for slot, whole in zip(slots, summed):
                start, stop = slot.bounds[0]
                with tf.device(device):
                    slot.parts[0].assign(tf.reshape(whole, [-1])[start:stop])

    @property
    def whole_slot_variables(self) -> list[tf.Variable]:
        """The slots every replica holds whole (Adafactor's factored moments), local
        replica 0's, ordered by path then name."""
        return [s.parts[0] for s in self._all_slots() if not s.sharded]
