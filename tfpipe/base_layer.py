"""BaseLayer: a tf.Module built from Params, with functional FProp(theta, ...).

Lingvo's contract, kept because it makes pipelining simple:
- a layer is described by `cls.Params()` and built with `params.Instantiate()`;
- its children are built from params too (`CreateChild`), so the whole model is
  one Params tree that can be dumped, diffed and reloaded;
- `FProp(theta, *inputs)` is functional in the trainable weights: `theta` is a
  nested dict of this layer's and its children's trainable variables, so the
  pipeline can hand each cell the part of `theta` it owns, read on its device,
  and differentiate a cell in isolation.

Variables are created with stateless initialisers seeded by the experiment seed
and the variable's layer path (see `initializers`), so the same params give the
same weights whatever the partitioning and whatever device holds them.

Methods are CamelCase on purpose: params and children are snake_case attributes
(`self.params`, `self.fc0`), so a method name can never collide with them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Optional, Sequence

import tensorflow as tf

from tfpipe import initializers, variable_shards
from tfpipe.hyperparams import InstantiableParams, Params

_NAME_RE = re.compile(r'^[a-z_][a-z0-9_]*$')


@dataclasses.dataclass(frozen=True)
class LayerMeta:
    """Static cost of one FProp: used by the partitioner to balance cells.

    flops: floating-point operations (a multiply-add counts 2) for the given
      input shapes, batch included: what the implementation runs.
    out_shapes: the output shape(s), same nesting as the outputs.
    model_flops: the part of `flops` the model needs (PaLM's model FLOPs, what MFU
      divides: tfpipe/tuning/flops.py) where the implementation runs more, e.g. an MoE
      layer's dispatch and combine einsums and its experts' empty capacity slots, which
      would otherwise pass for model work; None: all of `flops`.
    """
    flops: int
    out_shapes: Any
    model_flops: Optional[int] = None

    @property
    def needed_flops(self) -> int:
        """model_flops, or flops where the two are the same."""
        return self.flops if self.model_flops is None else self.model_flops


def sum_metas(metas: Sequence[LayerMeta], out_shapes: Any, extra: int = 0) -> LayerMeta:
    """One meta for layers run one after the other (plus `extra` FLOPs of model work):
    the flops add, and so do the model flops where any layer tells them apart."""
    flops = sum(m.flops for m in metas) + extra
    apart = any(m.model_flops is not None for m in metas)
    return LayerMeta(flops, out_shapes,
                     sum(m.needed_flops for m in metas) + extra if apart else None)


class BaseLayer(tf.Module):
    """Base class of every tfpipe layer."""

    # A layer with NESTED_ACTIVATIONS = False sees only the main activation: when
    # the activation flowing through a sequence is a dict (skip connections
    # stashed beside it), such a layer is applied to its 'x' entry and the other
    # entries pass through untouched. See `apply_layer`.
    NESTED_ACTIVATIONS = False

    # Whether this layer runs its children through `apply_layer`, which honours each
    # child's own fprop_dtype (sequences do; a composite that calls child.FProp itself
    # does not, so a child's fprop_dtype there is refused rather than ignored).
    APPLIES_CHILD_DTYPES = False

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.Define('name', '', 'Layer name, a snake_case identifier unique among its '
                 'siblings. The layer path (parent/child) keys variables, seeds and '
                 'checkpoints.')
        p.Define('dtype', tf.float32, 'Dtype of variables and activations.')
        p.Define('fprop_dtype', None, "Compute dtype, e.g. tf.bfloat16 (Lingvo's name): where "
                 'the layer runs in a sequence (a pipeline body, Sequential), its float inputs '
                 'and weights are cast to it; variables and their gradients keep `dtype`. None: '
                 'compute in the dtype of the inputs (a PipeliningLayer\'s fprop_dtype is the '
                 'default of its body; a layer\'s own wins, e.g. float32 for a softmax).')
        p.Define('random_seed', None, 'Seed of the weight initialisers; None inherits '
                 "the parent's (0 at the root).")
        return p

    def __init__(self, params: Params, parent: Optional['BaseLayer'] = None):
        name = params.name
        if not isinstance(name, str) or not _NAME_RE.match(name):
            where = f' under {parent.path!r}' if parent is not None else ''
            raise ValueError(
                f'{type(self).__name__} layer{where} has name {name!r}: set p.name to '
                "a snake_case identifier such as 'fc0'")
        super().__init__(name=name)
        self._params = params
        self._path = f'{parent.path}/{name}' if parent is not None else name
        if params.random_seed is not None:
            self._seed = int(params.random_seed)
        else:
            self._seed = parent._seed if parent is not None else 0
        self._vars: dict[str, tf.Variable] = {}
        self._tied: dict[str, tf.Variable] = {}  # name -> another layer's variable
        self._sharded: dict[str, variable_shards.ShardedWeight] = {}  # split weights by name
        self._children: dict[str, BaseLayer] = {}

    # -- Structure -------------------------------------------------------------------

    @property
    def params(self) -> Params:
        """The frozen params this layer was built from."""
        return self._params

    @property
    def path(self) -> str:
        """Slash-separated names from the root layer, e.g. 'pipe/fc3'."""
        return self._path

    @property
    def children(self) -> dict[str, 'BaseLayer']:
        return dict(self._children)

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__.get('_children', {})
        if name in children:
            return children[name]
        raise AttributeError(f'{type(self).__name__} {self.__dict__.get("_path", "")!r} '
                             f'has no attribute or child {name!r}')

    def _CheckNewName(self, name: str) -> None:
        if name in self._vars or name in self._children:
            raise ValueError(f'{self.path!r} already has a variable or child named '
                             f'{name!r}: give every child a unique name')
        if hasattr(type(self), name):
            raise ValueError(f'{self.path!r}: the name {name!r} is reserved by '
                             f'{type(self).__name__}; pick another child name')

    def CreateChild(self, name: str, params: Params) -> 'BaseLayer':
        """Builds a child from (a copy of) `params`, named `name`."""
        self._CheckNewName(name)
        child = self.BuildDetachedChild(name, params)
        self._children[name] = child
        return child

    def BuildDetachedChild(self, name: str, params: Params) -> 'BaseLayer':
        """Builds the layer `CreateChild(name, params)` would, without adopting it.

        It has the same path, hence the same seeds and initial weights, but is
        not part of this layer's theta, VariablesByPath or checkpoints. Data
        parallel replicas build their mirrored copies of the pipeline's layers
        this way: one checkpointed copy, R identical ones in memory.
        """
        if params.fprop_dtype is not None and not self.APPLIES_CHILD_DTYPES:
            raise ValueError(
                f'{self.path}/{name}: fprop_dtype={params.fprop_dtype!r} would be ignored: '
                f'{type(self).__name__} calls its children itself; set fprop_dtype on '
                f'{self.path} or on a layer of a pipeline body or Sequential')
        p = params.Copy()
        p.name = name
        if p.random_seed is None:
            p.random_seed = self._seed
        return p.Instantiate(parent=self)

    def CreateChildren(self, params_list: Sequence[Params]) -> list['BaseLayer']:
        """Builds one child per params, each named by its own `name`."""
        return [self.CreateChild(p.name, p) for p in params_list]

    def CreateVariable(self, name: str, shape: Sequence[int], init: str = 'glorot_uniform',
                       trainable: bool = True, dtype: Optional[tf.DType] = None) -> tf.Variable:
        """Creates a variable on the current device with a path-seeded initial value."""
        self._CheckNewName(name)
        dtype = dtype or self.params.dtype
        value = initializers.get(init)(list(shape), dtype,
                                       initializers.seed_for(self._seed, f'{self.path}/{name}'))
        var = tf.Variable(value, trainable=trainable, name=name)
        self._vars[name] = var
        return var

    def CreateVariableShards(self, name: str, shape: Sequence[int], axis: int,
                             devices: Sequence[Optional[str]], init: str = 'glorot_uniform',
                             sizes: Optional[Sequence[int]] = None) -> list[tf.Variable]:
        """Weight `name` of the whole `shape` split along `axis` into len(devices) equal
        shards (or of `sizes`: a vocabulary T does not divide), shard t a variable on
        devices[t] (tensor parallelism).

        The whole initial value is drawn once, seeded by the whole weight's path, and
        cut: every T starts from the weights of T=1. One device gives one variable
        named `name`; more give `name`_shard0, ... (`variable_shards`), which
        checkpoints save as the whole weight under `name`.
        """
        size = len(devices)
        if sizes is not None and (len(sizes) != size or sum(sizes) != shape[axis]):
            raise ValueError(f'{self.path}: {name} shard sizes {list(sizes)} do not split its '
                             f'{shape[axis]} rows/columns on axis {axis} over {size} devices')
        if sizes is None and shape[axis] % size:
            raise ValueError(f'{self.path}: {name} has {shape[axis]} rows/columns on axis '
                             f'{axis}, not divisible by tensor_parallel={size}')
        dtype = self.params.dtype
        # No device (T=1 outside a pipeline): the caller's scope, which tf.device(None) clears.
        with _scope(devices[0]):
            whole = initializers.get(init)(list(shape), dtype,
                                           initializers.seed_for(self._seed, f'{self.path}/{name}'))
            pieces = tf.split(whole, list(sizes or [shape[axis] // size] * size), axis) \
                if size > 1 else [whole]
        shards = []
        for t, (device, piece) in enumerate(zip(devices, pieces)):
            shard = variable_shards.shard_name(name, t, size)
            self._CheckNewName(shard)
            with _scope(device):
                shards.append(tf.Variable(piece, name=shard))
            self._vars[shard] = shards[-1]
        if size > 1:
            self._sharded[name] = variable_shards.ShardedWeight(f'{self.path}/{name}', shards,
                                                                axis)
        return shards

    def TieVariable(self, name: str, owner: tf.Variable) -> None:
        """Uses `owner`, another layer's variable, in place of this layer's variable `name`.

        The own variable is dropped; the shared one stays out of this layer's
        `theta` and `VariablesByPath`, so an optimizer updates it once and a
        checkpoint holds it once, under its owner's path. Whoever runs FProp with a
        theta passes it in (PipeliningLayer does, see `tfpipe.pipeline.ties`).
        """
        own = self._vars.get(name)
        if own is None:
            raise ValueError(f'{self.path!r} has no variable {name!r} to tie; its variables '
                             f'are {sorted(self._vars)}')
        if tuple(own.shape) != tuple(owner.shape) or own.dtype != owner.dtype:
            raise ValueError(f'cannot tie {self.path}/{name} ({own.dtype.name} '
                             f'{own.shape.as_list()}) to {owner.name} ({owner.dtype.name} '
                             f'{owner.shape.as_list()}): shapes and dtypes must be equal')
        del self._vars[name]
        self._tied[name] = owner

    def ReplaceVariables(self, replacements: dict[int, tf.Variable]) -> None:
        """Puts replacements[id(v)] in place of each own or descendant variable v that it
        names (ZeRO stage 3 swaps whole weights for a replica's parts:
        tfpipe/pipeline/sharded_weights.py); the replaced variables are dropped. A new
        dict, not item assignment: TensorFlow's tracked dict keeps every variable ever
        stored in it alive."""
        self._vars = {name: replacements.get(id(var), var) for name, var in self._vars.items()}
        for child in self._children.values():
            child.ReplaceVariables(replacements)

    @property
    def tied_variables(self) -> dict[str, tf.Variable]:
        """This layer's tied variables by name: other layers' variables it reads."""
        return dict(self._tied)

    @property
    def theta(self) -> dict:
        """Nested dict of trainable variables: own by name, children's by child name.
        Tied variables belong to their owner's theta, not to this one."""
        out: dict[str, Any] = {n: v for n, v in self._vars.items() if v.trainable}
        for n, child in self._children.items():
            out[n] = child.theta
        return out

    def VariablesByPath(self) -> dict[str, tf.Variable]:
        """Every variable (trainable or not) of this layer and its descendants,
        keyed by layer path: 'pipe/fc3/w'.

        Checkpoints are keyed this way, never by cell or device, so a run can be
        resumed under another partitioning.
        """
        out = {f'{self.path}/{n}': v for n, v in self._vars.items()}
        for child in self._children.values():
            out.update(child.VariablesByPath())
        return out

    # -- Computation -----------------------------------------------------------------

    def FProp(self, theta: dict, *inputs: Any) -> Any:
        """Forward pass with weights `theta` (same structure as `self.theta`)."""
        raise NotImplementedError(f'{type(self).__name__} does not implement FProp')

    def __call__(self, *inputs: Any) -> Any:
        return self.FProp({**self.theta, **self._tied}, *inputs)

    @classmethod
    def FPropMeta(cls, p: Params, *input_shapes: tf.TensorShape) -> LayerMeta:
        """Flops and output shapes of FProp for `input_shapes`, from params alone."""
        raise NotImplementedError(
            f'{cls.__name__} does not implement FPropMeta: give the pipeline an explicit '
            "balance or partition it by 'time'")

    @classmethod
    def NumParams(cls, p: Params) -> int:
        """Number of trainable scalars this layer creates, from params alone."""
        raise NotImplementedError(
            f'{cls.__name__} does not implement NumParams: give the pipeline an explicit '
            "balance or partition it by 'flops' or 'time'")


def _scope(device: Optional[str]):
    """tf.device(device), or the caller's device scope for None."""
    return tf.device(device) if device is not None else contextlib.nullcontext()


def cast_floats(struct: Any, dtype: tf.DType) -> Any:
    """Float leaves of a nested structure cast to `dtype`; ints ride along."""
    def cast(t):
        if not t.dtype.is_floating or t.dtype == dtype:
            return t
        # Where the tensor is: a weight shard (tensor parallelism) is cast on its device.
        here = not tf.executing_eagerly() and getattr(t, 'device', '')
        with tf.device(t.device) if here else contextlib.nullcontext():
            return tf.cast(t, dtype)
    return tf.nest.map_structure(cast, struct)


def apply_layer(layer: BaseLayer, theta: dict, activation: Any,
                fprop_dtype: Optional[tf.DType] = None) -> Any:
    """Applies one layer of a sequence to an activation that may carry skips.

    A dict activation holds the main tensor under 'x' and stashed skip tensors
    under other keys (see layers.Stash / layers.Pop); a plain layer transforms
    'x' and the skips ride along, so a skip can cross cell boundaries.

    The layer computes in its own `fprop_dtype`, else in `fprop_dtype` (the
    sequence's default), else in the dtype of the weights it is given (so a
    float32 layer after a bfloat16 one gets float32 inputs); a layer without
    float weights takes its inputs as they come. The casts sit under the
    caller's tape, so weight gradients come back in the variables' dtype.
    """
    dtype = layer.params.fprop_dtype or fprop_dtype
    if dtype is None:
        dtype = next((t.dtype for t in tf.nest.flatten(theta) if t.dtype.is_floating), None)
    if dtype is not None:
        theta, activation = cast_floats(theta, dtype), cast_floats(activation, dtype)
    if layer.NESTED_ACTIVATIONS or not isinstance(activation, dict):
        return layer.FProp(theta, activation)
    out = dict(activation)
    out['x'] = layer.FProp(theta, activation['x'])
    return out


def layer_meta(p: Params, shapes: Any) -> LayerMeta:
    """`FPropMeta` of the layer described by `p`, under the same rule as apply_layer."""
    if p.cls.NESTED_ACTIVATIONS or not isinstance(shapes, dict):
        return p.cls.FPropMeta(p, shapes)
    meta = p.cls.FPropMeta(p, shapes['x'])
    return dataclasses.replace(meta, out_shapes={**shapes, 'x': meta.out_shapes})


def body_metas(body: Sequence[Params], shapes: Any) -> list[LayerMeta]:
    """`layer_meta` of each layer of a sequence, each fed the previous one's output shapes."""
    metas = []
    for p in body:
        metas.append(layer_meta(p, shapes))
        shapes = metas[-1].out_shapes
    return metas


def body_meta(body: Sequence[Params], shapes: Any) -> LayerMeta:
    """Total flops and final output shapes of a sequence of layers."""
    metas = body_metas(body, shapes)
    return sum_metas(metas, metas[-1].out_shapes if metas else shapes)


def flatten_by_path(nested: dict, prefix: str) -> dict[str, Any]:
    """{'pipe': {'fc0': {'w': v}}} -> {'<prefix>/pipe/fc0/w': v}: theta-shaped data
    (weights, gradients) keyed like `VariablesByPath`."""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        path = f'{prefix}/{key}'
        if isinstance(value, dict):
            out.update(flatten_by_path(value, path))
        else:
            out[path] = value
    return out
