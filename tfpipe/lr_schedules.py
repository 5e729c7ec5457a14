"""Learning-rate schedules configured by Params: ``Value(step)`` is a float32 tensor.

A schedule is plain data plus closed-form arithmetic on the step, so it is
stateless (nothing to checkpoint: the trainer's step counter is the state), can be
evaluated eagerly or inside ``tf.function`` with a tensor step, and its params sit
in the experiment's Params tree beside the optimizer's. Whether ``Value`` is an
absolute rate or a multiplier of one is up to the trainer; the schedules do not care.

Bad params are rejected in ``__init__`` with a one-line ValueError that names the
param and says how to fix it, so a typo fails at build time and not after hours.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import tensorflow as tf

from tfpipe.hyperparams import InstantiableParams, Params

__all__ = ['BaseSchedule', 'Constant', 'LinearWarmupRsqrtDecay', 'Cosine', 'Horizon',
           'follow_max_steps', 'resumed_horizon_change']

StepLike = Union[int, tf.Tensor]


def _require(ok: bool, cls: type, message: str) -> None:
    if not ok:
        raise ValueError(f'{cls.__name__}: {message}')


class BaseSchedule:
    """Base class: holds frozen params and checks the common ``value`` param."""

    # The param that is the run's length (a schedule that decays to its end), or None.
    # None as its value means "the run's max_steps": the trainer fills it in
    # (follow_max_steps), so a longer --max_steps stretches the schedule instead of
    # training past its end at the final rate.
    HORIZON: Optional[str] = None

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.Define('value', 1.0, 'Peak (or constant) learning rate or multiplier; >= 0.')
        return p

    def __init__(self, params: Params) -> None:
        self._params = params
        value = params.value
        _require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                 type(self), f'value={value!r} must be a finite number >= 0; set p.value to '
                 'the peak learning rate (a negative rate would ascend the loss)')

    @property
    def params(self) -> Params:
        return self._params

    def Value(self, step: StepLike) -> tf.Tensor:
        """The schedule at `step` (int or int tensor), a float32 scalar tensor."""
        raise NotImplementedError(f'{type(self).__name__} does not implement Value')

    @staticmethod
    def _step(step: StepLike) -> tf.Tensor:
        # float32 is exact for steps below 2**24 and within 1e-7 relative beyond; a
        # schedule needs no more, and float32 keeps the result usable on any device.
        return tf.cast(tf.convert_to_tensor(step), tf.float32)

    def _check_warmup(self) -> int:
        warmup = self._params.warmup_steps
        _require(isinstance(warmup, int) and warmup >= 0, type(self),
                 f'warmup_steps={warmup!r} must be an int >= 0; set p.warmup_steps to the '
                 'number of steps of the linear ramp (0 for none)')
        return warmup

    @staticmethod
    def _warmup(step: tf.Tensor, peak: float, warmup: int) -> tf.Tensor:
        """peak * step / warmup; safe for warmup == 0 (the caller then never selects it)."""
        return peak * step / float(max(warmup, 1))


class Constant(BaseSchedule):
    """``value`` at every step: the baseline, and the multiplier 1.0 by default."""

    def Value(self, step: StepLike) -> tf.Tensor:
        del step  # a constant does not depend on it, but the signature is shared
        return tf.constant(self._params.value, tf.float32)


class LinearWarmupRsqrtDecay(BaseSchedule):
    """Linear warm-up from 0 to ``value``, then ``value * sqrt(warmup_steps / step)``.

    The Transformer schedule: the ramp avoids early Adam steps with poor second-moment
    estimates, the inverse-sqrt tail decays slowly enough to need no total length.
    Both pieces equal ``value`` at ``step == warmup_steps``, so it is continuous.
    Step 0 gives 0: pass the number of updates done so far plus one if the very
    first update must move the weights.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = super().Params()
        p.Define('warmup_steps', 4000, 'Steps of the linear ramp; > 0 (the rsqrt tail is '
                 'scaled by it).')
        return p

    def __init__(self, params: Params) -> None:
        super().__init__(params)
        warmup = self._check_warmup()
        _require(warmup > 0, type(self), 'warmup_steps=0 would make the rsqrt tail 0 '
                 'everywhere; set p.warmup_steps >= 1 (or use Constant)')

    def Value(self, step: StepLike) -> tf.Tensor:
        p = self._params
        s = self._step(step)
        warm = float(p.warmup_steps)
        decay = p.value * tf.sqrt(warm / tf.maximum(s, warm))  # max: no div-by-0 at step 0
        return tf.where(s < warm, self._warmup(s, p.value, p.warmup_steps), decay)


class Cosine(BaseSchedule):
    """Linear warm-up to ``value``, cosine decay to ``min_value`` at ``total_steps``.

    After ``total_steps`` the rate stays at ``min_value``, so training a little longer
    than planned neither crashes nor restarts the cycle. ``total_steps=None`` (the
    default) follows the run's max_steps.
    """

    HORIZON = 'total_steps'

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = super().Params()
        p.Define('warmup_steps', 0, 'Steps of the linear ramp from 0 to value; >= 0.')
        p.Define('total_steps', None, 'Step at which the decay reaches min_value; '
                 '> warmup_steps. None: the run\'s max_steps (set by the trainer).')
        p.Define('min_value', 0.0, 'Final value, in [0, value].')
        return p

    def __init__(self, params: Params) -> None:
        super().__init__(params)
        warmup = self._check_warmup()
        total, low = params.total_steps, params.min_value
        _require(total is not None, type(self), 'total_steps=None follows the run\'s '
                 'max_steps, which only the trainer knows: set p.total_steps, or pass the '
                 'params through lr_schedules.follow_max_steps')
        _require(isinstance(total, int) and total > warmup, type(self),
                 f'total_steps={total!r} must be an int > warmup_steps={warmup}; raise '
                 'p.total_steps or lower p.warmup_steps')
        _require(isinstance(low, (int, float)) and 0 <= low <= params.value, type(self),
                 f'min_value={low!r} must be in [0, value={params.value}]; set p.min_value '
                 'to the final rate')

    def Value(self, step: StepLike) -> tf.Tensor:
        p = self._params
        s = self._step(step)
        span = float(p.total_steps - p.warmup_steps)
        frac = tf.clip_by_value((s - p.warmup_steps) / span, 0.0, 1.0)
        decay = p.min_value + (p.value - p.min_value) * 0.5 * (1.0 + tf.cos(math.pi * frac))
        return tf.where(s < float(p.warmup_steps),
                        self._warmup(s, p.value, p.warmup_steps), decay)


class Horizon(NamedTuple):
    """A schedule's params fitted to a run, and what the trainer says about it once."""
    params: Params
    message: Optional[str]  # None: the schedule does not depend on the run's length
    warn: bool  # the schedule ends before the run does


def follow_max_steps(params: Params, max_steps: int) -> Horizon:
    """The schedule of a run of `max_steps`: an unset horizon (None) becomes max_steps.

    An explicit horizon is kept; one shorter than the run is reported as a warning,
    since every step past it trains at the schedule's final value (SmallConvPipe once
    inherited total_steps=1000 and spent 19,000 of 20,000 steps at rate 0).
    """
    name = getattr(params.cls, 'HORIZON', None)
    if name is None:
        return Horizon(params, None, False)
    cls = params.cls.__name__
    set_to = params.Get(name)
    if set_to is None:
        # A run that ends inside the warm-up (a few test steps) keeps a valid schedule;
        # its rates are the ramp's either way.
        horizon = max(max_steps, params.Get('warmup_steps') + 1 if 'warmup_steps' in params
                      else 1)
        floor = '' if horizon == max_steps else f', at least warmup_steps + 1 = {horizon}'
        return Horizon(params.Copy().Set(**{name: horizon}),
                       f'lr_schedule {cls}: {name} follows max_steps={max_steps}{floor} (set '
                       f'task.train.lr_schedule.{name} to fix it)', False)
    if isinstance(set_to, int) and set_to < max_steps:
        return Horizon(params, f'lr_schedule {cls}: {name}={set_to} < max_steps={max_steps}: '
                               f'the last {max_steps - set_to} steps train at the schedule\'s '
                               f'final value; set task.train.lr_schedule.{name}=None to follow '
                               'max_steps', True)
    return Horizon(params, f'lr_schedule {cls}: {name}={set_to} (max_steps={max_steps})', False)


def resumed_horizon_change(old: Params, old_max_steps: int, new: Params, new_max_steps: int,
                           learning_rate: float, step: int) -> Optional[str]:
    """A warning when resuming at `step` moves a horizon that follows max_steps; else None.

    `old` and `new` are the lr_schedule params of the checkpoints' run and of this one.
    A cosine that followed max_steps=100 has decayed to its final rate at step 100;
    resumed with max_steps=200 it is a new, longer cosine whose rate at step 101 is
    halfway up again, a jump that the loss shows and nothing else explains.
    Lingvo users expect a longer run to continue the schedule it trained with, or to be
    told: the warning names both runs' max_steps, the jump, and the param that keeps
    the old schedule.
    """
    name = getattr(new.cls, 'HORIZON', None)
    if (step < 1 or name is None or old.cls is not new.cls or old.Get(name) is not None
            or new.Get(name) is not None or old_max_steps == new_max_steps):
        return None
    before = follow_max_steps(old, old_max_steps).params
    after = follow_max_steps(new, new_max_steps).params
    old_schedule, new_schedule = before.Instantiate(), after.Instantiate()
    next_old = learning_rate * float(old_schedule.Value(step + 1))
    next_new = learning_rate * float(new_schedule.Value(step + 1))
    if math.isclose(next_old, next_new, rel_tol=1e-6, abs_tol=1e-12):
        return None  # inside a warm-up both horizons share
    last = learning_rate * float(old_schedule.Value(step))
    return (f'resuming at step {step} with max_steps={new_max_steps} (the checkpoints were '
            f'trained with max_steps={old_max_steps}): lr_schedule {new.cls.__name__} '
            f'{name} follows max_steps, so the learning rate jumps from {last:.3g} at step '
            f'{step} to {next_new:.3g} at step {step + 1} (the old schedule: {next_old:.3g}); '
            f'to keep the old schedule, set task.train.lr_schedule.{name}='
            f'{before.Get(name)}')
