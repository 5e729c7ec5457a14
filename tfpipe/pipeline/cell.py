"""A cell: consecutive layers of the body pinned to one device.

The cell knows its layers, its device and whether its backward pass recomputes
the forward (re-materialisation). It does not know about micro-batches or the
schedule: that is the executor's job.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from tfpipe import variable_shards
from tfpipe.base_layer import BaseLayer, apply_layer, cast_floats
from tfpipe.pipeline import ties as ties_lib

RECOMPUTE_POLICIES = ('always', 'except_last', 'never')


def recompute_flags(policy: str, num_cells: int) -> list[bool]:
    """Which cells recompute their forward in the backward pass.

    'except_last' follows torchgpipe: the last cell's backward starts right after
    its forward, so keeping its activations costs little and saves a recompute.
    """
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f'unknown recompute policy {policy!r}: use one of '
                         f'{list(RECOMPUTE_POLICIES)}')
    if policy == 'always':
        return [True] * num_cells
    if policy == 'never':
        return [False] * num_cells
    return [True] * (num_cells - 1) + [False]


def cell_dtypes(k: int, num_cells: int, pipeline_params: Any) -> tuple[Any, Any]:
    """(compute dtype, output dtype) of cell k: with a fprop_dtype (the pipeline's or a
    body layer's), the last cell casts the pipeline's output back to float32."""
    p = pipeline_params
    mixed = p.fprop_dtype is not None or any(lp.fprop_dtype is not None for lp in p.body)
    return p.fprop_dtype, (tf.float32 if mixed and k == num_cells - 1 else None)


def _read(value: Any) -> tf.Tensor:
    # read_value() takes the enclosing device scope; tf.identity(variable) leaves
    # the ReadVariableOp unplaced in the traced graph.
    return value.read_value() if isinstance(value, tf.Variable) else tf.identity(value)


class Cell:
    """Layers [start, stop) of the body, run on `device`."""

    def __init__(self, index: int, device: str, layers: Sequence[BaseLayer], recompute: bool,
                 fprop_dtype: Optional[tf.DType] = None, output_dtype: Optional[tf.DType] = None,
                 ties: Sequence[ties_lib.Tie] = (),
                 shard_devices: Optional[Sequence[str]] = None):
        """fprop_dtype: compute dtype (e.g. bfloat16), None: the variables' dtype;
        output_dtype: what the cell's float outputs are cast to (the last cell's go
        back to float32 for the loss), None: left in fprop_dtype;
        ties: the pipeline's ties whose user layer is in this cell;
        shard_devices: with tensor parallelism, the cell's T devices (`device` first):
        shard t of a split weight is read on the t-th."""
        self.index = index
        self.device = device
        self.layers = list(layers)
        self.recompute = recompute
        self.fprop_dtype = fprop_dtype
        self.output_dtype = output_dtype
        self.ties = [t for t in ties if t.user_cell == index]
        self.shard_devices = tuple(shard_devices or (device,))

    @property
    def names(self) -> list[str]:
        return [layer.params.name for layer in self.layers]

    def read_theta(self, theta: dict) -> dict:
        """This cell's part of the pipeline's theta, read once on the cell's device.

        Reading the variables here (rather than inside every micro-batch) gives
        each micro-batch the same tensors, and puts the reads on the device that
        owns the variables. Tied weights owned by another cell are read here too:
        one copy onto this device per step (a tied shard onto the device of the same shard
        here: a vocabulary-parallel softmax reads its embedding shard by shard).
        """
        with tf.device(self.device), tf.name_scope(f'cell_{self.index}/theta'):
            out = {n: tf.nest.map_structure(self._read_shard, theta[n]) for n in self.names}
            ties_lib.read_into(out, theta, self.ties, self._read_shard)
            return out

    def _read_shard(self, value: Any) -> tf.Tensor:
        """A weight read on this cell's device, or for shard t of a split weight on the
        cell's t-th device (where that shard's compute and gradient sum are): the shard's
        variable, or at stage 3 the shard as gathered there (sharded_weights.py)."""
        sharded = variable_shards.of(value) if isinstance(value, tf.Variable) else None
        if sharded is not None:
            device = self.shard_devices[next(t for t, s in enumerate(sharded.shards)
                                             if s is value)]
        elif getattr(value, 'device', None) in self.shard_devices[1:]:
            device = value.device
        else:
            return _read(value)
        with tf.device(device):
            return _read(value)

    def forward(self, theta: dict, x: Any) -> Any:
        """Applies the cell's layers in order (device and context set by the caller)."""
        return self.forward_layers(theta, x)[-1]

    def forward_layers(self, theta: dict, x: Any) -> list:
        """The output of each layer in turn; a split backward differentiates each layer's
        weights from its own output, so it needs them all.

        With a fprop_dtype (the pipeline's, or a layer's own) the casts happen in
        `apply_layer`, under the caller's tape: weight gradients come back in the
        variables' dtype (float32) and are summed in it, while compute and the
        activations sent to the next cell use the compute dtype.
        """
        outs = []
        for layer in self.layers:
            x = apply_layer(layer, theta[layer.params.name], x, self.fprop_dtype)
            outs.append(x)
        if self.output_dtype is not None:
            outs[-1] = cast_floats(outs[-1], self.output_dtype)
        return outs
