"""Megatron's tensor-parallel Dense pair: column-parallel, then row-parallel.

A layer built inside a tensor-parallel cell (`tensor_parallel.building`, set by
PipeliningLayer) splits its weight over the cell's T devices; built anywhere
else it is an ordinary one-device layer with the variables of `Dense`
(same names, shapes and initial values), so T=1 is Dense and a checkpoint
moves between T=1 and any T (`variable_shards`).

- ColumnParallelDense: w [in, out] cut by columns, shard t on device t computes
  out/T of the outputs from a copy of the whole input; bias cut the same way.
- RowParallelDense: w [in, out] cut by rows, shard t takes in/T of the input
  features and gives a partial sum; the partial sums are all-reduced onto the
  home device, where the (whole) bias is added.
- ParallelMLP: the pair with the activation and a dropout between them on the
  split hidden layer: one all-reduce forward (the row part's sum) and one
  backward (the input copies' gradients), as in Megatron. The dropout cuts each
  shard's part from the whole hidden layer's mask, so an element keeps its mask
  whatever T is.

Each computes in `x`'s dtype (apply_layer casts inputs and weights to the
compute dtype, weights on their own devices).
"""
from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.layers import activations
from tfpipe.layers.dense import check_last_dim, projection_meta, projection_params
from tfpipe.layers.dropout import Dropout, apply_mask
from tfpipe.pipeline import tensor_parallel
from tfpipe.variable_shards import shard_name


def _check_divisible(layer: BaseLayer, param: str, value: int, size: int) -> None:
    if value % size:
        raise ValueError(
            f'{layer.path}: {param}={value} is not divisible by tensor_parallel={size}: make '
            f'{param} a multiple of {size}, or set task.pipeline.tensor_parallel to a divisor '
            f'of {value}')


def _rows(x: tf.Tensor, width: int) -> tf.Tensor:
    """x as a matrix [examples, width] (rank > 2 flattened, as Dense does)."""
    return tf.reshape(x, [-1, width]) if x.shape.rank != 2 else x


def _unrows(y: tf.Tensor, like: tf.Tensor, width: int) -> tf.Tensor:
    if like.shape.rank == 2:
        return y
    return tf.reshape(y, tf.concat([tf.shape(like)[:-1], [width]], 0))


def _dense_params(p):
    p.Define('input_dim', 0, 'Width of the input (last dimension).')
    p.Define('output_dim', 0, 'Width of the output.')
    p.Define('activation', 'none', f'One of {activations.NAMES}.')
    p.Define('use_bias', True, 'Add a bias.')
    p.Define('weight_init', 'glorot_uniform', 'Initialiser name for w.')
    return p


class _ParallelDense(BaseLayer):
    """A Dense whose w is split over the building group's devices along `AXIS`."""

    AXIS = 1

    @classmethod
    def Params(cls):
        return _dense_params(super().Params())

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        if p.input_dim < 1 or p.output_dim < 1:
            raise ValueError(f'{self.path}: input_dim={p.input_dim} and output_dim='
                             f'{p.output_dim} must both be >= 1')
        self.group = tensor_parallel.current_group()
        size = self.group.size
        split_param = 'output_dim' if self.AXIS == 1 else 'input_dim'
        _check_divisible(self, split_param, getattr(p, split_param), size)
        self._act = activations.get(p.activation, self.path)
        self.CreateVariableShards('w', [p.input_dim, p.output_dim], self.AXIS,
                                  self.group.devices, p.weight_init)
        if p.use_bias:
            self._CreateBias()

    def _CreateBias(self) -> None:
        raise NotImplementedError

    def Shards(self, theta: dict, name: str) -> list[tf.Tensor]:
        """The shards of weight `name` in device order."""
        size = self.group.size
        return [theta[shard_name(name, t, size)] for t in range(size)]

    @classmethod
    def TensorParallelWidths(cls, p) -> list[int]:
        """The width T must divide: w's split axis (tfpipe/tuning/tensor_split.py asks, to
        plan which T the model allows)."""
        return [p.output_dim if cls.AXIS == 1 else p.input_dim]

    @classmethod
    def FPropMeta(cls, p, x_shape):
        return projection_meta(x_shape, p.input_dim, p.output_dim)

    @classmethod
    def NumParams(cls, p):
        return projection_params(p.input_dim, p.output_dim, p.use_bias)


class ColumnParallelDense(_ParallelDense):
    """y = activation(x @ w + b) with w and b cut by output columns over T devices."""

    AXIS = 1

    def _CreateBias(self) -> None:
        self.CreateVariableShards('b', [self.params.output_dim], 0, self.group.devices,
                                  'zeros')

    def ShardOutput(self, x: tf.Tensor, w: tf.Tensor, b: tf.Tensor | None) -> tf.Tensor:
        """One shard's output columns activation(x @ w_t + b_t) (under its device)."""
        y = tf.matmul(_rows(x, self.params.input_dim), w)
        if b is not None:
            y = tf.nn.bias_add(y, b)
        return _unrows(self._act(y), x, w.shape[1])

    def ForwardShards(self, theta: dict, copies: list[tf.Tensor]) -> list[tf.Tensor]:
        """Shard t's output columns from its copy of the input, on device t."""
        ws = self.Shards(theta, 'w')
        if not self.params.use_bias:
            return [self.group.local(t, self.ShardOutput, x, w, None)
                    for t, (x, w) in enumerate(zip(copies, ws))]
        return [self.group.local(t, self.ShardOutput, x, w, b)
                for t, (x, w, b) in enumerate(zip(copies, ws, self.Shards(theta, 'b')))]

    def FProp(self, theta, x):
        check_last_dim(self, x, self.params.input_dim, 'input_dim')
        parts = self.ForwardShards(theta, self.group.scatter(x))
        return self.group.gather_to_home(parts, -1)


class RowParallelDense(_ParallelDense):
    """y = activation(x @ w + b) with w cut by input rows over T devices; b whole."""

    AXIS = 0

    def _CreateBias(self) -> None:
        self.CreateVariable('b', [self.params.output_dim], 'zeros')

    def ShardPartial(self, x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        """One shard's partial sum x_t @ w_t (under its device)."""
        return _unrows(tf.matmul(_rows(x, w.shape[0]), w), x, w.shape[1])

    def PartialShards(self, theta: dict, parts: list[tf.Tensor]) -> list[tf.Tensor]:
        """Shard t's partial sum from its input features, on device t."""
        return [self.group.local(t, self.ShardPartial, x, w)
                for t, (x, w) in enumerate(zip(parts, self.Shards(theta, 'w')))]

    def Finish(self, theta: dict, partials: list[tf.Tensor]) -> tf.Tensor:
        """The partial sums reduced onto the home device, bias and activation added."""
        y = self.group.reduce_to_home(partials)
        with self.group.device(0):
            if self.params.use_bias:
                y = tf.nn.bias_add(y, theta['b'])
            return self._act(y)

    def FProp(self, theta, x):
        check_last_dim(self, x, self.params.input_dim, 'input_dim')
        return self.Finish(theta, self.PartialShards(theta, self.group.split(x, -1)))


class ParallelMLP(BaseLayer):
    """fc2(dropout(fc1(x))): fc1 column-parallel with `activation`, fc2 row-parallel."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Width of the input.')
        p.Define('hidden_dim', 0, 'Width of the hidden layer (split over T devices).')
        p.Define('output_dim', 0, 'Width of the output; 0: input_dim.')
        p.Define('activation', 'relu', f'Of the hidden layer: one of {activations.NAMES}.')
        p.Define('keep_prob', 1.0, 'Dropout keep probability on the hidden layer.')
        return p

    @classmethod
    def TensorParallelWidths(cls, p) -> list[int]:
        """The width T must divide: the split hidden layer (tfpipe/tuning/tensor_split.py)."""
        return [p.hidden_dim]

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        p = self.params
        out = p.output_dim or p.input_dim
        self.CreateChild('fc1', ColumnParallelDense.Params().Set(
            input_dim=p.input_dim, output_dim=p.hidden_dim, activation=p.activation,
            dtype=p.dtype))
        self.CreateChild('dropout', Dropout.Params().Set(keep_prob=p.keep_prob, dtype=p.dtype))
        self.CreateChild('fc2', RowParallelDense.Params().Set(
            input_dim=p.hidden_dim, output_dim=out, dtype=p.dtype))
        self.group = self.fc1.group

    def FProp(self, theta: dict, x: Any) -> tf.Tensor:
        check_last_dim(self, x, self.params.input_dim, 'input_dim')
        fc1, fc2 = self.fc1, self.fc2
        whole = x.shape[:-1].concatenate([self.params.hidden_dim])
        args = [fc1.Shards(theta['fc1'], 'w'), fc2.Shards(theta['fc2'], 'w')]
        if fc1.params.use_bias:
            args.append(fc1.Shards(theta['fc1'], 'b'))
        partials = []
        for t, (x_t, *weights) in enumerate(zip(self.group.scatter(x), *args)):
            def shard(x_t, w1, w2, b1=None, t=t):
                h = self._Dropout(fc1.ShardOutput(x_t, w1, b1), whole, t)
                return fc2.ShardPartial(h, w2)
            partials.append(self.group.local(t, shard, x_t, *weights))
        return fc2.Finish(theta['fc2'], partials)

    def _Dropout(self, h: tf.Tensor, whole: tf.TensorShape, t: int) -> tf.Tensor:
        """Shard t's columns of the whole hidden layer's dropout mask applied to h."""
        mask = self.dropout.Mask(whole)
        if mask is None:
            return h
        if self.group.size > 1:
            mask = tf.split(mask, self.group.size, axis=-1)[t]
        return apply_mask(h, mask, self.params.keep_prob)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        x_shape = tf.TensorShape(x_shape)
        rows = math.prod(x_shape[:-1].as_list())
        out = p.output_dim or p.input_dim
        return LayerMeta(2 * rows * p.hidden_dim * (p.input_dim + out) + 2 * rows * p.hidden_dim,
                         x_shape[:-1].concatenate([out]))

    @classmethod
    def NumParams(cls, p):
        out = p.output_dim or p.input_dim
        return p.input_dim * p.hidden_dim + p.hidden_dim + p.hidden_dim * out + out
