"""Weights sharded across data-parallel replicas (ZeRO stage 3, task.train.sharding='weights').

Between steps replica r holds only its part of each trainable weight of its cells:
elements [r*s, min((r+1)*s, n)) of the flattened weight, s = ceil(n/R), in a
variable of s elements (zero-padded where R does not divide n), the split of the
optimizer's slots and of stage 2's gradient sums (shard_parts.shard_bounds).
`ShardWeights` swaps each layer's whole variable for that part, so the whole copies
are freed; the layers' `theta` and `VariablesByPath` then hold the parts.

A step all-gathers each cell's parts into its whole weights once (one all-gather per
cell and dtype), before the cell's first forward task: the pipeline reads its theta
through `gathered` (PipeliningLayer._ReadThetas). The whole weights are kept through
all M micro-batches and the recompute of each (no regather), and are dropped when the
last backward no longer needs them: torchtitan's reshard_after_forward=False for
pipelining. Resharding after each forward would regather them for every micro-batch's
backward, and with M micro-batches per step that is M (or 2M) all-gathers of the cell
instead of one, for a saving of one cell's weights at the peak; that trade is
`per_micro_batch` (task.train.regather_per_micro_batch): the executor calls
`regatherers`' function in every task of a recomputing cell, which gathers the cell's
weights there, used by that task alone (a cell that keeps its activations still gathers
once: its tapes would hold every forward's weights anyway). The gradients are
reduce-scattered (stage 2) and each replica updates its own part in place
(ShardedOptimizer with `weight_shapes`): nothing is gathered after the update.

Checkpoints stay whole: each weight saves its parts joined (`_WholeWeight`, through
variable_shards.whole_view), under the unsharded key, so a stage-3 checkpoint restores
at any stage and R, and the other way round.

Across trainer clients (`peers`: one replica per process) client c holds part c of
each weight, the all-gathers span the processes (across_clients.all_gather) and each
weight's `_ClientWeight` stands for it in checkpoints: only the chief writes them, so
every client sends it its parts at each save and takes its part of the chief's restored
weights at start (across_clients.SplitValues).

Tied weights (ties.py) are one variable, the owner's, so one part per replica like any
other; a cell whose tied layer reads another cell's weight gets it whole from the same
gather (or, under per_micro_batch, gathers it in its own tasks), and the user's gradient
is folded onto the owner's before the reduce-scatter, as unsharded.

Tensor-parallel cells (T > 1): each shard variable of a split weight is a weight like any
other here, cut into R parts over the replicas' copies of that shard's device and gathered
among them; one replica's parts of the T shards stand for the whole weight together
(`_JoinedWholes`, through variable_shards.of), so checkpoints save it whole and Adafactor's
whole-weight statistics are reduced over its T shards, each shard's over its R parts.
Across trainer clients likewise, the R parts of a shard being the clients' parts on their
copies of the shard's device: the shard's `_ClientWeight` is what the chief gathers and
restores whole, and `_JoinedWholes` joins the T of them along the split axis.

Expert parallelism (P > 1): replica r holds the E/P experts of rank r % P,
so an expert weight is cut into R/P parts over the replicas holding the same experts
(expert_parallel.expert_data_parallel: r % P, r % P + P, ...), gathered among them only
(one more all-gather group per rank), its gradient reduce-scattered among them (the
optimizer sees the parts marked as expert variables); with R = P a rank's weight is one
part, never gathered. Checkpoints save it whole over all E experts (`_JoinedWholes` of
the P ranks' wholes, as expert_parallel.WholeExperts at stages 0-2), so a stage-3 P=2
checkpoint restores at P=1 unsharded and back. Across clients (client c holds rank c % P)
likewise over the strided clients holding the same experts (`_clients`), each client's
`_ClientWeight` one range of the whole over all E experts (shard_parts.client_bounds).
"""
from __future__ import annotations

import collections
import functools
import math
from typing import Any, Callable, Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from tfpipe import variable_shards
from tfpipe.pipeline import across_clients, expert_parallel, replicas, ties
from tfpipe.pipeline.shard_parts import client_bounds, join_rows, shard_bounds

__all__ = ['WeightShards']


class _WholeWeight(tf.Module):
    """One weight's parts over the replicas, saved and restored as the whole value."""

    def __init__(self, path: str, shape: tf.TensorShape, parts: Sequence[tf.Variable]):
        super().__init__(name=None)
        self.path, self.shape, self._parts = path, shape, list(parts)
        self.dtype = parts[0].dtype

    @property
    def shards(self) -> list[tf.Variable]:
        return list(self._parts)

    def _trackable_children(self, save_type='checkpoint', **kwargs):  # saved by value only
        return {}

    def value(self) -> tf.Tensor:
        """The whole weight, joined on replica 0's device."""
        n = self.shape.num_elements()
        with tf.device(self._parts[0].device):
            flat = tf.concat([p.read_value() for p in self._parts], 0)[:n]
            return tf.reshape(flat, self.shape)

    def assign(self, whole: Any) -> tf.Operation:
        """Each replica's part of `whole`, padded, into its variable on its device."""
        size = int(self._parts[0].shape[0])
        flat = tf.reshape(tf.convert_to_tensor(whole, self.dtype), [-1])
        padded = tf.pad(flat, [[0, size * len(self._parts) - flat.shape[0]]])
        ops = []
        for r, part in enumerate(self._parts):
            with tf.device(part.device):
                ops.append(part.assign(padded[r * size:(r + 1) * size]))
        return tf.group(ops)

    def _serialize_to_tensors(self):
        return {'VARIABLE_VALUE': self.value()}

    def _restore_from_tensors(self, restored_tensors):
        return self.assign(restored_tensors['VARIABLE_VALUE'])


class _JoinedWholes(tf.Module):
    """A weight held as pieces along `axis`, each piece whole only over the replicas'
    parts of it (`wholes`: _WholeWeight, or across trainer clients _ClientWeight, whole
    while the chief saves, its restored whole kept for the other clients): a
    tensor-parallel weight's T shards
    (variable_shards.ShardedWeight `split`), or an expert weight's P ranks (each rank's
    E/P experts, joined over the R/P replicas holding them). `shards` are the variables
    standing for the pieces (one replica's parts of the T shards, or replicas 0..P-1's
    parts of the expert weight), in order: for `variable_shards.of` (split_as), where an
    update reading whole-weight statistics takes them together, and for the optimizer's
    whole slots (optimizers.whole_slots). The weight saves whole (the pieces' wholes
    joined along `axis`) under `path`, as at stages 0-2."""

    def __init__(self, path: str, axis: int, parts: Sequence[tf.Variable],
                 wholes: Sequence[_WholeWeight | _ClientWeight]):
        super().__init__(name=None)
        self.path, self.axis, self.dtype = path, axis, wholes[0].dtype
        self.sizes = [int(w.shape[axis]) for w in wholes]
        shape = list(wholes[0].shape)
        shape[axis] = sum(self.sizes)
        self.shape = tf.TensorShape(shape)
        self._parts, self._wholes = list(parts), list(wholes)

    @property
    def shards(self) -> list[tf.Variable]:
        return list(self._parts)

    def _trackable_children(self, save_type='checkpoint', **kwargs):  # saved by value only
        return {}

    def value(self) -> tf.Tensor:
        """The whole weight, joined on the first piece's device."""
        values = [w._serialize_to_tensors()['VARIABLE_VALUE'] for w in self._wholes]
        with tf.device(values[0].device):
            return tf.concat(values, self.axis)

    def _serialize_to_tensors(self):
        return {'VARIABLE_VALUE': self.value()}

    def _restore_from_tensors(self, restored_tensors):
        pieces = tf.split(restored_tensors['VARIABLE_VALUE'], self.sizes, self.axis)
        return tf.group([w._restore_from_tensors({'VARIABLE_VALUE': piece})
                         for w, piece in zip(self._wholes, pieces)])


class _ClientWeight(variable_shards.ClientPart):
    """A trainer client's part of one weight: elements `bounds[index]` of the flattened
    whole of `shape` (zero-padded to the part's size), `bounds` every client's
    (shard_parts.client_bounds: an expert weight's whole is over all E experts, each
    client's range in its rank's experts)."""

    def __init__(self, path: str, part: tf.Variable, shape: tf.TensorShape, index: int,
                 bounds: list[tuple[int, int]]):
        super().__init__(path, part, shape)
        self.index, self.bounds = index, bounds

    def cut(self, whole: tf.Tensor) -> tf.Tensor:
        start, stop = self.bounds[self.index]
        piece = tf.reshape(whole, [-1])[start:stop]
        return tf.pad(piece, [[0, int(self.part.shape[0]) - (stop - start)]])

    def join(self, parts: tf.Tensor) -> tf.Tensor:
        return tf.reshape(join_rows(parts, self.bounds), self.shape)


class WeightShards:
    """Every replica's part of every trainable weight of `pipe` (a PipeliningLayer), which
    it swaps into the pipeline's layers in place of the whole variables. With `peers` the
    pipeline is trainer client `peers.index`'s one replica of `peers.count`, which holds
    part `peers.index` (of an expert weight, its part among the clients holding the same
    experts)."""

    def __init__(self, pipe: Any, peers: across_clients.Peers | None = None,
                 per_micro_batch: bool = False):
        """per_micro_batch: recomputing cells regather their weights in each forward and
        backward task instead of once a step (task.train.regather_per_micro_batch)."""
        p = pipe.params
        whole = [{path: v for path, v in copy.items() if v.trainable}
                 for copy in pipe.ReplicaVariablesByPath()]
        self._peers = peers
        self.per_micro_batch = per_micro_batch
        self.shapes = {path: tf.TensorShape(v.shape) for path, v in whole[0].items()}
        # [local replica] -> the local replicas whose parts of a weight make it whole (its
        # all-gather group): every replica, or for an expert weight (P > 1) the R/P
        # holding the same experts (expert_parallel.expert_data_parallel).
        count, experts = len(whole), peers.expert_parallel if peers else p.expert_parallel
        expert = {path: experts > 1 and expert_parallel.is_expert_variable(var)
                  for path, var in whole[0].items()}
        self._members = {path: [tuple(expert_parallel.expert_data_parallel(count, experts, r))
                                if expert[path] else tuple(range(count)) for r in range(count)]
                         for path in expert}
        # Across clients, likewise the clients: () for all, or an expert weight's strided
        # set holding the same experts (ascending, this client among them).
        self._clients = {path: tuple(expert_parallel.expert_data_parallel(
            peers.count, experts, peers.index)) if peers and expert[path] else ()
            for path in expert}
        self.parts = [{path: self._part(path, r, var) for path, var in copy.items()}
                      for r, copy in enumerate(whole)]
        for copy in self.parts:  # an expert part's gradient sums over its group only
            for path, part in copy.items():
                if expert[path]:
                    expert_parallel.mark_expert_variable(part)
        self._path_of = {id(part): path for copy in self.parts for path, part in copy.items()}
        if peers:
            self._wholes: dict = {path: self._client_weight(path, peers, experts)
                                  for path in self.shapes}
        else:
            self._wholes = {path: self._whole_of(path) for path in self.shapes}
        # Across clients, what the chief checkpoints whole (Trainer: SplitValues).
        self.client_parts = [self._wholes[path] for path in sorted(self._wholes)] if peers else []
        # Each replica's parts of a tensor-parallel weight's shards stand for the weight
        # together (variable_shards.of), as its shards did: checkpoints save it whole and
        # Adafactor's statistics span its T shards (split_statistics.groups).
        self._splits = [_JoinedWholes(split.path, split.axis,
                                      [self.parts[r][path] for path in paths],
                                      [self._wholes[path] for path in paths])
                        for r, copy in enumerate(whole) for split, paths in _splits_of(copy)]
        for split in self._splits:
            for part in split.shards:
                variable_shards.split_as(part, split)
        for path, w in self._wholes.items():
            variable_shards.save_whole_as(self.parts[0][path], w)
        replacements = {id(var): self.parts[r][path]
                        for r, copy in enumerate(whole) for path, var in copy.items()}
        for cells in pipe.replica_cells:
            for cell in cells:
                for layer in cell.layers:
                    layer.ReplaceVariables(replacements)

    def _shard_of(self, path: str, r: int) -> tuple[int, int]:
        """(which part of `path` local replica r holds, of how many parts)."""
        if self._peers is not None:
            clients = self._clients[path]
            if clients:
                return clients.index(self._peers.index), len(clients)
            return self._peers.index, self._peers.count
        members = self._members[path][r]
        return members.index(r), len(members)

    def _devices(self, path: str, r: int) -> tuple[str, ...]:
        """The devices of the parts of `path` that local replica r's joins (its group)."""
        return tuple(self.parts[m][path].device for m in self._members[path][r])

    def _part(self, path: str, r: int, var: tf.Variable) -> tf.Variable:
        """Local replica r's part of `var` (its current value), padded to ceil(n/parts), on
        its device."""
        n = var.shape.num_elements()
        index, count = self._shard_of(path, r)
        start, stop = shard_bounds(n, count)[index]
        size = math.ceil(n / count)
        with tf.init_scope(), tf.device(var.device):
            flat = tf.reshape(var.read_value(), [-1])[start:stop]
            return tf.Variable(tf.pad(flat, [[0, size - (stop - start)]]),
                               name=var.name.split(':')[0].rpartition('/')[2], trainable=True)

    def _client_weight(self, path: str, peers: across_clients.Peers,
                       experts: int) -> _ClientWeight:
        """This client's part of `path` as the chief checkpoints it: of the whole weight, or
        of an expert weight over all E experts (client c holds rank c % P)."""
        n = self.shapes[path].num_elements()
        if not self._clients[path]:
            return _ClientWeight(path, self.parts[0][path], self.shapes[path], peers.index,
                                 shard_bounds(n, peers.count))
        shape = tf.TensorShape([experts * self.shapes[path][0], *self.shapes[path][1:]])
        return _ClientWeight(path, self.parts[0][path], shape, peers.index,
                             client_bounds(experts * n, peers.count, experts))

    def _whole_of(self, path: str) -> Any:
        """What checkpoints save for `path` in one process: its parts joined, or for an
        expert weight each rank's parts joined (replicas k, k+P, ...), then the P ranks
        joined along the experts' axis, [E, ...] as at P=1 (expert_parallel.WholeExperts)."""
        groups = sorted(set(self._members[path]))
        wholes = [_WholeWeight(path, self.shapes[path], [self.parts[m][path] for m in members])
                  for members in groups]
        if len(groups) == 1:
            return wholes[0]
        return _JoinedWholes(path, 0, [self.parts[members[0]][path] for members in groups],
                             wholes)

    def whole(self, path: str) -> tf.Tensor:
        """The whole weight at `path`, its parts joined (as checkpoints save it)."""
        return self._wholes[path].value()

    def is_part(self, var: Any) -> bool:
        """Whether `var` is one of the parts (a layer's variable that stands for a weight)."""
        return id(var) in self._path_of

    def Bytes(self) -> tuple[int, int]:
        """(bytes of weights held by each replica, bytes of one whole copy)."""
        held = sum(v.shape.num_elements() * v.dtype.size for v in self.parts[0].values())
        whole = sum(s.num_elements() * self.parts[0][p].dtype.size
                    for p, s in self.shapes.items())
        return held, whole

    def paths_of(self, theta: dict) -> list[str]:
        """The weights whose parts are leaves of `theta` (e.g. one cell's layers)."""
        return [self._path_of[id(leaf)] for leaf in tf.nest.flatten(theta)
                if self.is_part(leaf)]

    def gathered(self, replica_thetas: Sequence[dict],
                 cells: Sequence[Any] | None = None) -> list[dict]:
        """The thetas with each part replaced by the whole weight, all-gathered on its
        replica's device (inside a tf.function): one all-gather per cell and dtype.
        With `cells` (replica 0's, for a training step) under per_micro_batch, only
        the weights of cells that keep their activations (whose tapes would hold each
        forward's weights until its backward anyway): a recomputing cell's stay parts,
        which its tasks regather (`regatherers`)."""
        paths: Any = self.shapes
        if cells is not None and self.per_micro_batch:
            paths = {path for cell in cells if not cell.recompute
                     for path in self.paths_of(_read_by(cell, replica_thetas[0]))}
        wholes: list[dict] = [{} for _ in self.parts]
        for (devices, clients, _), (members, group) in self._groups(paths).items():
            key = replicas.new_instance_key()
            for r in members:  # the local replicas of the group
                wholes[r].update(self._gather(r, devices, clients, group, key))
        return [self._substitute(theta, wholes[r]) for r, theta in enumerate(replica_thetas)]

    def regatherers(self, replica_cells: Sequence[Sequence[Any]],
                    replica_thetas: Sequence[dict]) -> list[Callable[[int], dict] | None]:
        """Per replica, under per_micro_batch, a function of cell k that all-gathers the
        cell's whole weights anew at each call and reads them as Cell.read_theta does
        (else None): the executor calls it in each task of a recomputing cell, in the
        task's scope, so the gather runs after the device's previous task and its
        result is freed with the task. Each weight is gathered on its own, not packed
        with the cell's others as `gathered` packs them: a packed gather holds the
        gathered buffer and the weights cut out of it at once (about twice the cell's
        weights), which inside a task raised the step's peak above gathering once
        (benchmarks/regather_benchmark.py); weight by weight the transient is one
        weight's. The n-th call for cell k is one all-gather per weight over the
        replicas (instance keys new for each step traced)."""
        if not self.per_micro_batch:
            return [None] * len(replica_cells)
        keys: dict = {}
        return [functools.partial(self._regather, r, cells, theta, keys, collections.Counter())
                for r, (cells, theta) in enumerate(zip(replica_cells, replica_thetas))]

    def _regather(self, r: int, cells: Sequence[Any], theta: dict, keys: dict,
                  calls: collections.Counter, k: int) -> dict:
        n, calls[k] = calls[k], calls[k] + 1
        wholes: dict = {}
        for path in sorted(set(self.paths_of(_read_by(cells[k], theta)))):  # see `regatherers`
            devices = self._devices(path, r)
            if (k, n, path, devices) not in keys:
                keys[(k, n, path, devices)] = replicas.new_instance_key()
            wholes.update(self._gather(r, devices, self._clients[path], [path],
                                       keys[(k, n, path, devices)]))
        return cells[k].read_theta(self._substitute(theta, wholes))

    def _groups(self, paths: Any) -> dict[tuple, tuple[tuple[int, ...], list[str]]]:
        """`paths` by all-gather group: {(the group's devices, its clients, dtype): (its
        local replicas, sorted paths)}; one per cell and dtype, and with expert
        parallelism one more per expert rank."""
        by_group: dict = {}
        for path in sorted(paths):
            for members in sorted(set(self._members[path])):
                by_group.setdefault((self._devices(path, members[0]), self._clients[path],
                                     self.parts[0][path].dtype), (members, []))[1].append(path)
        return by_group

    def _gather(self, r: int, devices: tuple, clients: tuple, paths: list[str],
                key: int) -> dict:
        """Local replica r's side of one all-gather (instance `key`) among `devices` (across
        clients among `clients`, () for all): the whole weights at `paths` (one group's),
        packed into one buffer, on its device."""
        sizes = [int(self.parts[r][path].shape[0]) for path in paths]
        device = self.parts[r][paths[0]].device
        wholes = {}
        with tf.device(device), tf.name_scope(f'gather_weights_{r}'):
            packed = tf.concat([self.parts[r][path].read_value() for path in paths], 0)
            if len(devices) == 1 and (self._peers is None or len(clients) == 1):
                rows = packed[tf.newaxis]  # an expert weight held by one replica (R = P)
            elif self._peers is not None:  # its own keys, in the clients' trace order
                rows = across_clients.all_gather(self._peers, packed, device, clients)
            else:
                rows = tf.reshape(collective_ops.all_gather(
                    packed, len(devices), replicas.group_key(devices), key,
                    communication_hint='auto'), [len(devices), -1])
            for path, column in zip(paths, tf.split(rows, sizes, axis=1)):
                flat = tf.reshape(column, [-1])[:self.shapes[path].num_elements()]
                wholes[path] = tf.reshape(flat, self.shapes[path])
        return wholes

    def _substitute(self, theta: Any, wholes: dict) -> Any:
        """`theta` with each part of `wholes`' weights replaced by its whole weight."""
        return tf.nest.map_structure(
            lambda leaf: wholes.get(self._path_of.get(id(leaf)), leaf), theta)


def _splits_of(copy: dict[str, tf.Variable]
               ) -> list[tuple[variable_shards.ShardedWeight, list[str]]]:
    """The tensor-parallel weights among a replica's trainable variables by path, each with
    its shards' paths in shard order."""
    path_of = {id(var): path for path, var in copy.items()}
    out: dict = {}
    for path, var in sorted(copy.items()):
        split = variable_shards.of(var)
        if split is not None and id(split) not in out:
            out[id(split)] = (split, [path_of[id(shard)] for shard in split.shards])
    return list(out.values())


def _read_by(cell: Any, theta: dict) -> list:
    """The weights cell `cell` reads from the pipeline's `theta`: its layers', and the
    owners' weights its tied layers use (ties.py: the user cell reads the owner's weight,
    so at stage 3 it needs the owner's whole weight too, gathered in its own tasks)."""
    return [theta[name] for name in cell.names] + ties.owner_weights(theta, cell.ties)
