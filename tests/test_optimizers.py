"""Tests for tfpipe.optimizers and tfpipe.lr_schedules.

Each update rule is checked over several steps against a numpy reference written
here from the papers' formulas (not from our code), so a wrong sign, bias
correction or epsilon placement shows up as a numeric mismatch.
"""
import json
import math
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests import trainer_helpers as th
from tfpipe import lr_schedules, optimizers

F64 = tf.float64
SHAPES = {'pipe/fc0/w': (3, 4), 'pipe/fc0/b': (4,), 'pipe/fc1/w': (2, 3, 5)}


# -- Helpers ---------------------------------------------------------------------------

def _values(seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s) for k, s in shapes.items()}


def _variables(values, devices=None):
    out = {}
    for i, (path, v) in enumerate(values.items()):
        with tf.device(devices[i % len(devices)] if devices else None):
            out[path] = tf.Variable(v, dtype=F64)
    return out


def _grad_seq(steps, seed=1, shapes=SHAPES):
    return [_values(seed + t, shapes) for t in range(steps)]


def _run(opt_params, lrs, grads_seq, values, devices=None):
    """Runs the TF optimizer; returns {path: final value} and the optimizer."""
    opt = opt_params.Instantiate()
    variables = _variables(values, devices)
    opt.CreateSlots(variables)
    for lr, grads in zip(lrs, grads_seq):
        opt.Apply(tf.constant(lr, F64), {k: tf.constant(g) for k, g in grads.items()},
                  variables)
    return {k: v.numpy() for k, v in variables.items()}, opt


def _rms(x):
    return np.sqrt(np.mean(np.square(x)))


# -- numpy references: one function per rule, state in a dict per variable -------------

def _np_sgd(w, g, s, t, lr, momentum, nesterov):
    if momentum == 0:
        return w - lr * g
    s['a'] = momentum * s.get('a', 0) + g
    return w - lr * (g + momentum * s['a'] if nesterov else s['a'])


def _np_adam(w, g, s, t, lr, beta1, beta2, epsilon):
    s['m'] = beta1 * s.get('m', 0) + (1 - beta1) * g
    s['v'] = beta2 * s.get('v', 0) + (1 - beta2) * g * g
    m_hat, v_hat = s['m'] / (1 - beta1 ** t), s['v'] / (1 - beta2 ** t)
    return w - lr * m_hat / (np.sqrt(v_hat) + epsilon)


def _np_rmsprop(w, g, s, t, lr, decay, momentum, epsilon):
    s['ms'] = decay * s.get('ms', 0) + (1 - decay) * g * g
    delta = lr * g / np.sqrt(s['ms'] + epsilon)
    if momentum:
        s['mom'] = momentum * s.get('mom', 0) + delta
        delta = s['mom']
    return w - delta


def _np_adafactor(w, g, s, t, lr, beta1, beta2, c, eps1=1e-30, eps2=1e-3, d=1.0):
    """Shazeer & Stern, Alg. 4/5 in their row/column *sums* form, per 2-D slice."""
    b2 = 1 - t ** -c if beta2 is None else beta2 * (1 - beta2 ** (t - 1)) / (1 - beta2 ** t)
    g2 = g * g + eps1
    if w.ndim >= 2:
        s['R'] = b2 * s.get('R', 0) + (1 - b2) * g2.sum(-1)   # sum over columns
        s['C'] = b2 * s.get('C', 0) + (1 - b2) * g2.sum(-2)   # sum over rows
        v = s['R'][..., :, None] * s['C'][..., None, :] / s['R'].sum(-1)[..., None, None]
    else:
        s['V'] = b2 * s.get('V', 0) + (1 - b2) * g2
        v = s['V']
    u = g / np.sqrt(v)
    u = u / max(1.0, _rms(u) / d)
    if beta1:
        s['m'] = beta1 * s.get('m', 0) + (1 - beta1) * u
        u = s['m']
    return w - lr * max(eps2, _rms(w)) * u


def _np_run(rule, lrs, grads_seq, values, **hp):
    values = {k: v.copy() for k, v in values.items()}
    state = {k: {} for k in values}
    for t, (lr, grads) in enumerate(zip(lrs, grads_seq), start=1):
        for k in values:
            values[k] = rule(values[k], grads[k], state[k], t, lr, **hp)
    return values


CASES = [  # (optimizer params, numpy rule, hyper-parameters of both)
    (optimizers.SGD, _np_sgd, dict(momentum=0.0, nesterov=False)),
    (optimizers.SGD, _np_sgd, dict(momentum=0.9, nesterov=False)),
    (optimizers.SGD, _np_sgd, dict(momentum=0.8, nesterov=True)),
    (optimizers.Adam, _np_adam, dict(beta1=0.9, beta2=0.999, epsilon=1e-8)),
    (optimizers.Adam, _np_adam, dict(beta1=0.5, beta2=0.7, epsilon=1e-3)),
    (optimizers.RMSProp, _np_rmsprop, dict(decay=0.9, momentum=0.9, epsilon=1.0)),
    (optimizers.RMSProp, _np_rmsprop, dict(decay=0.8, momentum=0.0, epsilon=1e-6)),
    (optimizers.Adafactor, _np_adafactor, dict(beta1=0.0, beta2=None, decay_exponent=0.8)),
    (optimizers.Adafactor, _np_adafactor, dict(beta1=0.9, beta2=0.99, decay_exponent=0.8)),
]
_NP_NAMES = {'decay_exponent': 'c'}


@pytest.mark.parametrize('cls,rule,hp', CASES,
                         ids=[f'{c.__name__}-{i}' for i, (c, _, _) in enumerate(CASES)])
def test_update_matches_numpy_reference(cls, rule, hp):
    values, lrs = _values(), [0.1, 0.05, 0.2, 0.1, 0.03]
    grads_seq = _grad_seq(len(lrs))
    got, opt = _run(cls.Params().Set(**hp), lrs, grads_seq, values)
    want = _np_run(rule, lrs, grads_seq, values,
                   **{_NP_NAMES.get(k, k): v for k, v in hp.items()})
    assert int(opt.iterations.numpy()) == len(lrs)
    for path in values:
        assert not np.allclose(got[path], values[path])  # it did move
        np.testing.assert_allclose(got[path], want[path], rtol=1e-10, atol=1e-12,
                                   err_msg=path)


# -- Adafactor specifics --------------------------------------------------------------

def test_adafactor_slot_shapes_are_factored_for_rank_2_and_up():
    variables = _variables({'m': np.zeros((3, 4)), 'v': np.zeros(4), 't': np.zeros((2, 3, 5)),
                            's': np.zeros(())})
    opt = optimizers.Adafactor.Params().Instantiate()
    opt.CreateSlots(variables)
    shapes = {(p, n): tuple(opt.GetSlot(p, n).shape) for p in variables
              for n in ('vr', 'vc', 'v') if n in opt._slots[p]}
    assert shapes == {('m', 'vr'): (3,), ('m', 'vc'): (4,), ('v', 'v'): (4,),
                      ('t', 'vr'): (2, 3), ('t', 'vc'): (2, 5), ('s', 'v'): ()}
    assert len(opt.slot_variables) == 6  # beta1 = 0: no momentum slot

    unfactored = optimizers.Adafactor.Params().Set(factored=False, beta1=0.5).Instantiate()
    unfactored.CreateSlots({'m': variables['m']})
    assert sorted(unfactored._slots['m']) == ['m', 'v']
    assert tuple(unfactored.GetSlot('m', 'v').shape) == (3, 4)


def test_adafactor_steps_of_zero_weights_are_scaled_by_epsilon2():
    values = {k: np.zeros(s) for k, s in SHAPES.items()}  # RMS(w) = 0 < epsilon2
    lrs, grads_seq = [0.5, 0.5], _grad_seq(2)
    p = optimizers.Adafactor.Params().Set(epsilon2=0.01)
    got, _ = _run(p, lrs, grads_seq, values)
    want = _np_run(_np_adafactor, lrs, grads_seq, values, beta1=0.0, beta2=None, c=0.8,
                   eps2=0.01)
    for path in values:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-10, err_msg=path)
        assert 0 < _rms(got[path]) <= 2 * 0.5 * 0.01 + 1e-12  # 2 steps of RMS <= lr*eps2


def test_adafactor_decreases_a_quadratic_loss():
    rng = np.random.default_rng(3)
    target = tf.constant(rng.normal(size=(16, 8)), tf.float32)
    w = tf.Variable(tf.zeros((16, 8)))
    opt = optimizers.Adafactor.Params().Set(multiply_by_parameter_scale=False).Instantiate()
    opt.CreateSlots({'w': w})
    losses = []
    for _ in range(30):
        with tf.GradientTape() as tape:
            loss = 0.5 * tf.reduce_sum(tf.square(w - target))
        opt.Apply(0.1, {'w': tape.gradient(loss, w)}, {'w': w})
        assert np.all(np.isfinite(w.numpy()))
        losses.append(float(loss))
    assert losses[-1] < 0.1 * losses[0]
    assert all(b < a for a, b in zip(losses, losses[1:]))


# -- Placement, tf.function, checkpoints ------------------------------------------------

def _device_index(device):
    return tf.DeviceSpec.from_string(device).device_index


@pytest.mark.parametrize('cls', [optimizers.SGD, optimizers.Adam, optimizers.RMSProp,
                                 optimizers.Adafactor])
def test_slots_and_update_ops_live_on_the_variable_device(cls):
    p = cls.Params()
    if 'momentum' in p:
        p.momentum = 0.9
    opt = p.Instantiate()
    variables = _variables(_values(), devices=['/CPU:1', '/CPU:2'])
    opt.CreateSlots(variables)
    for path, var in variables.items():
        for slot in opt._slots[path.replace('/', '-')].values():
            assert _device_index(slot.device) == _device_index(var.device) in (1, 2)

    @tf.function
    def step(grads):
        opt.Apply(tf.constant(0.1, F64), grads, variables)

    grads = {k: tf.constant(g) for k, g in _grad_seq(1)[0].items()}
    graph = step.get_concrete_function(grads).graph
    placed = [_device_index(op.device) for op in graph.get_operations() if op.device]
    assert set(placed) == {1, 2}
    unplaced = {op.type for op in graph.get_operations() if not op.device}
    assert unplaced <= {'Placeholder', 'Const', 'AssignAddVariableOp'}  # inputs, iterations


def test_apply_inside_tf_function_equals_eager():
    values, grads_seq = _values(), _grad_seq(3)
    eager, _ = _run(optimizers.Adam.Params(), [0.1] * 3, grads_seq, values)
    opt = optimizers.Adam.Params().Instantiate()
    variables = _variables(values)
    opt.CreateSlots(variables)

    @tf.function
    def step(lr, grads):
        opt.Apply(lr, grads, variables)

    for grads in grads_seq:
        step(tf.constant(0.1, F64), {k: tf.constant(g) for k, g in grads.items()})
    assert step.experimental_get_tracing_count() == 1
    assert int(opt.iterations.numpy()) == 3
    for path in values:
        np.testing.assert_allclose(variables[path].numpy(), eager[path], rtol=1e-12)


@pytest.mark.parametrize('restore_first', [False, True], ids=['slots-first', 'restore-first'])
@pytest.mark.parametrize('p', [optimizers.SGD.Params().Set(momentum=0.9),
                               optimizers.Adam.Params(), optimizers.RMSProp.Params(),
                               optimizers.Adafactor.Params().Set(beta1=0.9)],
                         ids=['sgd', 'adam', 'rmsprop', 'adafactor'])
def test_checkpoint_round_trip_gives_identical_next_update(p, restore_first, tmp_path):
    values, grads_seq = _values(), _grad_seq(3)
    _, opt = _run(p, [0.1, 0.1], grads_seq[:2], values)
    saved = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / 'ckpt'))

    # A fresh optimizer, variables created in the reverse order: names, not order, match.
    # restore() before CreateSlots binds the slots when they are created (deferred).
    fresh = p.Instantiate()
    status = tf.train.Checkpoint(optimizer=fresh).restore(saved) if restore_first else None
    fresh.CreateSlots(dict(reversed(list(_variables(values).items()))))
    status = status or tf.train.Checkpoint(optimizer=fresh).restore(saved)
    status.assert_consumed()
    assert int(fresh.iterations.numpy()) == 2
    for a, b in zip(opt.slot_variables, fresh.slot_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    grads = {k: tf.constant(g) for k, g in grads_seq[2].items()}
    outs = []
    for o in (opt, fresh):
        variables = _variables(values)
        o.Apply(tf.constant(0.1, F64), grads, variables)
        outs.append({k: v.numpy() for k, v in variables.items()})
    for path in values:
        np.testing.assert_array_equal(outs[0][path], outs[1][path])


def test_checkpoint_slot_names_contain_the_variable_path(tmp_path):
    _, opt = _run(optimizers.Adam.Params(), [0.1], _grad_seq(1), _values())
    saved = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / 'ckpt'))
    names = {n for n, _ in tf.train.list_variables(saved)}
    for path in SHAPES:
        for slot in ('m', 'v'):
            assert f'optimizer/_slots/{path.replace("/", "-")}/{slot}/.ATTRIBUTES/' \
                   'VARIABLE_VALUE' in names
    assert 'optimizer/iterations/.ATTRIBUTES/VARIABLE_VALUE' in names


# -- Errors ---------------------------------------------------------------------------

def test_create_slots_twice_is_a_noop_for_the_same_paths_only():
    opt = optimizers.Adam.Params().Instantiate()
    variables = _variables(_values())
    opt.CreateSlots(variables)
    before = [id(v) for v in opt.slot_variables]
    opt.CreateSlots(variables)
    assert [id(v) for v in opt.slot_variables] == before
    with pytest.raises(ValueError, match='already called'):
        opt.CreateSlots({'pipe/other/w': tf.Variable([1.0])})


def test_apply_errors():
    variables = _variables(_values())
    grads = {k: tf.zeros_like(v) for k, v in variables.items()}
    opt = optimizers.SGD.Params().Instantiate()
    with pytest.raises(ValueError, match="no slots for 'pipe/fc0/w'; call CreateSlots"):
        opt.Apply(0.1, grads, variables)
    opt.CreateSlots(variables)
    with pytest.raises(ValueError, match='has shape .* they must match'):
        opt.Apply(0.1, {'pipe/fc0/b': tf.zeros([5], F64)}, variables)
    with pytest.raises(ValueError, match='learning rate -0.1'):
        opt.Apply(-0.1, grads, variables)
    with pytest.raises(ValueError, match='has no variable'):
        opt.Apply(0.1, grads, {})
    with pytest.raises(ValueError, match='slash-separated'):
        optimizers.SGD.Params().Instantiate().CreateSlots({'a//b': variables['pipe/fc0/b']})


@pytest.mark.parametrize('cls,key,value,match', [
    (optimizers.Adam, 'beta1', 1.0, r'Adam: beta1=1.0 must be in \[0, 1\); set p.beta1'),
    (optimizers.Adam, 'beta2', -0.1, 'beta2=-0.1 must be in'),
    (optimizers.Adam, 'beta1', None, 'beta1=None must be in'),
    (optimizers.Adam, 'epsilon', 0.0, 'epsilon=0.0 must be a finite number > 0'),
    (optimizers.SGD, 'momentum', 1.0, 'momentum=1.0 must be in'),
    (optimizers.RMSProp, 'decay', 1.5, 'decay=1.5 must be in'),
    (optimizers.Adafactor, 'beta2', 1.0, 'beta2=1.0 must be in'),
    (optimizers.Adafactor, 'decay_exponent', 1.5, r'decay_exponent=1.5 must be in \(0, 1\]'),
    (optimizers.Adafactor, 'clipping_threshold', 0.0, 'clipping_threshold=0.0'),
    (optimizers.Adam, 'name', 'bad name', "name='bad name' must be an identifier"),
])
def test_bad_optimizer_params_raise(cls, key, value, match):
    with pytest.raises(ValueError, match=match):
        cls.Params().Set(**{key: value}).Instantiate()


# -- Gradient clipping ------------------------------------------------------------------

def test_clip_by_global_norm_matches_numpy_and_stays_on_device():
    values = _values(4)
    with tf.device('/CPU:3'):
        grads = {k: tf.constant(v) for k, v in values.items()}
    grads['pipe/none'] = None
    norm_np = math.sqrt(sum(np.sum(v ** 2) for v in values.values()))
    clipped, norm = optimizers.clip_by_global_norm(grads, 1.0)
    np.testing.assert_allclose(norm.numpy(), norm_np, rtol=1e-6)
    assert clipped['pipe/none'] is None
    for k, v in values.items():
        np.testing.assert_allclose(clipped[k].numpy(), v / norm_np, rtol=1e-6)
        assert _device_index(clipped[k].device) == 3

    for max_norm in (None, 0, 10 * norm_np):  # no clipping, norm still reported
        same, norm = optimizers.clip_by_global_norm(grads, max_norm)
        np.testing.assert_allclose(norm.numpy(), norm_np, rtol=1e-6)
        np.testing.assert_allclose(same['pipe/fc0/w'].numpy(), values['pipe/fc0/w'],
                                   rtol=1e-6)
    with pytest.raises(ValueError, match='max_norm=-1.0'):
        optimizers.clip_by_global_norm(grads, -1.0)


def test_clip_by_global_norm_squares_each_gradient_on_its_device():
    @tf.function
    def clip(xs):
        gs = {}
        for i, (k, x) in enumerate(sorted(xs.items())):
            with tf.device(f'/CPU:{i + 1}'):
                gs[k] = tf.identity(x)
        return optimizers.clip_by_global_norm(gs, 1.0)

    xs = {k: tf.constant(v) for k, v in _values().items()}
    graph = clip.get_concrete_function(xs).graph
    for op_type in ('Square', 'Mul'):  # the per-gradient square and scaling
        devices = sorted(_device_index(op.device) for op in graph.get_operations()
                         if op.type == op_type)
        assert devices == [1, 2, 3], op_type


# -- Learning-rate schedules --------------------------------------------------------------

def _rsqrt_closed_form(step, peak=2.0, warmup=10):
    return peak * step / warmup if step < warmup else peak * math.sqrt(warmup / step)


def _cosine_closed_form(step, peak=1.0, warmup=10, total=110, low=0.1):
    if step < warmup:
        return peak * step / warmup
    frac = min(1.0, (step - warmup) / (total - warmup))
    return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * frac))


SCHEDULES = [
    (lr_schedules.Constant.Params().Set(value=0.3), lambda s: 0.3),
    (lr_schedules.LinearWarmupRsqrtDecay.Params().Set(value=2.0, warmup_steps=10),
     _rsqrt_closed_form),
    (lr_schedules.Cosine.Params().Set(value=1.0, warmup_steps=10, total_steps=110,
                                      min_value=0.1), _cosine_closed_form),
    (lr_schedules.Cosine.Params().Set(value=1.0, warmup_steps=0, total_steps=100),
     lambda s: _cosine_closed_form(s, warmup=0, total=100, low=0.0)),
]
STEPS = [0, 1, 5, 9, 10, 11, 40, 60, 100, 109, 110, 111, 5000]


@pytest.mark.parametrize('p,closed_form', SCHEDULES, ids=['constant', 'rsqrt', 'cosine',
                                                           'cosine-no-warmup'])
def test_schedule_values_match_closed_form_eager_and_in_tf_function(p, closed_form):
    schedule = p.Instantiate()
    want = np.array([closed_form(s) for s in STEPS], np.float32)
    eager = np.array([schedule.Value(s).numpy() for s in STEPS])
    traced_fn = tf.function(schedule.Value)
    traced = np.array([traced_fn(tf.constant(s, tf.int64)).numpy() for s in STEPS])
    np.testing.assert_allclose(eager, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(traced, want, rtol=1e-5, atol=1e-7)
    assert traced_fn.experimental_get_tracing_count() == 1
    assert schedule.Value(3).dtype == tf.float32


def test_schedule_peaks_and_floors():
    rsqrt = lr_schedules.LinearWarmupRsqrtDecay.Params().Set(value=1e-3, warmup_steps=100)
    assert rsqrt.Instantiate().Value(100).numpy() == pytest.approx(1e-3)
    cosine = lr_schedules.Cosine.Params().Set(value=1.0, warmup_steps=5, total_steps=10,
                                              min_value=0.25).Instantiate()
    assert cosine.Value(5).numpy() == pytest.approx(1.0)
    assert cosine.Value(10).numpy() == pytest.approx(0.25)
    assert cosine.Value(10 ** 9).numpy() == pytest.approx(0.25)


@pytest.mark.parametrize('p,match', [
    (lr_schedules.Constant.Params().Set(value=-1.0), r'Constant: value=-1.0 must be .*>= 0'),
    (lr_schedules.Constant.Params().Set(value=float('nan')), 'value=nan'),
    (lr_schedules.LinearWarmupRsqrtDecay.Params().Set(warmup_steps=-5),
     'warmup_steps=-5 must be an int >= 0'),
    (lr_schedules.LinearWarmupRsqrtDecay.Params().Set(warmup_steps=0),
     'warmup_steps=0 would make'),
    (lr_schedules.Cosine.Params().Set(warmup_steps=-1), 'warmup_steps=-1'),
    (lr_schedules.Cosine.Params().Set(warmup_steps=100, total_steps=100),
     'total_steps=100 must be an int > warmup_steps=100'),
    (lr_schedules.Cosine.Params().Set(value=0.5, min_value=0.6, total_steps=100),
     r'min_value=0.6 must be in'),
])
def test_bad_schedule_params_raise(p, match):
    with pytest.raises(ValueError, match=match):
        p.Instantiate()



@pytest.fixture(scope='module')
def update_memory():
    """tests/update_memory_probe.py's figures, from one fresh process (about 6 s)."""
    result = th.run_command([sys.executable, '-m', 'tests.update_memory_probe'], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_updates_keep_each_slot_in_its_own_buffer(update_memory):
    """Slots are written in place: an update that moved them into the step's new buffers let
    the BFC allocator's whole-chunk counting grow GPT2SmallShapedLM's host bytes between
    steps by 111 MiB over 8 steps, and its peak with them. On a heap with holes of 1.5 slots
    the old `assign` grew the bytes in use by 0.5-1 MiB (Adam), 0.5 (SGD) and -1 to +0.5
    (RMSProp) over 3 updates of two 1-MiB weights; in place, by 0 bytes."""
    assert update_memory['growth'] == {'Adam': 0, 'SGD': 0, 'RMSProp': 0}


def test_an_update_holds_the_temporaries_of_a_few_weights_at_once(update_memory):
    """Adam's update of 48 equal weights, in UpdateChains: measured at most 5 weights'
    size above the weights, slots and gradients in any of 5 calls (-2 to 5); unordered, the
    executor had the updates of 9-52 weights under way at once (23-27 in most runs)."""
    assert max(update_memory['temporaries']) <= 8, update_memory['temporaries']
