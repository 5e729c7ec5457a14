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
`tied_weights={'logits/w': 'embedding/emb'}` (user: owner).
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Sequence

import tensorflow as tf

from tfpipe.base_layer import BaseLayer
from tfpipe.variable_shards import shard_name

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Tie:
    """The user's variable path reads the owner's variable (paths into the pipeline's theta)."""

    user: Path
    owner: Path
    user_cell: int
    owner_cell: int


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
    ties = []
    for user, owner in _shard_by_shard(tied_weights, variables).items():
        for path in (user, owner):
            if path not in variables:
                close = difflib.get_close_matches(str(path), variables, n=1)
                hint = f'; did you mean {close[0]!r}?' if close else ''
                raise ValueError(f'tied_weights: no variable {path!r} in the body{hint} (paths '
                                 "are relative to the body, e.g. 'logits/w')")
        if user == owner or owner in tied_weights:
            raise ValueError(f'tied_weights: {user!r} -> {owner!r}: the owner must be another '
                             'variable that is not itself tied; tie every user to the owner')
        u, o = variables[user], variables[owner]
        if tuple(u.shape) != tuple(o.shape) or u.dtype != o.dtype:
            raise ValueError(
                f'tied_weights: {user!r} is {u.dtype.name} {u.shape.as_list()} but {owner!r} '
                f'is {o.dtype.name} {o.shape.as_list()}: they must match (a Dense tied to an '
                "Embedding table needs weight_layout='oi')")
        ties.append(Tie(tuple(user.split('/')), tuple(owner.split('/')), cell_of[user],
                        cell_of[owner]))
    return ties


def _shard_by_shard(tied_weights: Mapping[str, str], variables: Mapping[str, Any]
                    ) -> dict[str, str]:
    """The declared ties, a split weight's (tensor parallelism: 'w_shard0', ...) tied
    shard to shard: a vocabulary-parallel softmax reads its embedding's shards."""
    out = {}
    for user, owner in tied_weights.items():
        size = 0
        # shard_name(.., size=2): the name shard `size` has in any split (T > 1).
        while user not in variables and shard_name(user, size, 2) in variables:
            size += 1
        if size == 0:
            out[user] = owner
        for t in range(size):
            out[shard_name(user, t, size)] = shard_name(owner, t, size)
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


def fold(grads: dict, ties: Sequence[Tie], owner_devices: Sequence[str]) -> None:
    """Moves each tied use's gradient from `grads` onto its owner's, on the owner's device."""
    for t in ties:
        g = _pop(grads, t.user)
        with tf.device(owner_devices[t.owner_cell]), tf.name_scope('tied_grads'):
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
