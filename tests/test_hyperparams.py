"""Tests for tfpipe.hyperparams: access, type checks, deep freeze, text round trip."""
import copy
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from tfpipe import params_text
from tfpipe.hyperparams import (FrozenParamsError, InstantiableParams, Params,
                                ParamsDefineError, ParamsTextError, ParamsTypeError,
                                UnknownParamError)

REPO = Path(__file__).resolve().parents[1]

# FromText reads this module's classes back by path: let it import modules of the tests.
params_text.trust_package(__name__.split('.')[0])


# -- dummy classes, module level so FromText can import them by path ---------------

class Dense:
    """A layer-like class with a Params() classmethod."""

    @classmethod
    def Params(cls):
        p = InstantiableParams(cls)
        p.Define('name', '', 'Layer name.')
        p.Define('units', 0, 'Output width.')
        p.Define('activation', 'relu', 'Activation name.')
        return p

    def __init__(self, params, parent=None):
        self.params = params
        self.parent = parent


class Bare:
    """A class without a Params() classmethod (rebuilt as InstantiableParams(Bare))."""

    def __init__(self, params):
        self.params = params


class Model:
    @classmethod
    def Params(cls):
        p = InstantiableParams(cls)
        p.Define('name', '', 'Model name.')
        p.Define('body', [], 'Layer params, in order.')
        p.Define('dtype', tf.float32, 'Activation dtype.')
        p.Define('optimizer', None, 'Optimizer params.')
        return p


class Outer:
    class Inner:
        pass


def _opt():
    p = Params()
    p.Define('learning_rate', 0.1, 'Step size.')
    p.Define('beta1', 0.9, 'Momentum.')
    return p


def _tree():
    p = Params()
    p.Define('learning_rate', 0.1, 'Step size.')
    p.Define('batch_size', 32, 'Examples per step.')
    p.Define('opt', _opt(), 'Optimizer.')
    p.Define('layers', [Dense.Params().Set(name='fc0', units=4)], 'Layers.')
    p.Define('table', {'a': [1, 2]}, 'A dict.')
    p.Define('pair', ([1], _opt()), 'A tuple holding a list and a Params.')
    return p


# -- define / set / get / delete -------------------------------------------------------

def test_define_set_get_delete_and_chaining():
    p = Params()
    p.Define('learning_rate', 0.1, 'doc')
    p.Define('name', 'x', 'doc')
    assert p.learning_rate == 0.1 and p.Get('name') == 'x'
    assert p.Set(learning_rate=0.5).Set(name='y') is p
    assert (p.learning_rate, p.name) == (0.5, 'y')
    p.name = 'z'
    assert p.name == 'z'
    assert p.Delete('name') is p
    assert 'name' not in p and 'learning_rate' in p
    with pytest.raises(UnknownParamError):
        _ = p.name


def test_iteration_is_definition_order():
    p = Params()
    for name in ('zeta', 'alpha', 'mid'):
        p.Define(name, 1, '')
    assert [n for n, _ in p] == ['zeta', 'alpha', 'mid']
    assert list(p.IterParams()) == [('zeta', 1), ('alpha', 1), ('mid', 1)]
    assert [line.split(' : ')[0] for line in p.ToText().splitlines()] == ['zeta', 'alpha', 'mid']


@pytest.mark.parametrize('name', ['Learning', '1x', 'a-b', 'a.b', '', 'a b', '__class__'])
def test_define_rejects_bad_names(name):
    with pytest.raises(ParamsDefineError):
        Params().Define(name, 1, '')


def test_define_rejects_duplicates_and_method_names():
    p = Params()
    p.Define('x', 1, '')
    with pytest.raises(ParamsDefineError, match='already defined'):
        p.Define('x', 2, '')
    assert p.x == 1


def test_dotted_keys():
    p = _tree()
    p.Set(**{'opt.learning_rate': 0.3, 'layers[0].units': 8})
    assert p.opt.learning_rate == 0.3 and p.Get('opt.learning_rate') == 0.3
    assert p.layers[0].units == 8 and p.Get('layers[0].units') == 8
    assert p.Get("table['a']") == [1, 2]
    assert p.Get('pair[1].beta1') == 0.9
    assert 'opt.beta1' in p and 'opt.nope' not in p and 'layers[3].units' not in p
    p.Delete('opt.beta1')
    assert 'beta1' not in p.opt


def test_set_on_container_element_is_rejected():
    p = _tree()
    with pytest.raises(UnknownParamError, match='does not name a param'):
        p.Set(**{'layers[0]': Params()})


# -- unknown keys: did-you-mean on every access path ----------------------------------

_HINT = "did you mean 'learning_rate'?"


@pytest.mark.parametrize('access', [
    lambda p: p.learnin_rate,
    lambda p: setattr(p, 'learnin_rate', 1.0),
    lambda p: p.Set(learnin_rate=1.0),
    lambda p: p.Get('learnin_rate'),
    lambda p: p.Delete('learnin_rate'),
    lambda p: p.opt.learnin_rate,
    lambda p: p.Get('opt.learnin_rate'),
    lambda p: p.Set(**{'opt.learnin_rate': 1.0}),
    lambda p: p.Delete('opt.learnin_rate'),
])
def test_unknown_key_suggests(access):
    p = _tree()
    with pytest.raises(AttributeError) as info:
        access(p)
    msg = str(info.value)
    assert isinstance(info.value, UnknownParamError)
    assert "'learnin_rate'" in msg and 'Params' in msg and msg.endswith(_HINT)
    assert '\n' not in msg


def test_unknown_key_names_the_nested_params_and_omits_far_suggestions():
    p = _tree()
    with pytest.raises(UnknownParamError) as info:
        p.Get('layers[0].unitz')
    assert "'unitz'" in str(info.value) and "at 'layers[0]'" in str(info.value)
    assert "cls=Dense" in str(info.value) and "did you mean 'units'?" in str(info.value)
    with pytest.raises(UnknownParamError) as info:
        p.Get('opt.qqqqqq')
    assert 'did you mean' not in str(info.value) and "at 'opt'" in str(info.value)


def test_unknown_is_attribute_error_for_getattr_and_hasattr():
    p = _tree()
    assert not hasattr(p, 'nope')
    assert getattr(p, 'nope', 'default') == 'default'
    with pytest.raises(UnknownParamError, match='no element'):
        p.Get('layers[5].name')


# -- type checks -----------------------------------------------------------------------

def _fn():
    pass


_ACCEPT = [
    (0.5, 3, 3.0), (0.5, 2.5, 2.5), (1, 7, 7), ('s', 't', 't'), (True, False, False),
    ([1], (2, 3), (2, 3)), ((1,), [4], [4]), ({'a': 1}, {'b': 2}, {'b': 2}),
    (tf.float32, tf.int64, tf.int64), (Dense, Bare, Bare), (None, 'anything', 'anything'),
    (None, [1], [1]),
]


@pytest.mark.parametrize('default,value,stored', _ACCEPT)
def test_type_check_accepts(default, value, stored):
    p = Params()
    p.Define('x', default, '')
    p.x = value
    assert p.x == stored and type(p.x) is type(stored)
    p.Set(x=None)
    assert p.x is None  # None always means "unset"


def test_params_default_accepts_params():
    p = Params()
    p.Define('sub', _opt(), '')
    q = Params()
    p.sub = q
    assert p.sub is q


_REJECT = [
    (0.5, True), (0.5, 'x'), (1, True), (1, 2.0), (1, '1'), (True, 1), (True, 0),
    ('s', 1), ('s', b's'), ([1], 'ab'), ([1], {'a': 1}), ({'a': 1}, [1]),
    (tf.float32, 'float32'), (Dense, Dense(None)), (Dense, _fn),
]


@pytest.mark.parametrize('default,value', _REJECT)
def test_type_check_rejects(default, value):
    p = Params()
    p.Define('x', default, '')
    for setter in (lambda: setattr(p, 'x', value), lambda: p.Set(x=value)):
        with pytest.raises(ParamsTypeError) as info:
            setter()
        msg = str(info.value)
        assert "'x'" in msg and repr(value)[:20] in msg and '\n' not in msg
    assert p.x is default


def test_type_check_rejects_non_params_for_params_default():
    p = Params()
    p.Define('sub', _opt(), '')
    with pytest.raises(ParamsTypeError, match="'sub' expects Params"):
        p.sub = {'learning_rate': 1.0}


def test_type_error_names_expected_type():
    p = Params()
    p.Define('lr', 0.1, '')
    with pytest.raises(ParamsTypeError, match=r"param 'lr' expects float .*got 'x' \(str\)"):
        p.lr = 'x'


# -- deep freeze -----------------------------------------------------------------------

def _assert_frozen_error(fn):
    with pytest.raises(FrozenParamsError) as info:
        fn()
    assert 'frozen' in str(info.value) and 'Copy()' in str(info.value)


def test_freeze_is_deep():
    p = _tree()
    assert p.Freeze() is p and p.IsFrozen()
    assert p.opt.IsFrozen() and p.layers[0].IsFrozen() and p.pair[1].IsFrozen()
    before = p.ToText()
    _assert_frozen_error(lambda: setattr(p, 'learning_rate', 1.0))
    _assert_frozen_error(lambda: p.Set(batch_size=1))
    _assert_frozen_error(lambda: p.Define('new', 1, ''))
    _assert_frozen_error(lambda: p.Delete('batch_size'))
    _assert_frozen_error(lambda: p.FromText('batch_size : 1'))
    _assert_frozen_error(lambda: setattr(p.opt, 'beta1', 0.0))
    _assert_frozen_error(lambda: p.opt.Define('new', 1, ''))
    _assert_frozen_error(lambda: p.layers[0].Set(units=1))
    _assert_frozen_error(lambda: setattr(p.pair[1], 'beta1', 0.0))
    assert p.ToText() == before


@pytest.mark.parametrize('mutate', [
    lambda p: p.layers.append(Dense.Params()),
    lambda p: p.layers.extend([1]),
    lambda p: p.layers.insert(0, 1),
    lambda p: p.layers.pop(),
    lambda p: p.layers.clear(),
    lambda p: p.layers.__setitem__(0, 1),
    lambda p: p.layers.__delitem__(0),
    lambda p: p.layers.__iadd__([1]),
    lambda p: p.layers.sort(),
    lambda p: p.table.__setitem__('b', 1),
    lambda p: p.table.update(b=1),
    lambda p: p.table.pop('a'),
    lambda p: p.table.setdefault('z', 1),
    lambda p: p.table['a'].append(3),
    lambda p: p.pair[0].append(2),
])
def test_frozen_containers_are_read_only(mutate):
    p = _tree().Freeze()
    before = p.ToText()
    _assert_frozen_error(lambda: mutate(p))
    assert p.ToText() == before


def test_frozen_containers_keep_their_type_and_equality():
    p = _tree().Freeze()
    assert isinstance(p.layers, list) and isinstance(p.table, dict)
    assert isinstance(p.pair, tuple) and p.table == {'a': [1, 2]} and p.pair[0] == [1]
    assert p == _tree()


def test_copy_of_frozen_is_unfrozen_and_independent():
    p = _tree().Freeze()
    q = p.Copy()
    assert not q.IsFrozen() and not q.opt.IsFrozen() and not q.layers[0].IsFrozen()
    assert q == p and type(q.layers) is list and type(q.table) is dict
    q.layers.append(Dense.Params())
    q.layers[0].units = 99
    q.opt.learning_rate = 5.0
    q.table['a'].append(3)
    assert len(p.layers) == 1 and p.layers[0].units == 4 and p.opt.learning_rate == 0.1
    assert p.table == {'a': [1, 2]} and q != p


def test_copy_of_unfrozen_is_independent_and_keeps_class():
    p = _tree()
    q = p.Copy()
    q.opt.beta1 = 0.5
    p.layers.append(Dense.Params())
    assert p.opt.beta1 == 0.9 and len(q.layers) == 1
    assert type(q.layers[0]) is InstantiableParams and q.layers[0].cls is Dense
    r = copy.deepcopy(p)
    assert r == p and r.opt is not p.opt


def test_frozen_params_pickle():
    p = _tree().Freeze()
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.IsFrozen()
    _assert_frozen_error(lambda: q.layers.append(1))


# -- equality --------------------------------------------------------------------------

@pytest.mark.parametrize('a,b', [(1, 1.0), (True, 1), ([1], (1,)), ({'a': 1}, {'a': 1.0}),
                                 (0.1, 0.2), ('1', 1)])
def test_equality_is_type_strict(a, b):
    p, q = Params(), Params()
    p.Define('x', None, '')
    q.Define('x', None, '')
    p.x, q.x = a, b
    assert p != q
    q.x = a
    assert p == q


def test_equality_needs_same_names():
    p, q = Params(), Params()
    p.Define('x', 1, '')
    q.Define('y', 1, '')
    assert p != q and p != 1


# -- text round trip -------------------------------------------------------------------

_TRICKY = [
    0, -5, 2 ** 80, 0.1, 1e-300, 5e-324, 1.7976931348623157e308, float('inf'), float('-inf'),
    float('nan'), -0.0, 3.0, '', "it's", 'say "hi"', 'x : y', ' : ', 'line1\nline2\r\n',
    'back\\slash', '\\n', 'tab\there', 'ünïcödé ☃ 日本', '\x00\ud800', '# not a comment',
    "Params(cls=os.system)", "__import__('os')", True, False, None, [], (), (1,), [[]],
    [1, (2, [3.5, None])], {}, {'a': [1, {'b': (None, 'x : y')}]}, {'k : v': 'w'},
    Dense, Outer.Inner, int, tf.float32, tf.bfloat16, tf.int64,
    tf.string, tf.bool, [tf.float16, Dense, {'d': tf.int8}],
]


def _same(a, b):
    """Strict structural identity: types, float bits (so -0.0 and nan count)."""
    if isinstance(a, (list, tuple, dict)):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        if isinstance(a, dict):
            return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
        return all(map(_same, a, b))
    if isinstance(a, float):
        return type(b) is float and (repr(a) == repr(b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize('value', _TRICKY, ids=lambda v: repr(v)[:30])
@pytest.mark.parametrize('wrap', ['bare', 'in_list', 'in_dict'])
def test_round_trip_values(value, wrap):
    value = {'bare': value, 'in_list': [value, 1], 'in_dict': {'v': value}}[wrap]
    base = Params()
    base.Define('v', None, 'doc')
    base.Define('after', 7, 'A param after v, to catch parse over-runs.')
    p = base.Copy().Set(v=value, after=8)
    text = p.ToText()
    assert len(text.splitlines()) == 2, text
    q = base.Copy().FromText(text)
    assert q == p and q.after == 8 and _same(q.v, value), (text, q.v)
    assert q.ToText() == text


def test_round_trip_into_typed_defaults():
    p = Params()
    p.Define('lr', 0.1, '')
    p.Define('dtype', tf.float32, '')
    p.Define('cls', Dense, '')
    q = p.Copy().Set(lr=float('inf'), dtype=tf.int32, cls=Bare)
    assert p.Copy().FromText(q.ToText()) == q


def _model():
    p = Model.Params().Set(name='m', dtype=tf.bfloat16)
    bare = InstantiableParams(Bare)
    bare.Define('width', 3, '')
    bare.Define('inner', [Dense.Params().Set(name='deep')], '')
    plain = Params()
    plain.Define('rate', float('nan'), '')
    plain.Define('sub', _opt(), '')
    p.body = [Dense.Params().Set(name='fc0', units=128),
              Dense.Params().Set(name='fc1', units=10, activation='none'),
              bare, plain, [Dense.Params().Set(name='nested')], {'enc': _opt()},
              (Dense.Params().Set(name='in_tuple'), 2)]
    p.optimizer = _opt().Set(learning_rate=1e-3)
    return p


def test_text_format_example():
    p = Model.Params().Set(name='m')
    p.body = [Dense.Params().Set(name='fc0', units=2)]
    p.optimizer = _opt()
    mod = __name__
    assert p.ToText().splitlines() == [
        f'cls : {mod}.Model',
        "name : 'm'",
        f'body : [Params(cls={mod}.Dense)]',
        f'body[0].cls : {mod}.Dense',
        "body[0].name : 'fc0'",
        'body[0].units : 2',
        "body[0].activation : 'relu'",
        'dtype : tf.float32',
        'optimizer : Params()',
        'optimizer.learning_rate : 0.1',
        'optimizer.beta1 : 0.9',
    ]


def test_round_trip_params_in_lists_into_fresh_params():
    p = _model()
    q = Model.Params()
    assert q.body == [] and q.optimizer is None
    q.FromText(p.ToText())
    assert q == p and q.ToText() == p.ToText()
    assert [type(b) for b in q.body[:4]] == [InstantiableParams] * 3 + [Params]
    assert q.body[0].cls is Dense and q.body[2].cls is Bare and q.body[2].inner[0].name == 'deep'
    assert isinstance(q.body[6], tuple) and q.body[5]['enc'].learning_rate == 0.1
    assert math.isnan(q.body[3].rate) and q.optimizer.learning_rate == 1e-3


def test_round_trip_of_frozen_params():
    p = _model().Freeze()
    q = Model.Params().FromText(p.ToText())
    assert q == p and not q.IsFrozen() and type(q.body) is list


def test_from_text_reuses_matching_params_and_replaces_others():
    p = _model()
    base = Model.Params()
    keep = Dense.Params().Set(name='old', units=1)
    base.body = [keep, Dense.Params()]
    base.FromText(p.ToText())
    assert base == p and base.body[0] is keep and keep.name == 'fc0'
    assert base.body[2].cls is Bare


def test_from_text_closed_params_reject_unknown_keys():
    text = f'body : [Params(cls={__name__}.Dense)]\nbody[0].unitz : 3'
    with pytest.raises(UnknownParamError) as info:
        Model.Params().FromText(text)
    assert 'line 2' in str(info.value) and "did you mean 'units'?" in str(info.value)


def test_from_text_unknown_key_suggests():
    text = 'learning_rate : 0.2\n\n# comment\nlearnin_rate : 0.3'
    p = _tree()
    with pytest.raises(UnknownParamError) as info:
        p.FromText(text)
    msg = str(info.value)
    assert msg.startswith('line 4 ') and "'learnin_rate'" in msg and msg.endswith(_HINT)
    with pytest.raises(UnknownParamError, match="line 1 .*did you mean 'beta1'"):
        p.FromText('opt.beta : 0.3')


def test_from_text_type_error_names_line():
    with pytest.raises(ParamsTypeError, match=r"^line 2 .*'batch_size' expects int"):
        _tree().FromText("learning_rate : 1\nbatch_size : 'many'")


def test_from_text_skips_blank_and_comment_lines_and_converts_int_to_float():
    p = _tree().FromText('\n  # learning_rate : 5\n   learning_rate : 2  \n')
    assert p.learning_rate == 2.0 and type(p.learning_rate) is float


@pytest.mark.parametrize('value', [
    "__import__('os').system('x')", "open('/etc/passwd')", 'lambda: 1', '1 + 1',
    '[x for x in ()]', "f'{1}'", 'os.system', 'os.path', "b'bytes'", '1j', 'tf.nosuchdtype',
    'tf.nn.relu', 'Params(cls=os.path.join)', 'Params(1)', 'Params(x=1)', '{1: 2}',
    'undefined_name', '...', '(1, 2', "'unterminated", '-True', '{**{}}', 'no_such_module_xyz.C',
    f'{__name__}.NoSuchClass', f'{__name__}._fn',
])
def test_from_text_rejects_non_literals(value):
    p = Params()
    p.Define('x', None, '')
    with pytest.raises(ParamsTextError, match=r'^line 1 '):
        p.FromText(f'x : {value}')
    assert p.x is None


def test_from_text_never_runs_code(tmp_path):
    marker = tmp_path / 'ran'
    p = Params()
    p.Define('x', None, '')
    with pytest.raises(ParamsTextError):
        p.FromText(f"x : __import__('pathlib').Path({str(marker)!r}).touch()")
    assert not marker.exists()


@pytest.mark.parametrize('line', ['x 1', ': 1', 'x :', 'x. : 1', '.x : 1', 'x[0 : 1'])
def test_from_text_rejects_malformed_lines(line):
    p = Params()
    p.Define('x', None, '')
    with pytest.raises((ParamsTextError, UnknownParamError), match=r'^line 1 '):
        p.FromText(line)
    assert p.x is None


# -- TextDiff --------------------------------------------------------------------------

def test_text_diff():
    p = _tree()
    assert p.TextDiff(p.Copy()) == ''
    q = p.Copy().Set(learning_rate=0.2, **{'layers[0].units': 9})
    q.Delete('batch_size')
    q.Define('extra', 'e', '')
    diff = p.TextDiff(q).splitlines()
    assert 'learning_rate : 0.1 -> 0.2' in diff
    assert 'layers[0].units : 4 -> 9' in diff
    assert '- batch_size : 32' in diff and "+ extra : 'e'" in diff
    assert len(diff) == 4


def test_text_diff_is_empty_for_equal_params_with_different_text():
    p, q = _tree(), _tree()
    p.table = {'a': 1, 'b': 2}
    q.table = {'b': 2, 'a': 1}
    assert p == q and p.ToText() != q.ToText() and p.TextDiff(q) == ''


# -- InstantiableParams ----------------------------------------------------------------

def test_instantiate_passes_frozen_copy_and_kwargs():
    p = Dense.Params().Set(name='fc', units=3)
    layer = p.Instantiate(parent='root')
    assert isinstance(layer, Dense) and layer.parent == 'root'
    assert layer.params == p and layer.params is not p and layer.params.IsFrozen()
    assert not p.IsFrozen()
    p.units = 5
    assert layer.params.units == 3
    _assert_frozen_error(lambda: setattr(layer.params, 'units', 7))


def test_instantiable_cls_is_type_checked():
    with pytest.raises(ParamsTypeError):
        InstantiableParams(Dense(None))
    p = InstantiableParams()
    with pytest.raises(ParamsTypeError, match="'cls' expects a class"):
        p.cls = 'Dense'
    with pytest.raises(ValueError, match='set p.cls'):
        p.Instantiate()
    p.cls = Bare
    assert isinstance(p.Instantiate(), Bare)


# -- import cost -----------------------------------------------------------------------

def test_module_does_not_import_tensorflow():
    # hyperparams and params_text are imported as submodules of a bare package, so
    # tfpipe/__init__.py (which imports TensorFlow for the layers) does not run.
    package = str(REPO / 'tfpipe')
    code = (
        'import sys, types\n'
        f'pkg = types.ModuleType("tfpipe"); pkg.__path__ = [{package!r}]\n'
        'sys.modules["tfpipe"] = pkg\n'
        'import tfpipe.hyperparams as hp\n'
        'p = hp.Params(); p.Define("x", [1.5], ""); p.Freeze()\n'
        'q = hp.Params(); q.Define("x", None, ""); q.FromText(p.ToText())\n'
        'assert q == p, q\n'
        'print("tensorflow" in sys.modules)\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == 'False'
