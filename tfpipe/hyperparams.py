"""Hierarchical, Lingvo-style hyper-parameters: the one way tfpipe is configured.

Every layer, pipeline and trainer takes a :class:`Params` tree, so an experiment
is data that can be printed, diffed, frozen and read back. Methods are CamelCase
on purpose: params are snake_case attributes and can never collide with them.

Freezing is deep and in place: every Params reachable through values, lists,
tuples and dicts is frozen, and lists/dicts become read-only ``list``/``dict``
subclasses whose mutators raise. Not tuples, so a list stays a list (equality,
text and type checks unchanged); not copy-on-read, so ``p.body.append(x)`` or
``p.body[0].x = 1`` fails loudly instead of editing a throw-away copy. Other
mutable objects (e.g. numpy arrays) are not made read-only.

Text format (``ToText``/``FromText``/``TextDiff``): one ``key : value`` line per
value, keys being paths like ``body[0].name``; read back without running code.
Its syntax, and which modules a class path may import, live in
:mod:`tfpipe.params_text`; this module walks the tree and turns the text's
``Params(...)`` placeholders into Params. A placeholder keeps the Params already
at its position when it is of the same kind (plain, or instantiable with the
same ``cls``), else builds one with ``cls.Params()`` when the class has it, else
``InstantiableParams(cls)`` or ``Params()``. Only those last two accept new keys
(defined on the fly), which makes ``base.Copy().FromText(p.ToText()) == p`` hold
even for a ``body`` list that is empty in ``base``.
"""
from __future__ import annotations

import copy
import difflib
import math
import numbers
import re
from typing import Any, Dict, Iterator, Optional, Tuple

from tfpipe.params_text import (KeyPath, KeyToken, ParamsPlaceholder, TextFormatError,
                                format_path, format_value, is_dtype, parse_line, parse_path,
                                short_repr)

__all__ = ['Params', 'InstantiableParams', 'ParamsError', 'UnknownParamError',
           'FrozenParamsError', 'ParamsTypeError', 'ParamsDefineError', 'ParamsTextError']


class ParamsError(Exception):
    """Base of this module's errors; lets FromText prefix any of them with the line."""


class UnknownParamError(ParamsError, AttributeError):
    """A key names no defined param (an AttributeError, so getattr/hasattr work)."""


class FrozenParamsError(ParamsError, TypeError):
    """Something inside a frozen Params tree was asked to change."""


class ParamsTypeError(ParamsError, TypeError):
    """A value does not match the type implied by the param's default."""


class ParamsDefineError(ParamsError, ValueError):
    """Define() got a bad, reserved or duplicate name."""


class ParamsTextError(ParamsError, ValueError):
    """FromText met a line or value it refuses to interpret."""


_NAME_RE = re.compile(r'^[a-z_][a-z0-9_]*$')
_FROZEN_HINT = 'call Copy() on the Params first to get a mutable copy'


def _refuse_mutation(self: Any, *args: Any, **kwargs: Any) -> None:
    raise FrozenParamsError(f'this {type(self).__mro__[1].__name__} belongs to frozen Params '
                            f'and is read-only; {_FROZEN_HINT}')


class _FrozenList(list):
    """A list stored in frozen Params: still a list, but every mutator raises."""
    __slots__ = ()
    append = extend = insert = remove = pop = clear = sort = reverse = _refuse_mutation
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse_mutation

    def __reduce__(self) -> Any:  # the default pickles via append(), which raises
        return _FrozenList, (list(self),)


class _FrozenDict(dict):
    """A dict stored in frozen Params: still a dict, but every mutator raises."""
    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _refuse_mutation
    pop = popitem = clear = update = setdefault = _refuse_mutation

    def __reduce__(self) -> Any:
        return _FrozenDict, (dict(self),)


class _Param:
    __slots__ = ('value', 'doc', 'kind')

    def __init__(self, value: Any, doc: str, kind: Any) -> None:
        self.value, self.doc, self.kind = value, doc, kind


def _kind_of(default: Any) -> Any:
    """The type family a default implies; None means 'accept anything'."""
    if default is None:
        return None
    for kind, types in (('bool', bool), ('int', numbers.Integral), ('float', numbers.Real),
                        ('str', str), ('Params', Params), ('list or tuple', (list, tuple)),
                        ('dict', dict), ('a class', type)):
        if isinstance(default, types):
            return kind
    return 'a tf.DType' if is_dtype(default) else type(default)


def _check_type(path: str, kind: Any, value: Any) -> Any:
    """Returns value (int made float where a float is expected) or raises."""
    if value is None or kind is None:
        return value
    is_bool = isinstance(value, bool)
    if kind == 'int' and isinstance(value, numbers.Integral) and not is_bool:
        return int(value)
    if kind == 'float' and isinstance(value, numbers.Real) and not is_bool:
        return float(value)
    ok = {'bool': is_bool, 'str': isinstance(value, str), 'Params': isinstance(value, Params),
          'list or tuple': isinstance(value, (list, tuple)), 'dict': isinstance(value, dict),
          'a class': isinstance(value, type), 'a tf.DType': is_dtype(value)}
    if ok.get(kind, False) if isinstance(kind, str) else isinstance(value, kind):
        return value
    want = ('float (or int)' if kind == 'float' else kind) if isinstance(kind, str) \
        else kind.__name__
    raise ParamsTypeError(f'param {path!r} expects {want}, got {_short(value)} '
                          f'({type(value).__name__})')


def _step(obj: Any, token: KeyToken, prefix: KeyPath) -> Any:
    """One lookup (param name, list index or dict key) below prefix."""
    kind, key = token
    if kind == '.':
        if isinstance(obj, Params):
            return obj._Lookup(key, prefix).value  # pylint: disable=protected-access
        raise UnknownParamError(f'cannot look up {key!r}: {format_path(prefix)!r} holds '
                                f'{type(obj).__name__}, not Params')
    try:
        if isinstance(obj, dict) or (isinstance(obj, (list, tuple)) and isinstance(key, int)):
            return obj[key]
    except (IndexError, KeyError):
        pass
    raise UnknownParamError(f'no element [{key!r}] in {format_path(prefix)!r} '
                            f'({_short(obj)})')


def _map_leaves(value: Any, fn: Any, list_type: type = list, dict_type: type = dict) -> Any:
    """Rebuilds the lists/tuples/dicts in value around fn(every other value)."""
    if isinstance(value, (list, tuple)):
        items = [_map_leaves(v, fn, list_type, dict_type) for v in value]
        return list_type(items) if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return dict_type((k, _map_leaves(v, fn, list_type, dict_type)) for k, v in value.items())
    return fn(value)


def _copy_leaf(value: Any) -> Any:
    if isinstance(value, Params):
        return value.Copy()
    if value is None or isinstance(value, (bool, int, float, str, type)) or is_dtype(value):
        return value
    return copy.deepcopy(value)


def _freeze_leaf(value: Any) -> Any:
    return value.Freeze() if isinstance(value, Params) else value


def _values_equal(a: Any, b: Any) -> bool:
    """Deep equality that keeps bool/int/float and list/tuple apart and has nan == nan."""
    if isinstance(a, Params) or isinstance(b, Params):
        return isinstance(a, Params) and isinstance(b, Params) and a == b
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        same = isinstance(a, list) == isinstance(b, list) and isinstance(b, (list, tuple))
        return same and len(a) == len(b) and all(map(_values_equal, a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_values_equal(v, b[k]) for k, v in a.items()))
    if isinstance(a, bool) != isinstance(b, bool) or isinstance(a, float) != isinstance(b, float):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # pylint: disable=broad-except  (e.g. ambiguous array truth value)
        return a is b


# -- text form: Params trees as the lines and placeholders of tfpipe.params_text -----

def _placeholder_of(value: Any) -> Any:
    if not isinstance(value, Params):
        return value
    if isinstance(value, InstantiableParams):
        return ParamsPlaceholder(getattr(value, 'cls', None))
    return ParamsPlaceholder(ParamsPlaceholder.PLAIN)


def _text_form(value: Any) -> Any:
    """value with every Params in it replaced by its placeholder."""
    return _map_leaves(value, _placeholder_of)


def _short(value: Any) -> str:
    return short_repr(_text_form(value))


def _text_lines(p: Params, prefix: str = '') -> Iterator[Tuple[str, str]]:
    """(key, value text) for each value of Params p and of the Params inside it."""
    for name, value in p.IterParams():
        yield prefix + name, format_value(_text_form(value))
        yield from _child_lines(prefix + name, value)


def _child_lines(key: str, value: Any) -> Iterator[Tuple[str, str]]:
    """Lines for the contents of the Params inside value (whose own line is written)."""
    if isinstance(value, Params):
        yield from _text_lines(value, key + '.')
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _child_lines(f'{key}[{i}]', item)
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _child_lines(f'{key}[{k!r}]', item)


def _matches(placeholder: ParamsPlaceholder, old: Any) -> bool:
    if placeholder.cls is ParamsPlaceholder.PLAIN:
        return isinstance(old, Params) and not isinstance(old, InstantiableParams)
    return isinstance(old, InstantiableParams) and getattr(old, 'cls', None) is placeholder.cls


def _build(placeholder: ParamsPlaceholder) -> Tuple[Params, bool]:
    """Returns (new params, whether FromText may define new keys on it)."""
    cls = placeholder.cls
    if cls is ParamsPlaceholder.PLAIN:
        return Params(), True
    if not callable(getattr(cls, 'Params', None)):
        return InstantiableParams(cls), True
    p = cls.Params()
    if not isinstance(p, Params):
        raise ParamsTextError(f'{cls.__qualname__}.Params() returned a {type(p).__name__}, '
                              'not Params')
    return p, False


def _materialize(value: Any, old: Any, opened: Dict[int, Params]) -> Any:
    """Replaces placeholders, reusing matching Params found at the same position.

    Params built from a bare placeholder (which may take new keys) go into `opened`.
    """
    if isinstance(value, ParamsPlaceholder):
        if _matches(value, old):
            return old
        fresh, is_open = _build(value)
        if is_open:
            opened[id(fresh)] = fresh
        return fresh
    if isinstance(value, (list, tuple)):
        olds = old if isinstance(old, (list, tuple)) else ()
        items = [_materialize(v, olds[i] if i < len(olds) else None, opened)
                 for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        olds = old if isinstance(old, dict) else {}
        return {k: _materialize(v, olds.get(k), opened) for k, v in value.items()}
    return value


class Params:
    """A tree of named, documented, type-checked values (see the module docstring)."""

    __hash__ = None  # mutable and compared by value

    def __init__(self) -> None:
        object.__setattr__(self, '_Params__params', {})
        object.__setattr__(self, '_Params__frozen', False)

    def Define(self, name: str, default: Any, doc: str) -> None:
        """Adds param `name`; a non-None default fixes the type later values must have."""
        self._CheckNotFrozen(())
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ParamsDefineError(f'invalid param name {name!r}: must match {_NAME_RE.pattern}')
        if name.startswith('__') or hasattr(type(self), name):
            raise ParamsDefineError(f'param name {name!r} is reserved by {type(self).__name__}')
        if name in self.__params:
            raise ParamsDefineError(f'param {name!r} is already defined in {self._Describe(())}')
        self.__params[name] = _Param(default, doc, _kind_of(default))

    def Set(self, **kwargs: Any) -> Params:
        """Sets values and returns self; keys may be paths like ``'a.b'``, ``'body[0].x'``."""
        self._CheckNotFrozen(())
        for key, value in kwargs.items():
            owner, name, prefix = self._Owner(key)
            owner._SetOne(name, value, prefix)
        return self

    def Get(self, key: str) -> Any:
        """The value at a name or a path such as ``'a.b'`` or ``'body[0].name'``."""
        path = self._ParseKey(key)
        obj: Any = self
        for i, token in enumerate(path):
            obj = _step(obj, token, path[:i])
        return obj

    def ExpectedType(self, key: str) -> Any:
        """The type family the param's default fixed ('str', 'int', 'float', ...; None when
        the default was None and any value goes), for a name or a path.

        Text that carries no type of its own (a --params_override value) can then be read
        as the param expects it: a bare word where a str is expected is that str.
        """
        owner, name, prefix = self._Owner(key)
        return owner._Lookup(name, prefix).kind

    def Delete(self, *keys: str) -> Params:
        """Removes params (names or paths ending in a name); returns self."""
        self._CheckNotFrozen(())
        for key in keys:
            owner, name, prefix = self._Owner(key)
            owner._CheckNotFrozen(prefix)
            owner._Lookup(name, prefix)
            del owner.__params[name]
        return self

    def IterParams(self) -> Iterator[Tuple[str, Any]]:
        """(name, value) pairs in definition order."""
        return iter([(name, p.value) for name, p in self.__params.items()])

    __iter__ = IterParams

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        try:
            self.Get(key)  # names and paths
        except UnknownParamError:
            return False
        return True

    def __getattr__(self, name: str) -> Any:
        if '_Params__params' not in self.__dict__ or name.startswith('__'):
            raise AttributeError(name)  # half-built (unpickling) or a dunder probe
        return self._Lookup(name, ()).value

    def __setattr__(self, name: str, value: Any) -> None:
        self._SetOne(name, value, ())

    def Copy(self) -> Params:
        """Deep copy of the same class; never frozen, shares nothing mutable with self."""
        new = type(self).__new__(type(self))
        object.__setattr__(new, '_Params__params', {
            n: _Param(_map_leaves(p.value, _copy_leaf), p.doc, p.kind)
            for n, p in self.__params.items()})
        object.__setattr__(new, '_Params__frozen', False)
        return new

    def __deepcopy__(self, memo: Dict[int, Any]) -> Params:
        return self.Copy()

    def Freeze(self) -> Params:
        """Makes this tree read-only, deeply and in place (see the module docstring)."""
        if not self.__frozen:
            object.__setattr__(self, '_Params__frozen', True)
            for p in self.__params.values():
                p.value = _map_leaves(p.value, _freeze_leaf, _FrozenList, _FrozenDict)
        return self

    def IsFrozen(self) -> bool:
        return self.__frozen

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Params):
            return NotImplemented
        mine, theirs = self.__params, other.__params
        return mine.keys() == theirs.keys() and all(
            _values_equal(p.value, theirs[name].value) for name, p in mine.items())

    def ToText(self) -> str:
        """``key : value`` lines in definition order; FromText reads them back."""
        return '\n'.join(f'{key} : {text}' for key, text in _text_lines(self))

    __str__ = __repr__ = ToText

    def FromText(self, text: str) -> Params:
        """Sets values from ToText-style lines (blank and ``#`` lines are skipped)."""
        self._CheckNotFrozen(())
        opened: Dict[int, Params] = {}  # built here from a bare placeholder: keys may be new
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith('#'):
                continue
            try:
                path, value = parse_line(line)
                owner, name, prefix = self._Owner(path)
                if id(owner) in opened and name not in owner.__params:
                    owner.Define(name, _materialize(value, None, opened), '')
                    continue
                old = owner._Lookup(name, prefix).value
                owner._SetOne(name, _materialize(value, old, opened), prefix)
            except TextFormatError as e:
                raise ParamsTextError(f'line {lineno} ({short_repr(line)}): {e}') from e
            except ParamsError as e:
                raise type(e)(f'line {lineno} ({short_repr(line)}): {e}') from e
        return self

    def TextDiff(self, other: Params) -> str:
        """``- key : v`` (only in self), ``+ key : v`` (only in other), ``key : a -> b``."""
        if self == other:
            return ''
        mine, theirs = dict(_text_lines(self)), dict(_text_lines(other))
        lines = [f'- {key} : {text}' if key not in theirs else f'{key} : {text} -> {theirs[key]}'
                 for key, text in mine.items() if theirs.get(key) != text]
        lines += [f'+ {key} : {text}' for key, text in theirs.items() if key not in mine]
        return '\n'.join(lines)

    def _Describe(self, prefix: KeyPath) -> str:
        desc = type(self).__name__
        cls = self.__params.get('cls')
        if isinstance(self, InstantiableParams) and cls and isinstance(cls.value, type):
            desc += f'(cls={cls.value.__qualname__})'
        return desc + (f' at {format_path(prefix)!r}' if prefix else '')

    def _CheckNotFrozen(self, prefix: KeyPath) -> None:
        if self.__frozen:
            raise FrozenParamsError(f'{self._Describe(prefix)} is frozen; {_FROZEN_HINT}')

    def _Lookup(self, name: str, prefix: KeyPath) -> _Param:
        param = self.__params.get(name)
        if param is None:
            close = difflib.get_close_matches(name, list(self.__params), n=1)
            hint = f'; did you mean {close[0]!r}?' if close else ''
            raise UnknownParamError(f'unknown param {name!r} in {self._Describe(prefix)}{hint}')
        return param

    def _SetOne(self, name: str, value: Any, prefix: KeyPath) -> None:
        self._CheckNotFrozen(prefix)
        param = self._Lookup(name, prefix)
        param.value = _check_type(format_path(prefix + (('.', name),)), param.kind, value)

    @staticmethod
    def _ParseKey(key: str) -> KeyPath:
        path, end = parse_path(key)
        if not path or end != len(key):
            raise UnknownParamError(f'malformed key {key!r}: expected names joined by "." '
                                    f'with optional [index] parts')
        return path

    def _Owner(self, key: Any) -> Tuple[Params, str, KeyPath]:
        """(Params holding the param a key ends in, its name, the path to that Params)."""
        path = self._ParseKey(key) if isinstance(key, str) else key
        obj: Any = self
        for i, token in enumerate(path[:-1]):
            obj = _step(obj, token, path[:i])
        if path[-1][0] != '.' or not isinstance(obj, Params):
            raise UnknownParamError(f'{format_path(path)!r} does not name a param; set or '
                                    f'delete the whole container instead')
        return obj, path[-1][1], path[:-1]


class InstantiableParams(Params):
    """Params that know the class they configure: ``p.Instantiate()`` builds it."""

    def __init__(self, cls: Optional[type] = None) -> None:
        super().__init__()
        self.Define('cls', _check_type('cls', 'a class', cls),
                    'The class that Instantiate() builds from these params.')
        self._Params__params['cls'].kind = 'a class'  # type-checked even when cls is None

    def Instantiate(self, **kwargs: Any) -> Any:
        """Returns ``cls(frozen deep copy of self, **kwargs)``.

        A frozen copy: later edits to these params cannot change a built object,
        and the object cannot change the user's params.
        """
        if self.cls is None:
            raise ValueError(f'{self._Describe(())}: set p.cls before Instantiate()')
        return self.cls(self.Copy().Freeze(), **kwargs)
