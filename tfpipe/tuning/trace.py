"""Where did the ops go? Placement inspection of a traced pipeline step.

TensorFlow leaves ops it was not told about unplaced (device ''), and the
runtime then picks a device for them, usually device 0: the silent way a
pipeline degenerates into one busy device. These helpers read the device of
every node of a concrete function, including the functions it calls, so tests
and users can see which ops ran where.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterator

import tensorflow as tf

# Ops that carry no computation: function arguments, results and plumbing.
PLUMBING_OPS = frozenset({'Placeholder', '_Arg', '_Retval', 'NoOp', 'Const', 'Identity',
                          'IdentityN', 'StatefulPartitionedCall', 'PartitionedCall'})


@dataclasses.dataclass(frozen=True)
class Node:
    function: str  # '' for the top-level graph, else the library function's name
    name: str
    op: str
    device: str


def nodes(concrete_function) -> Iterator[Node]:
    """Every node of the function's graph and of its function library."""
    graph_def = concrete_function.graph.as_graph_def()
    for n in graph_def.node:
        yield Node('', n.name, n.op, n.device)
    for fn in graph_def.library.function:
        for n in fn.node_def:
            yield Node(fn.signature.name, n.name, n.op, n.device)


def device_index(device: str) -> str:
    """'/job:localhost/replica:0/task:0/device:CPU:3' -> 'CPU:3'; '' stays ''."""
    if not device:
        return ''
    spec = tf.DeviceSpec.from_string(device)
    return f'{spec.device_type}:{spec.device_index}'


def ops_per_device(concrete_function, include_plumbing: bool = False) -> dict[str, int]:
    """Count of ops per device ('' = unplaced): a quick balance and placement check."""
    counts: collections.Counter = collections.Counter()
    for n in nodes(concrete_function):
        if include_plumbing or n.op not in PLUMBING_OPS:
            counts[device_index(n.device)] += 1
    return dict(counts)


def cell_of_node(name: str) -> int | None:
    """The cell index encoded in a node's name scope ('.../cell_3/...'), if any."""
    for part in name.split('/'):
        if part.startswith('cell_') and part[5:].isdigit():
            return int(part[5:])
    return None


def bytes_between_devices(concrete_function) -> dict[tuple[str, str], int]:
    """Bytes each step sends between devices: {(source, destination): bytes}.

    Read from the top-level graph (a ForwardBackward step is one flat graph): a
    tensor consumed on another device than the one producing it is sent there
    once per step, whatever the number of consumers, as TensorFlow's graph
    partitioner does. Tensors of unknown size and unplaced ops are not counted.
    """
    sent: dict[tuple[str, str], int] = collections.Counter()
    seen: set[tuple[str, str]] = set()
    for op in concrete_function.graph.get_operations():
        dest = device_index(op.device)
        for t in op.inputs:
            source = device_index(t.op.device)
            size = t.shape.num_elements() if t.shape.is_fully_defined() else None
            if not source or not dest or source == dest or size is None \
                    or (t.name, dest) in seen:
                continue
            seen.add((t.name, dest))
            sent[(source, dest)] += size * t.dtype.size
    return dict(sent)
