"""Reduce-scatter: each of R members gets its 1/R of the sum of everyone's buffer.

ZeRO stage 2 (tfpipe/pipeline/sharded_optimizer.py, `task.train.sharding=
'gradients'`) needs it after a cell's last backward: member r keeps only the
sum of part r of every member's gradients. TensorFlow's own op
(`collective_reduce_scatter_v2`) is NCCL-only: on CPUs it fails across
processes ("did not find collective implementation") and hangs between the
logical CPUs of one process, as the other v2 collectives do there
(/work/shared/reference/tensorflow-notes.md). So `reduce_scatter_sum` is the
one place that picks how, by where the members are:

- GPUs: the native op (NCCL). Written to the op's signature but UNTESTED: this
  project has no GPU; a GPU run must check it against the CPU paths first.
- Trainer clients on CPUs (one member per process): `all_to_all_v2` (measured
  working across processes) moves row s of every member's [R, n/R] buffer to
  member s, which sums the R rows it received. Each member sends and receives
  (R-1)/R of the buffer: a ring reduce-scatter's traffic, half of an all-reduce
  followed by a slice.
- All members in one process (logical CPUs): the same all-to-all as plain
  copies between devices (member s reads row s of each member's buffer), then
  the same local sum: the identical traffic without a collective, since the v2
  ops hang there.
"""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops, gen_collective_ops

from tfpipe.pipeline import across_clients

__all__ = ['reduce_scatter_sum']


def reduce_scatter_sum(rows: Sequence[tf.Tensor], devices: Sequence[str],
                       peers: Optional[across_clients.Peers] = None,
                       members: Sequence[int] = ()) -> list[tf.Tensor]:
    """Member s's [n] = sum over members q of rows[q][s] (call inside a tf.function).

    `rows[i]` is local member i's [R, n] buffer on `devices[i]`: all R members in
    this process, or as trainer client `peers.index` its one (then R = peers.count, or
    with `members`, ascending client indices that include this one, R = their number:
    the clients holding the same experts). Returns one [n] per local member, on its
    device.
    """
    if peers is not None:
        if len(rows) != 1:
            raise ValueError(f'reduce_scatter_sum: a trainer client holds one member, got '
                             f'{len(rows)} buffers')
        if len(members) == 1:  # nobody else holds these rows: nothing to sum
            return [rows[0][0]]
        return [_across_clients(rows[0], devices[0], peers, members)]
    count = len(rows)
    out = []
    for s in range(count):
        with tf.device(devices[s]), tf.name_scope(f'reduce_scatter_{s}'):
            received = [tf.identity(rows[q][s]) for q in range(count)]  # the all-to-all
            out.append(tf.add_n(received))
    return out


def _across_clients(rows: tf.Tensor, device: str, peers: across_clients.Peers,
                    members: Sequence[int]) -> tf.Tensor:
    """This client's row of the sum, by the native op on GPUs, else all-to-all + sum."""
    group = across_clients.group_key(device, members)
    instance, count = across_clients.next_instance(), len(members) or peers.count
    with tf.device(device), tf.name_scope('reduce_scatter'):
        if tf.DeviceSpec.from_string(device).device_type == 'GPU':  # untested: see above
            return gen_collective_ops.collective_reduce_scatter_v2(
                tf.reshape(rows, [-1]), group_size=count, group_key=group,
                instance_key=instance, ordering_token=[], merge_op='Add', final_op='Id',
                communication_hint='nccl')
        received = collective_ops.all_to_all_v2(rows, count, group, instance,
                                                communication_hint='auto')
        return tf.reduce_sum(tf.reshape(received, [count, -1]), 0)
