"""Weights shared by layers in different cells: tied embedding and softmax.

A language model's input embedding (cell 0) and output projection (cell K-1)
often share one matrix. tfpipe keeps one variable, the owner's: it lives on the
owner cell's device and in checkpoints once, under the owner's path, so a
checkpoint restores under any K. The user layer gives up its own variable
(`BaseLayer.TieVariable`); each step the user cell reads the owner's variable
onto its own device like any other weight, differentiates it like its own
weights (summed over its micro-batches on its device), and the sum is then sent
once to the owner's device and added to the owner's gradient: the gradient of
the one variable is the sum of both uses, as in the unpartitioned model.

Ties are declared on the pipeline, by variable paths relative to the body:
`tied_weights={'logits/w': 'embedding/emb'}` (user: owner). With tensor
parallelism a split weight is named whole ('w', not 'w_shard0') and tied shard
by shard: user shard t reads owner shard t on the user cell's t-th device, and
its gradient is added to the owner shard's on the owner shard's device. Both
must be split alike (same axis and sizes), or neither: anything else is refused.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Sequence

import tensorflow as tf

from tfpipe import variable_shards
from tfpipe.base_layer import BaseLayer
from tfpipe.variable_shards import shard_name

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Tie:
    """The user's variable path reads the owner's variable (paths into the pipeline's theta).

    A split weight (tensor parallelism) is tied shard by shard: one Tie per shard, `shard`
    its index (0 for a whole weight), whose gradient is added on that shard's device.
    """

    user: Path
    owner: Path
    user_cell: int
    owner_cell: int
    shard: int = 0


@dataclasses.dataclass(frozen=True)
class _Weight:
    """A weight of the body under its whole path: one variable, or the shards of a split
    one, by their paths relative to the body (a tie names whole weights whatever T is)."""

    parts: tuple[str, ...]
    shape: tf.TensorShape
    dtype: tf.DType
    axis: int | None  # the split axis; None: one variable

    def layout(self) -> str:
        if self.axis is None:
            return "whole on its cell's home device"
        along = {0: 'by rows', 1: 'by columns'}[self.axis] if self.shape.rank == 2 else \
            f'along axis {self.axis}'
        return f'split {along} over {len(self.parts)} devices'


def resolve(tied_weights: Mapping[str, str] | None,
            cell_layers: Sequence[Sequence[BaseLayer]]) -> list[Tie]:
    """Checks the declared ties against the built layers; returns them by cell.

    Nothing is tied yet (see `tie`), so a bad declaration leaves the layers intact.
    """
    if not tied_weights:
        return []
    if not isinstance(tied_weights, Mapping):
        raise ValueError(f'tied_weights={tied_weights!r} must be a dict {{user variable path: '
                         "owner variable path}}, e.g. {'logits/w': 'embedding/emb'}")
    variables, cell_of = _variables_by_path(cell_layers)
    weights = _whole_weights(variables)
    ties = []
    for user, owner in tied_weights.items():
        for path in (user, owner):
            if path not in weights:
                close = difflib.get_close_matches(str(path), weights, n=1)
                hint = f'; did you mean {close[0]!r}?' if close else ''
                raise ValueError(f'tied_weights: no variable {path!r} in the body{hint} (paths '
                                 "are relative to the body, e.g. 'logits/w')")
        if user == owner or owner in tied_weights:
            raise ValueError(f'tied_weights: {user!r} -> {owner!r}: the owner must be another '
                             'variable that is not itself tied; tie every user to the owner')
        u, o = weights[user], weights[owner]
        if tuple(u.shape) != tuple(o.shape) or u.dtype != o.dtype:
            raise ValueError(
                f'tied_weights: {user!r} is {u.dtype.name} {u.shape.as_list()} but {owner!r} '
                f'is {o.dtype.name} {o.shape.as_list()}: they must match (a Dense tied to an '
                "Embedding table needs weight_layout='oi')")
        if u.axis != o.axis or [variables[p].shape for p in u.parts] != [
                variables[p].shape for p in o.parts]:
            raise ValueError(
                f'tied_weights: {user!r} is {u.layout()} but {owner!r} is {o.layout()}: a '
                'tie reads the owner shard by shard, so both layers must split the weight '
                'alike (e.g. two ColumnParallelDense, or an Embedding and a VocabLogits) or '
                'neither; tie layers of one kind, or set task.pipeline.tensor_parallel=1')
        ties += [Tie(tuple(up.split('/')), tuple(op.split('/')), cell_of[up], cell_of[op], t)
                 for t, (up, op) in enumerate(zip(u.parts, o.parts))]
    return ties


def _whole_weights(variables: Mapping[str, tf.Variable]) -> dict[str, _Weight]:
    """The body's weights by whole path: a split weight's shards ('w_shard0', ...) under
    'w', so that a vocabulary-parallel softmax reads its embedding's shards."""
    out = {}
    for path, var in variables.items():
        sharded = variable_shards.of(var)
        if sharded is None:
            out[path] = _Weight((path,), var.shape, var.dtype, None)
            continue
        whole = variable_shards.whole_path(path, sharded)
        size = len(sharded.shards)
        out[whole] = _Weight(tuple(shard_name(whole, t, size) for t in range(size)),
                             sharded.shape, sharded.dtype, sharded.axis)
    return out


def tie(ties: Sequence[Tie], cell_layers: Sequence[Sequence[BaseLayer]]) -> None:
    """Makes each user layer (of these cells: the pipeline's or a replica's) read its owner's
    variable instead of its own."""
    variables, _ = _variables_by_path(cell_layers)
    by_name = {layer.params.name: layer for layers in cell_layers for layer in layers}
    for t in ties:
        layer = by_name[t.user[0]]
        for name in t.user[1:-1]:
            layer = layer.children[name]
        layer.TieVariable(t.user[-1], variables['/'.join(t.owner)])


def read_into(cell_theta: dict, theta: dict, ties: Sequence[Tie], read) -> None:
    """Adds to a cell's theta the owners' weights its tied layers use, each read by `read`
    (under the caller's device scope) from the pipeline's `theta`.

    Each read is a new tensor, also when the owner is in the same cell, so the
    tape keeps the two uses' gradients apart for `fold`.
    """
    for t in ties:
        _set(cell_theta, t.user, read(_get(theta, t.owner)))


def owner_weights(theta: dict, ties: Sequence[Tie]) -> list:
    """The owners' weights in the pipeline's `theta` that `ties`' users read."""
    return [_get(theta, t.owner) for t in ties]


def fold(grads: dict, ties: Sequence[Tie], cell_devices: Sequence[Sequence[str]]) -> None:
    """Moves each tied use's gradient from `grads` onto its owner's, on the owner's device
    (cell_devices: each cell's devices, home first; a shard's is its cell's shard-th)."""
    for t in ties:
        g = _pop(grads, t.user)
        with tf.device(cell_devices[t.owner_cell][t.shard]), tf.name_scope('tied_grads'):
            _set(grads, t.owner, _get(grads, t.owner) + tf.convert_to_tensor(g))


def _variables_by_path(cell_layers: Sequence[Sequence[BaseLayer]]
                       ) -> tuple[dict[str, tf.Variable], dict[str, int]]:
    """Every variable of the body by path relative to the body, and its cell."""
    variables, cell_of = {}, {}
    for k, layers in enumerate(cell_layers):
        for layer in layers:
            prefix = layer.path[:len(layer.path) - len(layer.params.name)]
            for path, var in layer.VariablesByPath().items():
                variables[path[len(prefix):]] = var
                cell_of[path[len(prefix):]] = k
    return variables, cell_of


def _get(nested: dict, path: Path) -> Any:
    for key in path:
        nested = nested[key]
    return nested


def _set(nested: dict, path: Path, value: Any) -> None:
    for key in path[:-1]:
        nested = nested[key]
    nested[path[-1]] = value


def _pop(nested: dict, path: Path) -> Any:
    for key in path[:-1]:
        nested = nested[key]
    return nested.pop(path[-1])
