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

Text format: one ``key : value`` line per value, in definition order. Keys are
paths: ``a.b``, ``[i]`` list/tuple indices, ``['k']`` dict keys. Values are
Python literals (str/int/float/bool/None, ``inf``/``-inf``/``nan``, nested
lists/tuples/dicts with str keys) plus three forms read without running code:
a class is ``module.QualName``, a dtype is ``tf.<name>``, and a Params is a
placeholder, ``Params()`` or ``Params(cls=module.QualName)`` for an
InstantiableParams, whose own values follow on the lines below it::

    body : [Params(cls=tfpipe.layers.dense.Dense), Params(cls=tfpipe.layers.dense.Dense)]
    body[0].cls : tfpipe.layers.dense.Dense
    body[0].name : 'fc0'
    body[0].output_dim : 128
    body[1].cls : tfpipe.layers.dense.Dense
    body[1].name : 'fc1'
    body[1].output_dim : 10
    dtype : tf.float32
    optimizer : Params()
    optimizer.learning_rate : 0.1

``p.FromText(text)`` sets values on an existing tree; unknown keys are errors.
A placeholder keeps the Params already at its position when it is of the same
kind (plain, or instantiable with the same ``cls``), else builds one with
``cls.Params()`` when the class has it, else ``InstantiableParams(cls)`` or
``Params()``. Only those last two accept new keys (defined on the fly), which
makes ``base.Copy().FromText(p.ToText()) == p`` hold even for a ``body`` list
that is empty in ``base``. ``FromText`` never evaluates code: it interprets
``ast`` nodes and rejects anything else, naming the line. Reading a class path
imports its module; classes defined inside functions cannot be read back.
"""
from __future__ import annotations

import ast
import copy
import difflib
import importlib
import math
import numbers
import re
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

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
_PATH_TOKEN_RE = re.compile(r"""(?P<dot>\.)?(?P<name>[A-Za-z_]\w*)|\[(?P<index>-?\d+)\]"""
                            r"""|\[(?P<key>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\]""")
_SEP_RE = re.compile(r'\s*:\s*')
_FROZEN_HINT = 'call Copy() on the Params first to get a mutable copy'
_Token = Tuple[str, Any]  # ('.', param name) or ('[', list index or dict key)
_Path = Tuple[_Token, ...]


def _RefuseMutation(self: Any, *args: Any, **kwargs: Any) -> None:
    raise FrozenParamsError(f'this {type(self).__mro__[1].__name__} belongs to frozen Params '
                            f'and is read-only; {_FROZEN_HINT}')


class _FrozenList(list):
    """A list stored in frozen Params: still a list, but every mutator raises."""
    __slots__ = ()
    append = extend = insert = remove = pop = clear = sort = reverse = _RefuseMutation
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _RefuseMutation

    def __reduce__(self) -> Any:  # the default pickles via append(), which raises
        return _FrozenList, (list(self),)


class _FrozenDict(dict):
    """A dict stored in frozen Params: still a dict, but every mutator raises."""
    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _RefuseMutation
    pop = popitem = clear = update = setdefault = _RefuseMutation

    def __reduce__(self) -> Any:
        return _FrozenDict, (dict(self),)


class _Param:
    __slots__ = ('value', 'doc', 'kind')

    def __init__(self, value: Any, doc: str, kind: Any) -> None:
        self.value, self.doc, self.kind = value, doc, kind


def _IsDType(value: Any) -> bool:
    # If TensorFlow was never imported nothing can be a DType, so we never import it.
    tf = sys.modules.get('tensorflow')
    return tf is not None and isinstance(value, tf.dtypes.DType)


def _KindOf(default: Any) -> Any:
    """The type family a default implies; None means 'accept anything'."""
    if default is None:
        return None
    for kind, types in (('bool', bool), ('int', numbers.Integral), ('float', numbers.Real),
                        ('str', str), ('Params', Params), ('list or tuple', (list, tuple)),
                        ('dict', dict), ('a class', type)):
        if isinstance(default, types):
            return kind
    return 'a tf.DType' if _IsDType(default) else type(default)


def _CheckType(path: str, kind: Any, value: Any) -> Any:
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
          'a class': isinstance(value, type), 'a tf.DType': _IsDType(value)}
    if ok.get(kind, False) if isinstance(kind, str) else isinstance(value, kind):
        return value
    want = ('float (or int)' if kind == 'float' else kind) if isinstance(kind, str) \
        else kind.__name__
    raise ParamsTypeError(f'param {path!r} expects {want}, got {_ShortRepr(value)} '
                          f'({type(value).__name__})')


def _ShortRepr(value: Any, limit: int = 80) -> str:
    text = _PlaceholderText(value) if isinstance(value, Params) else repr(value)
    text = text.replace('\n', '\\n')
    return text if len(text) <= limit else text[:limit - 3] + '...'


def _FormatPath(path: _Path) -> str:
    return ''.join(('.' if i else '') + key if kind == '.' else f'[{key!r}]'
                   for i, (kind, key) in enumerate(path))


def _ParsePath(text: str, pos: int = 0) -> Tuple[_Path, int]:
    """Reads a key like ``a.b[0]['k'].c`` from text[pos:]; returns it and its end."""
    tokens: List[_Token] = []
    while (m := _PATH_TOKEN_RE.match(text, pos)) is not None:
        if m.group('name') is not None:
            if bool(m.group('dot')) != bool(tokens):
                break
            tokens.append(('.', m.group('name')))
        elif not tokens:
            break
        elif m.group('index') is not None:
            tokens.append(('[', int(m.group('index'))))
        else:
            tokens.append(('[', ast.literal_eval(m.group('key'))))
        pos = m.end()
    return tuple(tokens), pos


def _Step(obj: Any, token: _Token, prefix: _Path) -> Any:
    """One lookup (param name, list index or dict key) below prefix."""
    kind, key = token
    if kind == '.':
        if isinstance(obj, Params):
            return obj._Lookup(key, prefix).value  # pylint: disable=protected-access
        raise UnknownParamError(f'cannot look up {key!r}: {_FormatPath(prefix)!r} holds '
                                f'{type(obj).__name__}, not Params')
    try:
        if isinstance(obj, dict) or (isinstance(obj, (list, tuple)) and isinstance(key, int)):
            return obj[key]
    except (IndexError, KeyError):
        pass
    raise UnknownParamError(f'no element [{key!r}] in {_FormatPath(prefix)!r} '
                            f'({_ShortRepr(obj)})')


def _MapLeaves(value: Any, fn: Any, list_type: type = list, dict_type: type = dict) -> Any:
    """Rebuilds the lists/tuples/dicts in value around fn(every other value)."""
    if isinstance(value, (list, tuple)):
        items = [_MapLeaves(v, fn, list_type, dict_type) for v in value]
        return list_type(items) if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return dict_type((k, _MapLeaves(v, fn, list_type, dict_type)) for k, v in value.items())
    return fn(value)


def _CopyLeaf(value: Any) -> Any:
    if isinstance(value, Params):
        return value.Copy()
    if value is None or isinstance(value, (bool, int, float, str, type)) or _IsDType(value):
        return value
    return copy.deepcopy(value)


def _FreezeLeaf(value: Any) -> Any:
    return value.Freeze() if isinstance(value, Params) else value


def _ValuesEqual(a: Any, b: Any) -> bool:
    """Deep equality that keeps bool/int/float and list/tuple apart and has nan == nan."""
    if isinstance(a, Params) or isinstance(b, Params):
        return isinstance(a, Params) and isinstance(b, Params) and a == b
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        same = isinstance(a, list) == isinstance(b, list) and isinstance(b, (list, tuple))
        return same and len(a) == len(b) and all(map(_ValuesEqual, a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_ValuesEqual(v, b[k]) for k, v in a.items()))
    if isinstance(a, bool) != isinstance(b, bool) or isinstance(a, float) != isinstance(b, float):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # pylint: disable=broad-except  (e.g. ambiguous array truth value)
        return a is b


def _PlaceholderText(p: Params) -> str:
    if not isinstance(p, InstantiableParams):
        return 'Params()'
    return f'Params(cls={_FormatValue(getattr(p, "cls", None))})'


def _FormatValue(value: Any) -> str:
    """One line that FromText reads back to an equal value (for supported types)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    for base in (int, float, str):  # the base repr: an IntEnum's would not read back
        if isinstance(value, base):
            return base.__repr__(value)
    if isinstance(value, Params):
        return _PlaceholderText(value)
    if isinstance(value, (list, tuple)):
        items = ', '.join(map(_FormatValue, value))
        if isinstance(value, list):
            return f'[{items}]'
        return f'({items},)' if len(value) == 1 else f'({items})'
    if isinstance(value, dict):
        return '{' + ', '.join(f'{_FormatValue(k)}: {_FormatValue(v)}'
                               for k, v in value.items()) + '}'
    if isinstance(value, type):
        return f'{value.__module__}.{value.__qualname__}'
    if _IsDType(value):
        return f'tf.{value.name}'
    return repr(value).replace('\n', ' ')  # unsupported type: will not read back


class _Placeholder:
    """A parsed ``Params(...)``; turned into a real Params by _Materialize."""
    PLAIN = object()  # cls of a placeholder for a plain, non-instantiable Params

    def __init__(self, cls: Any) -> None:
        self.cls = cls

    def Matches(self, old: Any) -> bool:
        if self.cls is self.PLAIN:
            return isinstance(old, Params) and not isinstance(old, InstantiableParams)
        return isinstance(old, InstantiableParams) and getattr(old, 'cls', None) is self.cls

    def Build(self) -> Tuple[Params, bool]:
        """Returns (new params, whether FromText may define new keys on it)."""
        if self.cls is self.PLAIN:
            return Params(), True
        if not callable(getattr(self.cls, 'Params', None)):
            return InstantiableParams(self.cls), True
        p = self.cls.Params()
        if not isinstance(p, Params):
            raise ParamsTextError(f'{self.cls.__qualname__}.Params() returned a '
                                  f'{type(p).__name__}, not Params')
        return p, False


def _ResolveDotted(path: str) -> Any:
    """``tf.<dtype>`` or the ``module.QualName`` of a class; nothing else."""
    parts = path.split('.')
    if parts[0] == 'tf' and len(parts) == 2:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        try:
            return tf.dtypes.as_dtype(parts[1])
        except (TypeError, ValueError) as e:
            raise ParamsTextError(f'{path!r} is not a TensorFlow dtype') from e
    for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix
        module_name = '.'.join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            missing = (getattr(e, 'name', None) or '\0') + '.'
            if isinstance(e, ModuleNotFoundError) and (module_name + '.').startswith(missing):
                continue  # this prefix is not a module (or its package is missing)
            raise ParamsTextError(f'importing {module_name!r} for {path!r} failed: {e}') from e
        for attr in parts[i:]:
            obj = getattr(obj, attr, _Placeholder.PLAIN)
            if obj is _Placeholder.PLAIN:
                raise ParamsTextError(f'{path!r}: {module_name!r} has no {attr!r}')
        if not isinstance(obj, type):
            raise ParamsTextError(f'{path!r} is not a class; only classes are read by path')
        return obj
    raise ParamsTextError(f'{path!r} is not the import path of a class')


def _Interpret(node: ast.AST) -> Any:
    """Turns a parsed value into data; only literals and our three forms are allowed."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (bool, int, float, str)):
            return node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _Interpret(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.Name):
        if node.id in ('inf', 'nan'):
            return float(node.id)
        raise ParamsTextError(f'unknown name {node.id!r}: quote strings and write classes '
                              f'as module.Class')
    elif isinstance(node, ast.Attribute):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            return _ResolveDotted('.'.join([node.id] + parts))
    elif isinstance(node, (ast.List, ast.Tuple)):
        items = [_Interpret(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    elif isinstance(node, ast.Dict):
        keys = [None if k is None else _Interpret(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ParamsTextError('dict keys must be str literals')
        return dict(zip(keys, map(_Interpret, node.values)))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == 'Params' and not node.args):
        if not node.keywords:
            return _Placeholder(_Placeholder.PLAIN)
        if len(node.keywords) == 1 and node.keywords[0].arg == 'cls':
            cls = _Interpret(node.keywords[0].value)
            if cls is None or isinstance(cls, type):
                return _Placeholder(cls)
        raise ParamsTextError('expected Params() or Params(cls=module.Class)')
    raise ParamsTextError(f'{type(node).__name__} is not allowed: values are literals, '
                          f'module.Class, tf.<dtype> or Params(...)')


def _Materialize(value: Any, old: Any, opened: Dict[int, Params]) -> Any:
    """Replaces placeholders, reusing matching Params found at the same position."""
    if isinstance(value, _Placeholder):
        if value.Matches(old):
            return old
        fresh, is_open = value.Build()
        if is_open:
            opened[id(fresh)] = fresh
        return fresh
    if isinstance(value, (list, tuple)):
        olds = old if isinstance(old, (list, tuple)) else ()
        items = [_Materialize(v, olds[i] if i < len(olds) else None, opened)
                 for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        olds = old if isinstance(old, dict) else {}
        return {k: _Materialize(v, olds.get(k), opened) for k, v in value.items()}
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
        self.__params[name] = _Param(default, doc, _KindOf(default))

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
            obj = _Step(obj, token, path[:i])
        return obj

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
            n: _Param(_MapLeaves(p.value, _CopyLeaf), p.doc, p.kind)
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
                p.value = _MapLeaves(p.value, _FreezeLeaf, _FrozenList, _FrozenDict)
        return self

    def IsFrozen(self) -> bool:
        return self.__frozen

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Params):
            return NotImplemented
        mine, theirs = self.__params, other.__params
        return mine.keys() == theirs.keys() and all(
            _ValuesEqual(p.value, theirs[name].value) for name, p in mine.items())

    def ToText(self) -> str:
        """``key : value`` lines in definition order; FromText reads them back."""
        return '\n'.join(f'{key} : {text}' for key, text in self._TextLines(''))

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
                path, end = _ParsePath(line)
                sep = _SEP_RE.match(line, end)
                if not path or sep is None or sep.end() == len(line):
                    raise ParamsTextError('expected "key : value"')
                try:
                    tree = ast.parse(line[sep.end():], mode='eval')
                except (SyntaxError, ValueError) as e:
                    raise ParamsTextError(f'cannot parse the value: {e}') from e
                value = _Interpret(tree.body)
                owner, name, prefix = self._Owner(path)
                if id(owner) in opened and name not in owner.__params:
                    owner.Define(name, _Materialize(value, None, opened), '')
                    continue
                old = owner._Lookup(name, prefix).value
                owner._SetOne(name, _Materialize(value, old, opened), prefix)
            except ParamsError as e:
                raise type(e)(f'line {lineno} ({_ShortRepr(line)}): {e}') from e
        return self

    def TextDiff(self, other: Params) -> str:
        """``- key : v`` (only in self), ``+ key : v`` (only in other), ``key : a -> b``."""
        if self == other:
            return ''
        mine, theirs = dict(self._TextLines('')), dict(other._TextLines(''))
        lines = [f'- {key} : {text}' if key not in theirs else f'{key} : {text} -> {theirs[key]}'
                 for key, text in mine.items() if theirs.get(key) != text]
        lines += [f'+ {key} : {text}' for key, text in theirs.items() if key not in mine]
        return '\n'.join(lines)

    def _Describe(self, prefix: _Path) -> str:
        desc = type(self).__name__
        cls = self.__params.get('cls')
        if isinstance(self, InstantiableParams) and cls and isinstance(cls.value, type):
            desc += f'(cls={cls.value.__qualname__})'
        return desc + (f' at {_FormatPath(prefix)!r}' if prefix else '')

    def _CheckNotFrozen(self, prefix: _Path) -> None:
        if self.__frozen:
            raise FrozenParamsError(f'{self._Describe(prefix)} is frozen; {_FROZEN_HINT}')

    def _Lookup(self, name: str, prefix: _Path) -> _Param:
        param = self.__params.get(name)
        if param is None:
            close = difflib.get_close_matches(name, list(self.__params), n=1)
            hint = f'; did you mean {close[0]!r}?' if close else ''
            raise UnknownParamError(f'unknown param {name!r} in {self._Describe(prefix)}{hint}')
        return param

    def _SetOne(self, name: str, value: Any, prefix: _Path) -> None:
        self._CheckNotFrozen(prefix)
        param = self._Lookup(name, prefix)
        param.value = _CheckType(_FormatPath(prefix + (('.', name),)), param.kind, value)

    @staticmethod
    def _ParseKey(key: str) -> _Path:
        path, end = _ParsePath(key)
        if not path or end != len(key):
            raise UnknownParamError(f'malformed key {key!r}: expected names joined by "." '
                                    f'with optional [index] parts')
        return path

    def _Owner(self, key: Any) -> Tuple[Params, str, _Path]:
        """(Params holding the param a key ends in, its name, the path to that Params)."""
        path = self._ParseKey(key) if isinstance(key, str) else key
        obj: Any = self
        for i, token in enumerate(path[:-1]):
            obj = _Step(obj, token, path[:i])
        if path[-1][0] != '.' or not isinstance(obj, Params):
            raise UnknownParamError(f'{_FormatPath(path)!r} does not name a param; set or '
                                    f'delete the whole container instead')
        return obj, path[-1][1], path[:-1]

    def _TextLines(self, prefix: str) -> Iterator[Tuple[str, str]]:
        for name, value in self.IterParams():
            yield prefix + name, _FormatValue(value)
            yield from _ChildLines(prefix + name, value)


def _ChildLines(key: str, value: Any) -> Iterator[Tuple[str, str]]:
    """Lines for the contents of the Params inside value (whose own line is written)."""
    if isinstance(value, Params):
        yield from value._TextLines(key + '.')  # pylint: disable=protected-access
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _ChildLines(f'{key}[{i}]', item)
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _ChildLines(f'{key}[{k!r}]', item)


class InstantiableParams(Params):
    """Params that know the class they configure: ``p.Instantiate()`` builds it."""

    def __init__(self, cls: Optional[type] = None) -> None:
        super().__init__()
        self.Define('cls', _CheckType('cls', 'a class', cls),
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
