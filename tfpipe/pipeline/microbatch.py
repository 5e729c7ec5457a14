"""Splitting a mini-batch into micro-batches and merging results back.

GPipe runs each cell on M micro-batches so the cells can overlap; this module
is the only place that knows how a nested input structure is cut along the
batch dimension and put back together. Sizes must be static because the
pipeline graph is unrolled per micro-batch at trace time.
"""
from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
# tf.nest does not export path-aware flattening; this is the function that
# tf.nest itself is built on (also used by Keras).
from tensorflow.python.util import nest as _nest


def _path_name(path: tuple) -> str:
    """Render a tf.nest tuple path as Python indexing, e.g. ``inputs['a'][1]``."""
    return 'inputs' + ''.join(f'[{key!r}]' for key in path)


def _leaves_with_paths(inputs: Any) -> list[tuple[str, tf.Tensor]]:
    """Flatten ``inputs`` to ``(path name, tensor)`` pairs, converting non-tensors."""
    leaves = []
    for path, leaf in _nest.flatten_with_tuple_paths(inputs):
        name = _path_name(path)
        if not isinstance(leaf, (tf.Tensor, tf.Variable)):
            try:
                leaf = tf.convert_to_tensor(leaf)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f'{name} is {type(leaf).__name__}, which is not convertible to a '
                    f'tensor ({err}); pass tensors or numpy arrays as inputs.') from None
        leaves.append((name, leaf))
    return leaves


def batch_size(inputs: Any) -> int:
    """The static batch size (dim 0) shared by every tensor in ``inputs``.

    Micro-batch sizes are fixed when the pipeline is traced, so a dynamic or
    inconsistent batch dimension is rejected here with a fix rather than
    surfacing as a shape error inside some cell.
    """
    leaves = _leaves_with_paths(inputs)
    if not leaves:
        raise ValueError(
            f'inputs {inputs!r} contain no tensors: pass at least one tensor with a '
            'leading batch dimension.')
    sizes = []
    for name, leaf in leaves:
        rank = leaf.shape.rank
        if rank == 0:
            raise ValueError(
                f'{name} is a scalar: every input needs a leading batch dimension; give '
                'it shape [batch, ...] (e.g. tf.fill([batch], x)) or keep it out of the '
                'pipelined inputs.')
        size = None if rank is None else leaf.shape[0]
        if size is None:
            raise ValueError(
                f'{name} (shape {leaf.shape}) has an unknown batch dimension; give the '
                'input a static batch size, e.g. tf.data batch(..., drop_remainder=True) '
                'or a tf.function input_signature with a fixed batch.')
        sizes.append((name, int(size)))
    if len({size for _, size in sizes}) > 1:
        listing = ', '.join(f'{name}={size}' for name, size in sizes)
        raise ValueError(
            f'inputs disagree on the batch dimension: {listing}; every tensor in the '
            'inputs must have the same leading (batch) size.')
    return sizes[0][1]


def micro_batch_sizes(batch: int, num_micro_batches: int) -> list[int]:
    """Sizes of the micro-batches: differ by at most 1, larger first.

    Uneven splits are allowed so any batch size works with any M; with
    ``batch < M`` there are only ``batch`` micro-batches of one example each,
    since an empty micro-batch would only add work. Examples:
    ``(10, 4) -> [3, 3, 2, 2]``, ``(3, 5) -> [1, 1, 1]``.
    """
    if num_micro_batches < 1:
        raise ValueError(
            f'num_micro_batches is {num_micro_batches}: num_micro_batches must be >= 1; '
            'use 1 to run the whole batch at once.')
    if batch < 1:
        raise ValueError(
            f'batch size is {batch}: there is nothing to split; feed a batch with at '
            'least one example.')
    count = min(batch, num_micro_batches)
    base, extra = divmod(batch, count)
    return [base + 1] * extra + [base] * (count - extra)


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start index of each micro-batch in the mini-batch: ``[3, 3, 2, 2] -> [0, 3, 6, 8]``."""
    starts = []
    total = 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


def split(inputs: Any, num_micro_batches: int) -> list[Any]:
    """Cut every tensor in ``inputs`` along dim 0 into micro-batches.

    Returns a list of structures shaped like ``inputs``, sized by
    ``micro_batch_sizes``. With one micro-batch the inputs are returned as
    ``[inputs]`` untouched, so M=1 adds no ops (and no copies) to the graph.
    """
    if num_micro_batches < 1:
        micro_batch_sizes(1, num_micro_batches)  # raises the shared message
    size = batch_size(inputs)
    sizes = micro_batch_sizes(size, num_micro_batches)
    if len(sizes) == 1:
        return [inputs]
    leaves = [leaf for _, leaf in _leaves_with_paths(inputs)]
    pieces = [tf.split(leaf, sizes, axis=0) for leaf in leaves]
    return [tf.nest.pack_sequence_as(inputs, [piece[i] for piece in pieces])
            for i in range(len(sizes))]


def merge(micro_batches: Sequence[Any]) -> Any:
    """Concatenate micro-batch results along dim 0; the inverse of ``split``.

    A single micro-batch is returned unchanged so M=1 stays op-free.
    """
    if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
        raise ValueError(
            f'merge got {micro_batches!r}: pass a non-empty list of micro-batch '
            'structures, e.g. the output of split().')
    if len(micro_batches) == 1:
        return micro_batches[0]
    first = micro_batches[0]
    for i, other in enumerate(micro_batches[1:], start=1):
        try:
            tf.nest.assert_same_structure(first, other)
        except (TypeError, ValueError):
            raise ValueError(
                f'micro-batch {i} has a different structure from micro-batch 0: every '
                'micro-batch must share one nested structure; return the same '
                'structure from every micro-batch.') from None
    flat = [_leaves_with_paths(mb) for mb in micro_batches]
    merged = []
    for j, (name, leaf) in enumerate(flat[0]):
        if leaf.shape.rank == 0:
            raise ValueError(
                f'{name} is a scalar in every micro-batch, so there is no batch '
                'dimension to concatenate; reduce per-micro-batch scalars yourself '
                '(e.g. sum or average them) instead of merging them.')
        merged.append(tf.concat([leaves[j][1] for leaves in flat], axis=0))
    return tf.nest.pack_sequence_as(first, merged)
