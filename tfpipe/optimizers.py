"""Optimizers for plain tf.Variables keyed by path, with slots beside their variable.

Not Keras optimizers: Keras 3 ones do not reliably drive plain ``tf.Variable`` s and
name slots by creation order. Here variables are ``{path: variable}``; a slot lives on
its variable's device (pipeline cells sit on different devices: an update must not
ship weights or moments across them), is keyed by the path (checkpoint name
``optimizer/_slots/pipe-fc3-w/m``: it restores into any optimizer built for the same
paths, whatever the creation order) and starts at zero. ``Apply`` works in tf.function.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from typing import Callable, Iterator, Optional, Sequence

import tensorflow as tf

from tfpipe import split_statistics, variable_shards
from tfpipe.hyperparams import InstantiableParams, Params

__all__ = ['BaseOptimizer', 'SGD', 'Adam', 'RMSProp', 'Adafactor', 'Whole',
           'clip_by_global_norm']

Grads = dict[str, Optional[tf.Tensor]]
Variables = dict[str, tf.Variable]
_T = tf.Tensor
_PATH_RE = re.compile(r'^\w+(/\w+)*$', re.ASCII)
_RANGES = {'unit': ('in [0, 1)', lambda x: 0 <= x < 1),
           'positive': ('a finite number > 0', lambda x: 0 < x < math.inf),
           'exponent': ('in (0, 1]', lambda x: 0 < x <= 1)}


def slot_key(path: str) -> str:
    """'pipe/fc3/w' -> 'pipe-fc3-w': one-to-one, and free of the '/' and '.' that
    checkpoint keys escape, so the path stays readable in ``tf.train.list_variables``."""
    if not isinstance(path, str) or not _PATH_RE.match(path):
        raise ValueError(f'variable path {path!r} is not slash-separated identifiers; use '
                         "paths like 'pipe/fc3/w' (they name the slots in checkpoints)")
    return path.replace('/', '-')


def whole_slots(variables: Variables, slots: dict,
                slot_shapes: Callable[[tf.TensorShape], dict],
                others: Sequence[tuple[Variables, dict]] = ()) -> Optional[tf.Module]:
    """The slots as checkpointed: each split weight's slots joined under the whole weight's
    slot key into the slot of the whole weight, of shape `slot_shapes(whole shape)[name]`
    (split_statistics.whole_slot); None when no weight is split. A weight is split as
    checkpoints save it (`variable_shards.checkpointed_as`): a tensor-parallel weight's
    shards, whose slots are all in `slots`, or an expert weight's slices over P replicas,
    whose other slices' slots are in `others` ((variables, slots) of the other replicas'
    optimizers), or a trainer client's expert rows (ClientSlices), whose slots are saved
    whole from every client's rows. A slot is a tf.Variable or anything with its shape,
    dtype, device, read_value and assign (the sharded optimizer's)."""
    key_of = {id(var): (slots_, slot_key(path))  # only where those slots are held
              for variables_, slots_ in [*others, (variables, slots)]
              for path, var in variables_.items() if slot_key(path) in slots_}
    out: dict = {}
    for path, var in variables.items():
        sharded = variable_shards.checkpointed_as(var)
        if isinstance(sharded, variable_shards.ClientSlices):  # other clients hold the rest
            out[slot_key(path)] = {name: sharded.slot(f'{slot_key(path)}/{name}', slot)
                                   for name, slot in slots[slot_key(path)].items()}
            continue
        found = [key_of.get(id(s)) for s in sharded.shards] if sharded is not None else [None]
        if None in found or len(found) == 1:  # not split, or not every shard's slots are here
            out[slot_key(path)] = slots[slot_key(path)]
            continue
        whole = slot_key(variable_shards.whole_path(path, sharded))
        for name, shape in slot_shapes(sharded.shape).items():
            if name not in out.setdefault(whole, {}):
                out[whole][name] = split_statistics.whole_slot(
                    f'{whole}/{name}', [held[key][name] for held, key in found], shape)
    if all(out.get(key) is value for key, value in slots.items()):
        return None
    tree = tf.Module()
    for key, value in out.items():
        setattr(tree, key, value)
    return tree


def check_split_weights(rule: 'BaseOptimizer', variables: Variables) -> None:
    """Refuses a rule whose update reads statistics of the whole weight (Adafactor) for a
    weight split over a tensor-parallel cell's devices of which `variables` hold only some
    shards: the statistics are reduced over the shards updated together
    (split_statistics), so without all of them the update would not be the T=1 one."""
    missing = rule.WHOLE_WEIGHT_STATISTICS and split_statistics.missing_shard(variables)
    if missing:
        whole, count = missing
        raise ValueError(
            f'{type(rule).__name__} needs statistics of whole weights and {whole} is split '
            f'over {count} devices of which only some shards are given: pass every shard '
            'variable (VariablesByPath()) to the optimizer, or use Adam, RMSProp or SGD')


def checkpointed_slots(children: dict, save_type: str) -> dict:
    """An optimizer's trackable children with `_whole_slots` (see whole_slots) in place
    of `_slots` in checkpoints: the slots of a weight split over devices (tensor
    parallelism) save whole under the whole weight's key, as the weight itself does
    (variable_shards), so a checkpoint moves between any T."""
    whole = children.pop('_whole_slots', None)  # only ever in place of _slots
    if save_type == 'checkpoint' and whole is not None:
        children['_slots'] = whole
    return children


def _ema(slot: tf.Variable, decay: float | _T, x: _T) -> _T:
    """slot = decay * slot + (1 - decay) * x. read_value(): a bare read drops tf.device."""
    return _write(slot, decay * slot.read_value() + (1 - decay) * x)


def _write(slot: tf.Variable, value: _T) -> _T:
    """slot = value, copied into the slot's own buffer; returns `value` (a read of the slot
    would be a copy, below, and drop tf.device).

    `slot.assign(value)` adopts `value`'s buffer when nothing else reads it, so every
    update moved the slots into buffers the step allocated among its temporaries. The
    BFC allocator hands out a free chunk whole when it is under twice the request, and
    counts (and holds) the whole chunk, so the moved slots took more memory step after
    step: GPT2SmallShapedLM's Adam slots (652 MiB) raised the host's bytes between steps
    from 1,011 to 1,122 MiB over 8 steps and its peak from 1,614 to 1,774 MiB; written in
    place, 1,013 MiB after every step and a peak of 1,580-1,626 (docs/memory.md). The
    full-slice assign writes in place at the cost of a copy, and puts the slot in
    TensorFlow's copy-on-read mode: its reads (this rule's, a checkpoint's) copy it."""
    with tf.device(slot.device):  # slot[...] = value, without slot[...]'s read
        tf.raw_ops.ResourceStridedSliceAssign(ref=slot.handle, begin=[0], end=[0],
                                              strides=[1], value=value, ellipsis_mask=1)
    return value


class Whole:
    """The variable an update belongs to, for rules that look beyond their own elements.

    An update may cover all of a variable or one replica's shard of it
    (tfpipe.pipeline.sharded_optimizer). Element-wise rules need only their part;
    Adafactor also needs statistics of the whole variable, which it takes from
    here: `grad` and `weight` are whole (a shard's replica holds both), `cut`
    maps a whole-shaped tensor to the part being updated and `total` sums a
    per-part scalar over all parts. Here the part is the whole variable. (A
    tensor-parallel shard is a variable of its own; `split_statistics.Split`
    combines the Wholes of a weight's shards.)
    """

    def __init__(self, grad: _T, weight: _T) -> None:
        self.grad = grad
        self.weight = weight

    @property
    def shape(self) -> tf.TensorShape:
        """The whole variable's shape (known without reading a sharded weight whole)."""
        return self.weight.shape

    def cut(self, x: _T) -> _T:
        return x

    def total(self, x: _T) -> _T:
        return x


class BaseOptimizer(tf.Module):
    """Slot bookkeeping, checks and the per-variable loop; subclasses give the rule."""

    # (name, default, range, doc) per hyper-parameter, for Params() and __init__'s checks;
    # range: a _RANGES key ('?' appended: None allowed too) or None (no check, for bools).
    HYPER_PARAMS: tuple[tuple[str, object, Optional[str], str], ...] = ()
    # Whether the update of an element reads more of its weight than that element (and
    # its gradient and slots): such a rule updates a tensor-parallel weight's shards
    # together (`_deltas` with the split_statistics.Split of all of them).
    WHOLE_WEIGHT_STATISTICS = False

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.Define('name', 'optimizer', 'Name of the optimizer module (an identifier).')
        for name, default, _, doc in cls.HYPER_PARAMS:
            p.Define(name, default, doc)
        return p

    def __init__(self, params: Params) -> None:
        self._require(isinstance(params.name, str) and params.name.isidentifier(),
                      f'name={params.name!r} must be an identifier; set p.name')
        super().__init__(name=params.name)
        self._params = params
        for name, _, kind, _ in self.HYPER_PARAMS:
            value = params.Get(name)
            if kind is not None and not (value is None and kind.endswith('?')):
                valid, test = _RANGES[kind.rstrip('?')]
                self._require(isinstance(value, (int, float)) and test(value),
                              f'{name}={value!r} must be {valid}; set p.{name}')
        with tf.init_scope():  # eager even if the optimizer is built in a tf.function
            self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name='iterations')
        self._slots: dict = {}  # slot key -> {slot name: variable}; tracked by tf.Module
        self._shapes: dict[str, tf.TensorShape] = {}  # path -> shape; {}: no slots yet

    def _require(self, ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f'{type(self).__name__}: {message}')

    def _slot_shapes(self, shape: tf.TensorShape) -> dict[str, list[int]]:
        """{slot name: shape} for a variable of `shape` (subclasses)."""
        raise NotImplementedError

    def _delta(self, lr: _T, step: _T, grad: _T, slots: Variables, whole: Whole) -> _T:
        """What to subtract from the part of a variable that `grad` covers, updating its
        slots (those of the variable's shape cover that part too, others are whole).
        lr, step (1-based) and grad are in the variable's dtype (subclasses of
        element-wise rules)."""
        raise NotImplementedError

    def _deltas(self, lr: _T, step: _T, grads: list[_T], slots: list[Variables],
                split: split_statistics.Split) -> list[_T]:
        """`_delta` of each part of `split` (a weight's tensor-parallel shards, or the whole
        weight) on its device; a rule with WHOLE_WEIGHT_STATISTICS overrides it."""
        return split.each(lambda g, s, w: self._delta(lr, step, g, s, w), grads, slots,
                          split.parts)

    def SlotShapes(self, shape: tf.TensorShape) -> dict[str, list[int]]:
        """{slot name: shape} of the slots of a variable of `shape`."""
        return self._slot_shapes(tf.TensorShape(shape))

    def Deltas(self, lr: _T, step: _T, grads: list[_T], slots: list[Variables],
               split: split_statistics.Split) -> list[_T]:
        """One update's decrements of the parts of a weight (`split`: its shards, or the
        whole weight) that `grads` cover, each on its part's device; updates `slots`. For
        tfpipe.pipeline.sharded_optimizer; `Apply` is the usual entry."""
        return self._deltas(lr, step, grads, slots, split)

    @property
    def params(self) -> Params:
        return self._params

    def CreateSlots(self, variables: Variables) -> None:
        """Creates zero slots beside each variable; a repeat with the same paths is a no-op."""
        shapes = {path: tf.TensorShape(var.shape) for path, var in variables.items()}
        if self._shapes:
            self._require(shapes == self._shapes, 'CreateSlots was already called for other '
                          'paths or shapes; build a new optimizer for a new model')
            return
        check_split_weights(self, variables)
        slots = {}
        with tf.init_scope():  # eager variables even if called inside tf.function
            for path in sorted(variables):
                var, key = variables[path], slot_key(path)
                self._require(shapes[path].is_fully_defined(), f'variable {path!r} has '
                              f'shape {shapes[path]}; slots need a fully defined shape')
                with tf.device(var.device):
                    slots[key] = {name: tf.Variable(tf.zeros(shape, var.dtype), trainable=False,
                                                    name=f'{path}/{name}')
                                  for name, shape in self._slot_shapes(shapes[path]).items()}
        self._slots.update(slots)  # in place: a restore() made before binds on insertion
        self._shapes = shapes
        self._whole_slots = whole_slots(variables, self._slots, self.SlotShapes)

    def JoinReplicaSlots(self, variables: Variables,
                         others: Sequence[tuple[Variables, 'BaseOptimizer']]) -> None:
        """Checkpoints the slots of a weight whose other slices other replicas' optimizers
        update (expert parallelism: replicas 1..P-1 hold the other experts of replica 0's
        expert weights) whole, joined with theirs, as checkpoints save the weight itself
        (variable_shards.whole_view): Adam's m of `.../moe/wi` as [E, D, H] under its slot
        key, restored into any P. `variables`: those given to CreateSlots; `others`: each
        other replica's (variables, optimizer), after their CreateSlots."""
        self._whole_slots = whole_slots(variables, self._slots, self.SlotShapes,
                                        [(v, other._slots) for v, other in others])

    def _trackable_children(self, save_type='checkpoint', **kwargs):
        return checkpointed_slots(super()._trackable_children(save_type, **kwargs), save_type)

    def GetSlot(self, path: str, name: str) -> tf.Variable:
        """The slot `name` (e.g. 'm') of the variable at `path`."""
        return self._slots[slot_key(path)][name]

    @property
    def slot_variables(self) -> list[tf.Variable]:
        """All slots, ordered by variable path then slot name (not creation order)."""
        return [s[n] for _, s in sorted(self._slots.items()) for n in sorted(s)]

    def Apply(self, lr: tf.Tensor, grads: Grads, variables: Variables) -> None:
        """Applies one update with learning rate `lr`; None gradients are skipped."""
        self._require(not isinstance(lr, (int, float)) or lr >= 0,
                      f'learning rate {lr!r} must be >= 0')
        for path, grad in grads.items():
            self._require(path in self._shapes, f'no slots for {path!r}; call '
                          'CreateSlots(variables) with it before Apply')
            self._require(path in variables, f'gradient for {path!r} has no variable')
            shape = tf.TensorShape(variables[path].shape)
            self._require(shape == self._shapes[path], f'variable {path!r} has shape {shape}, '
                          f'slots {self._shapes[path]}; pass the variable given to CreateSlots')
            self._require(grad is None or tf.TensorShape(grad.shape).is_compatible_with(shape),
                          f'gradient for {path!r} has shape {getattr(grad, "shape", None)}, '
                          f'variable {shape}; they must match')
        step = self.iterations.assign_add(1)  # this update's 1-based number
        chains = UpdateChains()
        for paths, axis in split_statistics.groups(grads, variables,
                                                   self.WHOLE_WEIGHT_STATISTICS):
            with chains.next(variables[paths[0]].device) as done:
                parts = []
                for path in paths:
                    var = variables[path]
                    with tf.device(var.device):
                        lr_, step_, grad_ = cast_args(lr, step, grads[path], var.dtype)
                        parts.append(Whole(grad_, var.read_value()))
                split = split_statistics.Split(parts, [variables[p].device for p in paths],
                                               axis)
                with tf.device(split.devices[0]):  # the scalars on the home shard's device
                    deltas = self._deltas(lr_, step_, [part.grad for part in parts],
                                          [self._slots[slot_key(path)] for path in paths],
                                          split)
                for path, delta in zip(paths, deltas):
                    with tf.device(variables[path].device):
                        done.append(variables[path].assign_sub(delta, read_value=False))


class UpdateChains:
    """Orders an update's weights into as many chains per allocator as the host runs ops
    at once (its inter-op threads): a weight's update starts after the update of the
    weight before it in its chain has ended.

    Unordered, the executor starts the updates of many weights before it ends any, and
    each holds several temporaries of its weight's size (Adam: the new moments, their
    bias corrections, the square root, the quotient) until it ends: GPT2SmallShapedLM's
    update (85M parameters, one cell) held up to about 500 MiB above the weights, slots
    and gradient sums, a different amount at every step (its step's peak 1,726-1,838 MiB
    over 6 steps). In two chains it holds what two weights' updates hold, the step's peak
    stays at its backward's (1,725-1,739 MiB) and the step takes as long (7.0-7.3 s
    against 7.1 s); GPT2MediumShapedLM's peak fell by 230-540 MiB (docs/memory.md). The
    logical CPUs of a host share one allocator and one pool of threads, so their weights
    share chains; each GPU has its own.
    """

    def __init__(self):
        self.count = (tf.config.threading.get_inter_op_parallelism_threads()
                      or os.cpu_count() or 1)  # 0: TensorFlow's default, one per core
        self._ends: dict[tuple, list[list]] = {}  # {allocator: each chain's last ops}
        self._turn: dict[tuple, int] = {}

    @contextlib.contextmanager
    def next(self, device: str, lane: int = 0) -> Iterator[list]:
        """A block whose ops run after the last ops of `device`'s allocator's next chain;
        the block appends its own last ops (its weights' assignments) to the list it gets.

        Each `lane` has chains of its own: a sharded optimizer's local replicas, whose
        updates of one weight meet in collectives, each chain their weights in the same
        order, so every weight's partners wait only behind earlier weights. In shared
        chains replica 1's first weight would wait behind replica 0's last ones, while
        those wait behind replica 0's first, which waits in a collective for replica 1's.
        """
        spec = tf.DeviceSpec.from_string(device)
        key = (spec.job, spec.replica, spec.task, spec.device_type,
               None if spec.device_type == 'CPU' else spec.device_index, lane)
        turn = self._turn.get(key, 0)
        self._turn[key] = turn + 1
        ends = self._ends.setdefault(key, [[] for _ in range(self.count)])
        done: list = []
        with tf.control_dependencies(ends[turn % self.count]):
            yield done
        ends[turn % self.count] = done


def cast_args(lr, step: _T, grad, dtype: tf.DType) -> tuple[_T, _T, _T]:
    """lr, step and gradient in a variable's dtype (a Python lr not via float32)."""
    return tuple(tf.cast(tf.convert_to_tensor(x, dtype_hint=dtype), dtype)
                 for x in (lr, step, grad))


class SGD(BaseOptimizer):
    """Gradient descent with optional (Nesterov) momentum, TF1 MomentumOptimizer rule.

    ``a = momentum * a + g``; ``w -= lr * a`` (Nesterov: ``w -= lr * (g + momentum * a)``).
    The accumulator holds no lr, so a schedule's change of lr takes effect at once.
    """

    HYPER_PARAMS = (
        ('momentum', 0.0, 'unit', 'Momentum in [0, 1); 0 keeps no accumulator slot.'),
        ('nesterov', False, None, 'Use Nesterov momentum (no effect if momentum is 0).'))

    def _slot_shapes(self, shape: tf.TensorShape) -> dict[str, list[int]]:
        return {'momentum': shape.as_list()} if self._params.momentum > 0 else {}

    def _delta(self, lr: _T, step: _T, grad: _T, slots: Variables, whole: Whole) -> _T:
        mu = self._params.momentum
        if mu > 0:
            accum = _write(slots['momentum'], mu * slots['momentum'].read_value() + grad)
            grad = grad + mu * accum if self._params.nesterov else accum
        return lr * grad


class Adam(BaseOptimizer):
    """Adam (Kingma & Ba 2015, Algorithm 1: epsilon outside the bias-corrected sqrt).

    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + epsilon)``, t = iterations.
    """

    HYPER_PARAMS = (
        ('beta1', 0.9, 'unit', 'Decay of the first moment, in [0, 1).'),
        ('beta2', 0.999, 'unit', 'Decay of the second moment, in [0, 1).'),
        ('epsilon', 1e-8, 'positive', 'Added to sqrt(v_hat) to bound the step; > 0.'))

    def _slot_shapes(self, shape: tf.TensorShape) -> dict[str, list[int]]:
        return {'m': shape.as_list(), 'v': shape.as_list()}

    def _delta(self, lr: _T, step: _T, grad: _T, slots: Variables, whole: Whole) -> _T:
        p = self._params
        m_hat = _ema(slots['m'], p.beta1, grad) / (1 - p.beta1 ** step)
        v_hat = _ema(slots['v'], p.beta2, tf.square(grad)) / (1 - p.beta2 ** step)
        return lr * m_hat / (tf.sqrt(v_hat) + p.epsilon)


class RMSProp(BaseOptimizer):
    """RMSProp with momentum, TF1 RMSPropOptimizer rule (epsilon inside the sqrt).

    ``ms = decay ms + (1-decay) g^2``; ``mom = momentum mom + lr g / sqrt(ms + epsilon)``;
    ``w -= mom``. Defaults (decay 0.9, momentum 0.9, epsilon 1.0) are the TF ImageNet
    recipe that GPipe's AmoebaNet training follows; the large epsilon damps the first
    steps. ``ms`` starts at zero (TF1 used one) like every slot here.
    """

    HYPER_PARAMS = (
        ('decay', 0.9, 'unit', 'Decay of the mean square, in [0, 1).'),
        ('momentum', 0.9, 'unit', 'Momentum in [0, 1); 0 keeps no momentum slot.'),
        ('epsilon', 1.0, 'positive', 'Added to the mean square under the sqrt; > 0.'))

    def _slot_shapes(self, shape: tf.TensorShape) -> dict[str, list[int]]:
        names = ('ms', 'momentum') if self._params.momentum > 0 else ('ms',)
        return {name: shape.as_list() for name in names}

    def _delta(self, lr: _T, step: _T, grad: _T, slots: Variables, whole: Whole) -> _T:
        p = self._params
        ms = _ema(slots['ms'], p.decay, tf.square(grad))
        delta = lr * grad * tf.math.rsqrt(ms + p.epsilon)
        if p.momentum > 0:
            mom = slots['momentum']
            delta = _write(mom, p.momentum * mom.read_value() + delta)
        return delta


class Adafactor(BaseOptimizer):
    """Adafactor (Shazeer & Stern 2018), simplified: Algorithms 4/5 without their lr rule.

    - Second moments of g^2 + epsilon1: for rank >= 2 factored over the last two axes
      into row means ``vr`` (shape[:-1]) and column means ``vc`` (shape[:-2]+shape[-1:]),
      ``V = vr vc / mean(vr)`` (equal to the paper's sums form); rank < 2 keeps a full ``v``.
    - beta2: ``1 - t^(-decay_exponent)`` (paper's 0.8 schedule) when ``beta2`` is None,
      else the bias-corrected fixed ``beta2 (1 - beta2^(t-1)) / (1 - beta2^t)`` (paper
      sec. 7). Both are 0 at t = 1, so zero-initialised slots carry no bias.
    - ``U = g / sqrt(V)`` clipped to ``U / max(1, RMS(U) / clipping_threshold)``; with
      beta1 > 0 (default 0: no momentum, no slot) U is then averaged into slot ``m``.
    - Step ``lr * max(epsilon2, RMS(w))`` (multiply_by_parameter_scale) or ``lr``: the
      schedule's lr plays the paper's relative step size rho_t.
    - A weight split over a tensor-parallel cell's T devices is updated shard by shard with
      the statistics reduced over its shards (split_statistics): each shard's update is its
      part of the T=1 update.
    """

    HYPER_PARAMS = (
        ('beta1', 0.0, 'unit', 'Momentum on the clipped update, in [0, 1); 0 = no slot.'),
        ('beta2', None, 'unit?', 'Fixed beta2 (bias-corrected); None: 1 - t^-decay_exponent.'),
        ('decay_exponent', 0.8, 'exponent', 'c of beta2_t = 1 - t^(-c); in (0, 1].'),
        ('epsilon1', 1e-30, 'positive', 'Added to g^2 before averaging; > 0.'),
        ('epsilon2', 1e-3, 'positive', 'Lower bound of the parameter scale RMS(w); > 0.'),
        ('clipping_threshold', 1.0, 'positive', 'Update clipping threshold d; > 0.'),
        ('multiply_by_parameter_scale', True, None, 'Scale steps by max(eps2, RMS(w)).'),
        ('factored', True, None, 'Factor second moments of rank >= 2 variables.'))
    WHOLE_WEIGHT_STATISTICS = True  # row/column moments, RMS(update), RMS(w)

    def _factored(self, shape: tf.TensorShape) -> bool:
        return self._params.factored and shape.rank >= 2

    def _slot_shapes(self, shape: tf.TensorShape) -> dict[str, list[int]]:
        dims = shape.as_list()
        out = ({'vr': dims[:-1], 'vc': dims[:-2] + dims[-1:]} if self._factored(shape)
               else {'v': dims})
        return {**out, 'm': dims} if self._params.beta1 > 0 else out

    def _deltas(self, lr: _T, step: _T, grads: list[_T], slots: list[Variables],
                split: split_statistics.Split) -> list[_T]:
        p = self._params
        if p.beta2 is None:
            beta2 = 1.0 - step ** -p.decay_exponent
        else:
            beta2 = p.beta2 * (1.0 - p.beta2 ** (step - 1)) / (1.0 - p.beta2 ** step)
        if self._factored(split.shape):
            # Row and column means of the whole weight's g^2: each part's slot holds its
            # piece (or all) of them, and so does its preconditioner until cut to the part.
            rows, axis = split.shape.rank - 1, split.axis
            g2 = split.each(lambda w: tf.square(w.grad) + p.epsilon1, split.parts)
            vr = split.each(lambda s, x: _ema(s['vr'], beta2, x), slots,
                            split.mean(g2, rows, axis))
            vc = split.each(lambda s, x: _ema(s['vc'], beta2, x), slots,
                            split.mean(g2, rows - 1, axis))
            vr_axis = axis if axis is not None and axis < rows else None  # else vr is whole
            row_mean = split.mean(vr, rows - 1, vr_axis, keepdims=True)
            precond = split.each(
                lambda w, r, m, c: w.cut(tf.math.rsqrt(r / m)[..., :, None]
                                         * tf.math.rsqrt(c)[..., None, :]),
                split.parts, vr, row_mean, vc)
        else:
            precond = split.each(
                lambda s, g: tf.math.rsqrt(_ema(s['v'], beta2, tf.square(g) + p.epsilon1)),
                slots, grads)
        updates = split.each(tf.multiply, grads, precond)
        squares = split.each(lambda u: tf.reduce_sum(tf.square(u)), updates)
        rms = tf.sqrt(split.total(squares) / tf.cast(split.size, updates[0].dtype))
        updates = split.each(lambda u: u / tf.maximum(rms / p.clipping_threshold, 1.0), updates)
        if p.beta1 > 0:
            updates = split.each(lambda s, u: _ema(s['m'], p.beta1, u), slots, updates)
        if p.multiply_by_parameter_scale:
            weights = split.across(split.each(lambda w: tf.reduce_sum(tf.square(w.weight)),
                                              split.parts))
            lr *= tf.maximum(tf.sqrt(weights / tf.cast(split.size, weights.dtype)), p.epsilon2)
        return split.each(lambda u: lr * u, updates)


def squared_norm(grads: Grads) -> tf.Tensor:
    """The sum of the gradients' squares in float32, each square on its gradient's device
    (only scalars cross devices)."""
    squares = []
    for g in (tf.convert_to_tensor(g) for _, g in sorted(grads.items()) if g is not None):
        with tf.device(g.device):
            squares.append(tf.reduce_sum(tf.square(tf.cast(g, tf.float32))))
    return tf.add_n(squares) if squares else tf.constant(0.0)


def clip_by_norm_of(grads: Grads, max_norm: Optional[float], norm: tf.Tensor) -> Grads:
    """Scales all gradients by ``min(1, max_norm / norm)``: clipping by a global norm the
    caller computed (with expert parallelism, over every replica's experts)."""
    if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm >= 0):
        raise ValueError(f'clip_by_global_norm: max_norm={max_norm!r} must be None or >= 0')
    if not max_norm:
        return dict(grads)
    scale = max_norm / tf.maximum(norm, max_norm)
    clipped: Grads = dict.fromkeys(grads)
    for key, g in grads.items():
        if g is not None:
            g = tf.convert_to_tensor(g)
            with tf.device(g.device):
                clipped[key] = g * tf.cast(scale, g.dtype)
    return clipped


def clip_by_global_norm(grads: Grads, max_norm: Optional[float]) -> tuple[Grads, tf.Tensor]:
    """Scales all gradients by ``min(1, max_norm / global_norm)``; returns them and the norm.

    Squares and scalings run on each gradient's device, so only scalars cross devices.
    ``max_norm`` None or 0: no clipping, but the norm is still returned (for logging).
    """
    norm = tf.sqrt(squared_norm(grads))
    return clip_by_norm_of(grads, max_norm, norm), norm
