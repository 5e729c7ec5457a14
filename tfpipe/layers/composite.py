"""Layers made of layers: sequences, residual blocks and skips across cells."""
from __future__ import annotations

import tensorflow as tf

from tfpipe.base_layer import BaseLayer, LayerMeta, apply_layer, body_meta, sum_metas


class Sequential(BaseLayer):
    """Applies `body` in order; the unpartitioned twin of a PipeliningLayer."""

    NESTED_ACTIVATIONS = True
    APPLIES_CHILD_DTYPES = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('body', [], 'Layer params, applied in order; names must be unique.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        if not self.params.body:
            raise ValueError(f'{self.path}: body is empty; give it at least one layer params')
        self.layers = self.CreateChildren(self.params.body)

    def FProp(self, theta, x):
        for layer in self.layers:
            x = apply_layer(layer, theta[layer.params.name], x)
        return x

    @classmethod
    def FPropMeta(cls, p, shapes):
        return body_meta(p.body, shapes)

    @classmethod
    def NumParams(cls, p):
        return sum(lp.cls.NumParams(lp) for lp in p.body)


class Residual(Sequential):
    """y = x + body(x): a skip connection inside one layer."""

    NESTED_ACTIVATIONS = False

    def FProp(self, theta, x):
        return x + super().FProp(theta, x)

    @classmethod
    def FPropMeta(cls, p, shape):
        meta = super().FPropMeta(p, shape)
        return sum_metas([meta], meta.out_shapes, tf.TensorShape(shape).num_elements())


class Stash(BaseLayer):
    """Keeps a copy of the main activation under `key`, for a later `Pop`.

    The activation becomes a dict {'x': main, key: copy, ...}; plain layers in
    between transform only 'x', so the skip can cross pipeline cells (it is sent
    along with the activation from cell to cell).
    """

    NESTED_ACTIVATIONS = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('key', 'skip', 'Name of the stashed tensor; must differ from "x".')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        if self.params.key == 'x' or not self.params.key:
            raise ValueError(f"{self.path}: key {self.params.key!r} is reserved; pick another")

    def FProp(self, theta, act):
        act = dict(act) if isinstance(act, dict) else {'x': act}
        if self.params.key in act:
            raise ValueError(f'{self.path}: {self.params.key!r} is already stashed; give '
                             'each Stash its own key')
        act[self.params.key] = act['x']
        return act

    @classmethod
    def FPropMeta(cls, p, shapes):
        shapes = dict(shapes) if isinstance(shapes, dict) else {'x': shapes}
        return LayerMeta(0, {**shapes, p.key: shapes['x']})

    @classmethod
    def NumParams(cls, p):
        return 0


class Pop(BaseLayer):
    """Combines the tensor stashed under `key` back into the main activation."""

    NESTED_ACTIVATIONS = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('key', 'skip', 'Name given to the matching Stash.')
        p.Define('combine', 'add', "'add' (x + skip) or 'concat' (along the last axis).")
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        if self.params.combine not in ('add', 'concat'):
            raise ValueError(f"{self.path}: combine {self.params.combine!r} must be 'add' or "
                             "'concat'")

    def FProp(self, theta, act):
        key = self.params.key
        if not isinstance(act, dict) or key not in act:
            raise ValueError(f'{self.path}: nothing is stashed under {key!r}; put a Stash '
                             f'with key={key!r} before this Pop')
        act = dict(act)
        skip = act.pop(key)
        if self.params.combine == 'add':
            act['x'] = act['x'] + skip
        else:
            act['x'] = tf.concat([act['x'], skip], axis=-1)
        return act['x'] if len(act) == 1 else act

    @classmethod
    def FPropMeta(cls, p, shapes):
        shapes = dict(shapes)
        skip = shapes.pop(p.key)
        x = tf.TensorShape(shapes['x'])
        if p.combine == 'concat':
            shapes['x'] = x[:-1].concatenate([x[-1] + tf.TensorShape(skip)[-1]])
        out = shapes['x'] if len(shapes) == 1 else shapes
        return LayerMeta(x.num_elements() if p.combine == 'add' else 0, out)

    @classmethod
    def NumParams(cls, p):
        return 0


class DropSkips(BaseLayer):
    """Ends a stretch of nested activations: {'x': main, ...} -> main."""

    NESTED_ACTIVATIONS = True

    def FProp(self, theta, act):
        return act['x'] if isinstance(act, dict) else act

    @classmethod
    def FPropMeta(cls, p, shapes):
        return LayerMeta(0, shapes['x'] if isinstance(shapes, dict) else shapes)

    @classmethod
    def NumParams(cls, p):
        return 0
