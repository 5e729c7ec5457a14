"""Whole-weight statistics of a weight that an update covers in parts on several devices.

A tensor-parallel layer holds a weight as T shard variables, one per device
(tfpipe/variable_shards.py). An element-wise rule (SGD, Adam, RMSProp) updates
each shard alone. Adafactor reads statistics of the whole weight: the row and
column means of g^2 (its factored second moments `vr`, `vc`), the mean of `vr`,
the RMS of the update and the RMS of the weight. A `Split` gives them from the
shards without joining them: each shard reduces its own part on its own device
and only the partial sums (a vector of rows or columns, or a scalar) cross
devices, so the gradients, weights and slots of a split layer stay 1/T per
device. A reduction along the split axis is a sum of the shards' partial sums,
computed on the home shard's device and read by the others; one along another
axis is each shard's own.

A factored moment reduced along the split axis (`vr` of a column-split weight,
`vc` of a row-split one) is the same vector for every shard: each shard keeps a
copy of it and updates it identically, and checkpoints save it once
(`Replicated`) under the whole weight's slot key; the other moment is split
like the weight and saves whole (`variable_shards.ShardedWeight`). So an
optimizer's checkpoint is the T=1 one and moves between any T.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tfpipe import variable_shards

__all__ = ['Split', 'Replicated', 'groups', 'whole_slot']

_T = tf.Tensor


class Split:
    """The parts of one weight that one update covers together, for whole-weight statistics.

    `parts[t]` (an `optimizers.Whole`: the part's gradient and weight, `cut` to
    the piece being updated and `total` over such pieces) lives on `devices[t]`;
    the parts are the weight's shards along `axis`, or one part (axis None): the
    whole weight.
    """

    def __init__(self, parts: Sequence[Any], devices: Sequence[str], axis: Optional[int]):
        self.parts, self.devices, self.axis = list(parts), list(devices), axis
        # The part's known shape, not its gradient's or weight's: with sharded gradients
        # (ZeRO stage 2) or weights (stage 3) a part's whole `grad` or `weight` is
        # all-gathered when first read, which only a rule reading whole-weight statistics
        # of it may pay for.
        dims = parts[0].shape.as_list()
        if axis is not None:
            dims[axis] = sum(int(p.shape[axis]) for p in parts)
        self.shape = tf.TensorShape(dims)

    @property
    def size(self) -> int:
        """Number of elements of the whole weight."""
        return self.shape.num_elements()

    def each(self, fn: Callable[..., _T], *per_part: Sequence[Any]) -> list[_T]:
        """[fn(x[t], y[t], ...) on device t for each part t]."""
        out = []
        for t, args in enumerate(zip(*per_part)):
            with tf.device(self.devices[t]):
                out.append(fn(*args))
        return out

    def mean(self, xs: Sequence[_T], axis: int, split_axis: Optional[int],
             keepdims: bool = False) -> list[_T]:
        """Per part, its piece of the mean over `axis` of the whole tensor whose parts are
        `xs`, split along `split_axis` (None: every part holds the whole tensor). Along the
        split axis the mean is whole, one vector for every part."""
        if axis != split_axis or len(xs) == 1:
            return self.each(lambda x: tf.reduce_mean(x, axis, keepdims=keepdims), xs)
        sums = self.each(lambda x: tf.reduce_sum(x, axis, keepdims=keepdims), xs)
        count = sum(int(x.shape[axis]) for x in xs)
        with tf.device(self.devices[0]):
            whole = tf.add_n(sums) / tf.cast(count, sums[0].dtype)
        return [whole] * len(xs)

    def across(self, scalars: Sequence[_T]) -> _T:
        """The sum over the parts of per-part scalars (on the home part's device)."""
        if len(scalars) == 1:
            return scalars[0]
        with tf.device(self.devices[0]):
            return tf.add_n(list(scalars))

    def total(self, scalars: Sequence[_T]) -> _T:
        """The sum over the whole weight of scalars of the pieces being updated: each part's
        `total` (over a sharded optimizer's replicas) summed over the parts."""
        return self.across(self.each(lambda part, x: part.total(x), self.parts, scalars))


def groups(grads: dict[str, Any], variables: dict[str, Any],
           whole_weight: bool) -> list[tuple[list[str], Optional[int]]]:
    """The units of an update of the paths with a gradient (sorted): ([path], None) each,
    or, when `whole_weight`, the shard paths of each split weight together in shard order,
    with its split axis. A split weight with gradients for only some shards is a
    ValueError."""
    path_of = {id(var): path for path, var in variables.items()}
    out, seen = [], set()
    for path in sorted(grads):
        sharded = variable_shards.of(variables[path])
        if not whole_weight or sharded is None or len(sharded.shards) == 1:
            unit = ([path], None)
        elif id(sharded) in seen:
            continue
        else:
            seen.add(id(sharded))
            unit = ([path_of[id(s)] for s in sharded.shards], sharded.axis)
        given = [grads[p] is not None for p in unit[0]]
        if all(given):
            out.append(unit)
        elif any(given):
            raise ValueError(f'gradients for some shards of {unit[0]} are None; give every '
                             'shard of a split weight a gradient or none')
    return out


def missing_shard(variables: dict[str, Any]) -> Optional[tuple[str, int]]:
    """(a whole weight's path, its shard count) of a split weight of which `variables` hold
    some shards but not all (sorted first), else None."""
    held = {id(var) for var in variables.values()}
    for path, var in sorted(variables.items()):
        sharded = variable_shards.of(var)
        if sharded is not None and any(id(s) not in held for s in sharded.shards):
            return variable_shards.whole_path(path, sharded), len(sharded.shards)
    return None


class Replicated(tf.Module):
    """A slot that every shard of a split weight holds whole (a factored moment reduced along
    the split axis), checkpointed once under the whole weight's slot key and restored into
    every copy. A copy is a tf.Variable or anything with its shape, dtype, device,
    read_value and assign (the sharded optimizer's slots)."""

    def __init__(self, copies: Sequence[Any]):
        super().__init__(name=None)
        self._copies = list(copies)
        self.shape = tf.TensorShape(copies[0].shape)
        self.dtype = copies[0].dtype

    def _trackable_children(self, save_type='checkpoint', **kwargs):  # saved by value only
        return {}

    def _serialize_to_tensors(self):
        with tf.device(self._copies[0].device):
            return {'VARIABLE_VALUE': self._copies[0].read_value()}

    def _restore_from_tensors(self, restored_tensors):
        whole = restored_tensors['VARIABLE_VALUE']
        ops = []
        for copy in self._copies:
            with tf.device(copy.device):
                ops.append(copy.assign(whole))
        return tf.group(ops)


def whole_slot(key: str, copies: Sequence[Any], whole_shape: Sequence[int]) -> tf.Module:
    """The checkpointed form of one slot of a split weight, whose shards hold `copies`: the
    copies joined along the one axis where they differ from `whole_shape` (a slot split like
    the weight), or saved once (`Replicated`: every shard holds it whole)."""
    whole = list(whole_shape)
    differ = {a for c in copies for a, (n, w) in enumerate(zip(c.shape, whole)) if n != w}
    if not differ:
        return Replicated(copies)
    if len(differ) != 1 or sum(int(c.shape[min(differ)]) for c in copies) != whole[min(differ)]:
        raise ValueError(f'slot {key}: shard slots {[list(c.shape) for c in copies]} are not '
                         f'parts of one slot of shape {whole}; give the rule a slot per shard '
                         'that is split like the weight or whole')
    return variable_shards.ShardedWeight(key, copies, min(differ))
