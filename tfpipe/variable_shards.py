"""A weight split over devices, checkpointed as one whole value under its layer path.

A tensor-parallel layer holds weight `w` as T variables `w_shard0` ..
`w_shard{T-1}`, one per device, each 1/T of the whole along one axis (see
`BaseLayer.CreateVariableShards`). Everything that works per variable (theta,
gradients, optimizer slots, replicas, the trainer's update) sees the shards as
ordinary variables on their devices. Checkpoints must not: they keep one whole
copy per layer path, so that a run saved with T=2 resumes with T=1 or T=4 and
the other way round. `whole_view` swaps the shards of a variables-by-path dict
for one `ShardedWeight` under the whole path, which saves the concatenation
under the key a single variable `w` would have and splits on restore.
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import tensorflow as tf

_SUFFIX = '_shard'
# id(shard variable) -> its ShardedWeight; the layer keeps the ShardedWeight alive.
_registry: 'weakref.WeakValueDictionary[int, ShardedWeight]' = weakref.WeakValueDictionary()
# The same for weights whose shards are not one layer's (expert parallelism: separate
# replicas' variables): only checkpoints (`whole_view`) see them whole.
_checkpoint_only: 'weakref.WeakValueDictionary[int, ShardedWeight]' = \
    weakref.WeakValueDictionary()


def shard_name(name: str, t: int, size: int) -> str:
    """The variable name of shard t of weight `name`: 'w' itself when there is one shard
    (a T=1 layer has the plain layer's variables), else 'w_shard0', 'w_shard1', ..."""
    return name if size == 1 else f'{name}{_SUFFIX}{t}'


class ShardedWeight(tf.Module):
    """The shards of one weight, saved and restored as the whole value."""

    def __init__(self, path: str, shards: Sequence[tf.Variable], axis: int,
                 checkpoint_only: bool = False):
        super().__init__(name=None)
        self.path = path  # the whole weight's path, e.g. 'pipe/mlp/w1'
        self._shards = list(shards)
        self.axis = axis
        whole = list(shards[0].shape)
        whole[axis] = sum(int(s.shape[axis]) for s in shards)
        self.shape = tf.TensorShape(whole)
        self.dtype = shards[0].dtype
        for s in self._shards:
            (_checkpoint_only if checkpoint_only else _registry)[id(s)] = self

    @property
    def sizes(self) -> list[int]:
        """Each shard's rows/columns along `axis` (equal, or uneven: a vocabulary)."""
        return [int(s.shape[self.axis]) for s in self._shards]

    @property
    def shards(self) -> list[tf.Variable]:
        return list(self._shards)

    def _trackable_children(self, save_type='checkpoint', **kwargs):  # saved by value only
        return {}

    def value(self) -> tf.Tensor:
        """The whole weight, concatenated on the first shard's device."""
        with tf.device(self._shards[0].device):
            return tf.concat([s.read_value() for s in self._shards], self.axis)

    def assign(self, whole: Any) -> None:
        """Splits `whole` and assigns each piece to its shard on its device."""
        pieces = tf.split(tf.convert_to_tensor(whole, self.dtype), self.sizes, self.axis)
        for shard, piece in zip(self._shards, pieces):
            with tf.device(shard.device):
                shard.assign(piece)

    def _serialize_to_tensors(self):
        return {'VARIABLE_VALUE': self.value()}

    def _restore_from_tensors(self, restored_tensors):
        whole = restored_tensors['VARIABLE_VALUE']
        pieces = tf.split(whole, self.sizes, self.axis)
        ops = []
        for shard, piece in zip(self._shards, pieces):
            with tf.device(shard.device):
                ops.append(shard.assign(piece))
        return tf.group(ops)


class ClientPart(tf.Module):
    """This process's part of a value whose other parts other trainer clients hold, saved
    and restored as the whole. Only the chief saves, once every client sent it its part
    (`gathered`, set for the save by across_clients.SplitValues); a restore assigns this
    process's part and keeps the whole (`restored`) for the chief to send to the others
    (SplitValues again). Subclasses say where the part sits in the whole."""

    def __init__(self, path: str, part: tf.Variable, shape: tf.TensorShape):
        super().__init__(name=None)
        self.path = path
        self.part = part
        self.shape = tf.TensorShape(shape)
        self.dtype = part.dtype
        self.gathered: tf.Tensor | None = None
        self.restored: tf.Tensor | None = None

    @property
    def shards(self) -> list[tf.Variable]:
        return [self.part]

    def cut(self, whole: tf.Tensor) -> tf.Tensor:
        """This process's part of `whole`."""
        raise NotImplementedError

    def join(self, parts: tf.Tensor) -> tf.Tensor:
        """The whole from every client's part, flattened, in client order ([count, n])."""
        raise NotImplementedError

    def _trackable_children(self, save_type='checkpoint', **kwargs):  # saved by value only
        return {}

    def _serialize_to_tensors(self):
        """The whole while the chief saves, else an empty tensor of its rank: a restore
        serializes too, but reads only the dtype and device; a save outside the gather
        would write the empty tensor, which no restore accepts, rather than wrong values."""
        if self.gathered is not None:
            return {'VARIABLE_VALUE': self.gathered}
        with tf.device(self.part.device):
            return {'VARIABLE_VALUE': tf.zeros([0] * self.shape.rank, self.dtype)}

    def _restore_from_tensors(self, restored_tensors):
        whole = restored_tensors['VARIABLE_VALUE']
        self.restored = whole
        with tf.device(self.part.device):
            return self.part.assign(self.cut(whole))


class ClientSlices(ClientPart):
    """Rows [rank*n, (rank+1)*n) of a whole [size*n, ...]: with expert parallelism across
    trainer clients, client c's experts of an expert weight and its optimizer's
    element-wise slots (rank = c % size; clients 0..size-1 hold every row once)."""

    def __init__(self, path: str, part: tf.Variable, rank: int, size: int):
        super().__init__(path, part, [size * int(part.shape[0]), *part.shape[1:]])
        self.rank = rank
        self.slots: dict[int, ClientSlices] = {}  # id(slot variable) -> its ClientSlices

    def cut(self, whole: tf.Tensor) -> tf.Tensor:
        n = int(self.part.shape[0])
        return whole[self.rank * n:(self.rank + 1) * n]

    def join(self, parts: tf.Tensor) -> tf.Tensor:
        return tf.reshape(parts[:self.shape[0] // self.part.shape[0]], self.shape)

    def slot(self, path: str, variable: Any) -> Any:
        """The ClientSlices of one of this weight's optimizer slots (shaped like it), or the
        slot itself when it is whole already (a sharded optimizer's across clients, which
        gathers every client's part of it itself: shard_parts.Slot)."""
        if variable.shape == self.shape:
            return variable
        if variable.shape != self.part.shape:
            raise ValueError(f'{path}: the optimizer slot is {variable.shape.as_list()}, not '
                             f'shaped like its expert weight {self.part.shape.as_list()}; '
                             'across trainer clients an expert weight needs element-wise '
                             'slots (sgd, momentum, adam): change the optimizer, or run one '
                             'process with task.pipeline.num_replicas > 1')
        if id(variable) not in self.slots:
            self.slots[id(variable)] = ClientSlices(path, variable, self.rank,
                                                    self.shape[0] // variable.shape[0])
        return self.slots[id(variable)]


def of(variable: Any) -> 'ShardedWeight | None':
    """The ShardedWeight a shard variable belongs to, None for a whole variable."""
    return _registry.get(id(variable))


def save_whole_as(variable: tf.Variable, whole: Any) -> None:
    """Checkpoints save `whole` (with `path`, `shape` and `shards`) in place of
    `variable` (`whole_view`), as for expert weights: ZeRO stage 3's parts
    (tfpipe/pipeline/sharded_weights.py), a trainer client's part (ClientPart).
    The caller keeps `whole` alive."""
    _checkpoint_only[id(variable)] = whole


def split_as(variable: tf.Variable, weight: Any) -> None:
    """`of(variable)` answers `weight` (with `path`, `axis`, `shape`, `dtype`, `sizes` and
    `shards`: the variables standing for the weight's T shards, in shard order), which
    checkpoints also save in its place: ZeRO stage 3's parts of a tensor-parallel weight's
    shards (tfpipe/pipeline/sharded_weights.py), which an update reading whole-weight
    statistics takes together as it takes the shards. The caller keeps `weight` alive."""
    _registry[id(variable)] = weight


def checkpointed_as(variable: Any) -> 'ShardedWeight | None':
    """The ShardedWeight a checkpoint saves in place of `variable`: its tensor-parallel
    weight's (`of`), or the checkpoint-only one of an expert weight's slice, else None."""
    return of(variable) or _checkpoint_only.get(id(variable))


def whole_path(shard_path: str, sharded: ShardedWeight) -> str:
    """The path of the whole weight a shard belongs to, relative to the same root as
    `shard_path` (a theta's, a body's): 'body/fc/w_shard1' -> 'body/fc/w'."""
    head, _, _ = shard_path.rpartition('/')
    name = sharded.path.rpartition('/')[2]
    return f'{head}/{name}' if head else name


def whole_view(variables: dict[str, Any]) -> dict[str, Any]:
    """`variables` by path with each split weight's shards replaced by one ShardedWeight
    under the whole weight's path (what checkpoints save)."""
    out: dict[str, Any] = {}
    for path, var in variables.items():
        sharded = checkpointed_as(var)
        if sharded is None or (len(sharded.shards) == 1 and
                               not isinstance(sharded, ClientPart)):
            out[path] = var
        else:
            out[sharded.path] = sharded
    return out
