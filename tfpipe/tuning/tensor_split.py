"""What tensor parallelism splits of a pipeline's body, read from its layers: which T the
model's params allow, and per layer the share of its weights (and compute) split over a
cell's T devices and the activation all-reduces it runs.

The rule is the layers' own: a layer class that splits over T devices (Megatron's
column/row-parallel pair, multi-head attention split by heads, a vocabulary-parallel
embedding) has a classmethod `TensorParallelWidths(p) -> list[int]`, the widths of its
params that T must divide (hidden width, output columns, input rows, heads; none for a
vocabulary split unevenly). Such a layer is one split unit: its weights are split, and it
runs one activation all-reduce per micro-batch forward and one backward (Megatron's
g and f of a pair; its children are not looked into), or `TENSOR_PARALLEL_ALL_REDUCES`
of each when it says so (a Transformer block: attention, then the feed-forward). Every other layer runs on its
cell's home device. A body with no split unit allows T=1 only: more devices per cell
would only idle.
"""
from __future__ import annotations

from typing import Any, Iterator

from tfpipe.hyperparams import Params

WIDTHS_METHOD = 'TensorParallelWidths'


def _splits(cls: Any) -> bool:
    return hasattr(cls, WIDTHS_METHOD)


def _units(value: Any) -> Iterator[Params]:
    """The split units' params in a params tree (lists and dicts of params included)."""
    if isinstance(value, Params):
        if _splits(getattr(value, 'cls', None)):
            yield value
            return
        for _, child in value.IterParams():
            yield from _units(child)
    elif isinstance(value, (list, tuple)):
        for child in value:
            yield from _units(child)
    elif isinstance(value, dict):
        for child in value.values():
            yield from _units(child)


def split_widths(body: Any) -> list[int]:
    """Every width T must divide, over the split units of `body` (params or a list)."""
    return [int(w) for unit in _units(body)
            for w in getattr(unit.cls, WIDTHS_METHOD)(unit)]


def tensor_parallel_degrees(pipeline: Params, limit: int) -> list[int]:
    """The T (1..limit) the pipeline's params allow: T divides every split width of its
    body (a split unit with no widths, such as a vocabulary split unevenly, allows any T).
    Only 1 when the params have no `tensor_parallel` (a tfpipe without tensor
    parallelism) or the body has no split unit."""
    if 'tensor_parallel' not in pipeline or not any(True for _ in _units(pipeline.body)):
        return [1]
    widths = split_widths(pipeline.body)
    return [t for t in range(1, max(limit, 1) + 1) if all(w % t == 0 for w in widths)]


def layer_split(layer: Any) -> tuple[float, int]:
    """(share of `layer`'s weight bytes in split units, split units) of a built layer:
    what a tensor-parallel cell divides by T, and its all-reduces per micro-batch forward
    (as many backward)."""
    def units(node: Any) -> Iterator[Any]:
        if _splits(type(node)):
            yield node
            return
        for child in getattr(node, 'children', {}).values():
            yield from units(child)

    def size(node: Any) -> float:
        return float(sum(v.shape.num_elements() * v.dtype.size
                         for v in node.trainable_variables))

    found = list(units(layer))
    # A unit that runs more than one (a Transformer block: attention and feed-forward) says so.
    all_reduces = sum(getattr(type(u), 'TENSOR_PARALLEL_ALL_REDUCES', 1) for u in found)
    whole = size(layer)
    if not found or whole == 0:
        return 0.0, all_reduces
    return sum(size(u) for u in found) / whole, all_reduces
