"""The text format of Params: what ``ToText`` writes and ``FromText`` reads back.

Why a module of its own: the format is a small language (a key-path grammar, a
literal syntax interpreted from ``ast`` without running code, classes resolved by
import path, placeholders standing for nested Params), while the Params container
in :mod:`tfpipe.hyperparams` is about the tree itself: definitions, type checks,
copying and freezing. Params uses this module at its text entry points only.
hyperparams imports this module at its top, so this one never imports hyperparams
at module level: it fetches ``Params``, ``InstantiableParams`` and
``ParamsTextError`` from it when a function runs. Like hyperparams, it imports
TensorFlow only to read a ``tf.<dtype>``.

Format: one ``key : value`` line per value, in definition order. Keys are paths:
``a.b``, ``[i]`` list/tuple indices, ``['k']`` dict keys. Values are Python
literals (str/int/float/bool/None, ``inf``/``-inf``/``nan``, nested
lists/tuples/dicts with str keys) plus three forms read without running code: a
class is ``module.QualName``, a dtype is ``tf.<name>``, and a Params is a
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
import importlib
import re
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Tuple

if TYPE_CHECKING:  # for annotations only: at run time see _hyperparams()
    from tfpipe.hyperparams import Params

__all__ = ['KeyPath', 'KeyToken', 'format_path', 'format_value', 'is_dtype', 'materialize',
           'parse_line', 'parse_path', 'short_repr', 'text_lines']

_PATH_TOKEN_RE = re.compile(r"""(?P<dot>\.)?(?P<name>[A-Za-z_]\w*)|\[(?P<index>-?\d+)\]"""
                            r"""|\[(?P<key>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\]""")
_SEP_RE = re.compile(r'\s*:\s*')
KeyToken = Tuple[str, Any]  # ('.', param name) or ('[', list index or dict key)
KeyPath = Tuple[KeyToken, ...]


def _hyperparams() -> Any:
    """The tfpipe.hyperparams module, imported late: it imports this one at its top."""
    from tfpipe import hyperparams  # pylint: disable=import-outside-toplevel,cyclic-import
    return hyperparams


def _text_error(message: str) -> Exception:
    return _hyperparams().ParamsTextError(message)


def is_dtype(value: Any) -> bool:
    # If TensorFlow was never imported nothing can be a DType, so we never import it.
    tf = sys.modules.get('tensorflow')
    return tf is not None and isinstance(value, tf.dtypes.DType)


# -- writing ---------------------------------------------------------------------------

def format_path(path: KeyPath) -> str:
    return ''.join(('.' if i else '') + key if kind == '.' else f'[{key!r}]'
                   for i, (kind, key) in enumerate(path))


def _placeholder_text(p: Params) -> str:
    if not isinstance(p, _hyperparams().InstantiableParams):
        return 'Params()'
    return f'Params(cls={format_value(getattr(p, "cls", None))})'


def format_value(value: Any) -> str:
    """One line that FromText reads back to an equal value (for supported types)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    for base in (int, float, str):  # the base repr: an IntEnum's would not read back
        if isinstance(value, base):
            return base.__repr__(value)
    if isinstance(value, _hyperparams().Params):
        return _placeholder_text(value)
    if isinstance(value, (list, tuple)):
        items = ', '.join(map(format_value, value))
        if isinstance(value, list):
            return f'[{items}]'
        return f'({items},)' if len(value) == 1 else f'({items})'
    if isinstance(value, dict):
        return '{' + ', '.join(f'{format_value(k)}: {format_value(v)}'
                               for k, v in value.items()) + '}'
    if isinstance(value, type):
        return f'{value.__module__}.{value.__qualname__}'
    if is_dtype(value):
        return f'tf.{value.name}'
    return repr(value).replace('\n', ' ')  # unsupported type: will not read back


def short_repr(value: Any, limit: int = 80) -> str:
    """A one-line repr for error messages, cut to `limit` characters."""
    is_params = isinstance(value, _hyperparams().Params)
    text = _placeholder_text(value) if is_params else repr(value)
    text = text.replace('\n', '\\n')
    return text if len(text) <= limit else text[:limit - 3] + '...'


def text_lines(p: Params, prefix: str = '') -> Iterator[Tuple[str, str]]:
    """(key, value text) for each value of Params p and of the Params inside it."""
    for name, value in p.IterParams():
        yield prefix + name, format_value(value)
        yield from _child_lines(prefix + name, value)


def _child_lines(key: str, value: Any) -> Iterator[Tuple[str, str]]:
    """Lines for the contents of the Params inside value (whose own line is written)."""
    if isinstance(value, _hyperparams().Params):
        yield from text_lines(value, key + '.')
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _child_lines(f'{key}[{i}]', item)
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _child_lines(f'{key}[{k!r}]', item)


# -- reading ---------------------------------------------------------------------------

def parse_path(text: str, pos: int = 0) -> Tuple[KeyPath, int]:
    """Reads a key like ``a.b[0]['k'].c`` from text[pos:]; returns it and its end."""
    tokens: List[KeyToken] = []
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


def parse_line(line: str) -> Tuple[KeyPath, Any]:
    """Splits a stripped ``key : value`` line into its key path and its value.

    The value may hold placeholders for Params: pass it through materialize().
    """
    path, end = parse_path(line)
    sep = _SEP_RE.match(line, end)
    if not path or sep is None or sep.end() == len(line):
        raise _text_error('expected "key : value"')
    try:
        tree = ast.parse(line[sep.end():], mode='eval')
    except (SyntaxError, ValueError) as e:
        raise _text_error(f'cannot parse the value: {e}') from e
    return path, _interpret(tree.body)


class _Placeholder:
    """A parsed ``Params(...)``; turned into a real Params by materialize()."""
    PLAIN = object()  # cls of a placeholder for a plain, non-instantiable Params

    def __init__(self, cls: Any) -> None:
        self.cls = cls

    def matches(self, old: Any) -> bool:
        hp = _hyperparams()
        if self.cls is self.PLAIN:
            return isinstance(old, hp.Params) and not isinstance(old, hp.InstantiableParams)
        return isinstance(old, hp.InstantiableParams) and getattr(old, 'cls', None) is self.cls

    def build(self) -> Tuple[Params, bool]:
        """Returns (new params, whether FromText may define new keys on it)."""
        hp = _hyperparams()
        if self.cls is self.PLAIN:
            return hp.Params(), True
        if not callable(getattr(self.cls, 'Params', None)):
            return hp.InstantiableParams(self.cls), True
        p = self.cls.Params()
        if not isinstance(p, hp.Params):
            raise _text_error(f'{self.cls.__qualname__}.Params() returned a '
                              f'{type(p).__name__}, not Params')
        return p, False


def _resolve_dotted(path: str) -> Any:
    """``tf.<dtype>`` or the ``module.QualName`` of a class; nothing else."""
    parts = path.split('.')
    if parts[0] == 'tf' and len(parts) == 2:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        try:
            return tf.dtypes.as_dtype(parts[1])
        except (TypeError, ValueError) as e:
            raise _text_error(f'{path!r} is not a TensorFlow dtype') from e
    for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix
        module_name = '.'.join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            missing = (getattr(e, 'name', None) or '\0') + '.'
            if isinstance(e, ModuleNotFoundError) and (module_name + '.').startswith(missing):
                continue  # this prefix is not a module (or its package is missing)
            raise _text_error(f'importing {module_name!r} for {path!r} failed: {e}') from e
        for attr in parts[i:]:
            obj = getattr(obj, attr, _Placeholder.PLAIN)
            if obj is _Placeholder.PLAIN:
                raise _text_error(f'{path!r}: {module_name!r} has no {attr!r}')
        if not isinstance(obj, type):
            raise _text_error(f'{path!r} is not a class; only classes are read by path')
        return obj
    raise _text_error(f'{path!r} is not the import path of a class')


def _interpret(node: ast.AST) -> Any:
    """Turns a parsed value into data; only literals and our three forms are allowed."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (bool, int, float, str)):
            return node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _interpret(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.Name):
        if node.id in ('inf', 'nan'):
            return float(node.id)
        raise _text_error(f'unknown name {node.id!r}: quote strings and write classes '
                          f'as module.Class')
    elif isinstance(node, ast.Attribute):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            return _resolve_dotted('.'.join([node.id] + parts))
    elif isinstance(node, (ast.List, ast.Tuple)):
        items = [_interpret(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    elif isinstance(node, ast.Dict):
        keys = [None if k is None else _interpret(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise _text_error('dict keys must be str literals')
        return dict(zip(keys, map(_interpret, node.values)))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == 'Params' and not node.args):
        if not node.keywords:
            return _Placeholder(_Placeholder.PLAIN)
        if len(node.keywords) == 1 and node.keywords[0].arg == 'cls':
            cls = _interpret(node.keywords[0].value)
            if cls is None or isinstance(cls, type):
                return _Placeholder(cls)
        raise _text_error('expected Params() or Params(cls=module.Class)')
    raise _text_error(f'{type(node).__name__} is not allowed: values are literals, '
                      f'module.Class, tf.<dtype> or Params(...)')


def materialize(value: Any, old: Any, opened: Dict[int, Params]) -> Any:
    """Replaces placeholders, reusing matching Params found at the same position.

    Params built from a bare placeholder (which may take new keys) go into `opened`.
    """
    if isinstance(value, _Placeholder):
        if value.matches(old):
            return old
        fresh, is_open = value.build()
        if is_open:
            opened[id(fresh)] = fresh
        return fresh
    if isinstance(value, (list, tuple)):
        olds = old if isinstance(old, (list, tuple)) else ()
        items = [materialize(v, olds[i] if i < len(olds) else None, opened)
                 for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        olds = old if isinstance(old, dict) else {}
        return {k: materialize(v, olds.get(k), opened) for k, v in value.items()}
    return value
