"""The text format of Params: the syntax ``ToText`` writes and ``FromText`` reads.

Why a module of its own: the format is a small language (a key-path grammar, a
literal syntax interpreted from ``ast`` without running code, classes resolved by
import path from trusted packages only, placeholders standing for nested Params),
while the Params container in :mod:`tfpipe.hyperparams` is about the tree itself:
definitions, type checks, copying, freezing, and turning placeholders into Params.
The dependency runs one way: hyperparams imports this module, and this module
knows nothing of Params (a nested Params is a :class:`ParamsPlaceholder` here).
It imports TensorFlow only to read a ``tf.<dtype>``.

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
    dtype : tf.float32
    optimizer : Params()
    optimizer.learning_rate : 0.1

Reading a class path imports its module, which runs that module's top-level
code, so a params file could otherwise run any code on the path. Only modules
inside trusted packages are imported: ``tfpipe`` and ``builtins`` always, and whatever
:func:`trust_package` added (the trainer adds the registered models' package and
the package of the model it runs). Any other module is an error naming it,
raised before anything is imported. Classes defined inside functions cannot be
read back.

A str param that names a function (an input's ``examples_fn``, ``tokenizer``) is
plain text to this format; the code that imports it asks :func:`check_function_name`
first, so the same rule holds for every param that names code. ``builtins`` is
trusted for its classes only: its functions (``exec``, ``eval``, ``open``) would run
whatever the next param holds.
"""
from __future__ import annotations

import ast
import importlib
import re
import sys
from typing import Any, List, Tuple

__all__ = ['KeyPath', 'KeyToken', 'ParamsPlaceholder', 'TextFormatError', 'format_path',
           'check_function_name', 'format_value', 'is_dtype', 'parse_line', 'parse_path',
           'short_repr',
           'trust_package', 'trusted_packages']

_PATH_TOKEN_RE = re.compile(r"""(?P<dot>\.)?(?P<name>[A-Za-z_]\w*)|\[(?P<index>-?\d+)\]"""
                            r"""|\[(?P<key>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\]""")
_SEP_RE = re.compile(r'\s*:\s*')
_MODULE_RE = re.compile(r'^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$')
KeyToken = Tuple[str, Any]  # ('.', param name) or ('[', list index or dict key)
KeyPath = Tuple[KeyToken, ...]

# builtins (int, str, ...) is loaded in every process: naming it imports nothing new.
_trusted = {'tfpipe', 'builtins'}


class TextFormatError(ValueError):
    """A line or value the format refuses; FromText reports it as ParamsTextError."""


def trust_package(name: str) -> None:
    """Lets params text name classes in package (or module) `name` and below it.

    Call it for a package whose classes your params hold, before reading params
    text: e.g. ``trust_package('mypkg')`` for layers in ``mypkg.layers``.
    """
    if not isinstance(name, str) or not _MODULE_RE.match(name):
        raise ValueError(f'trust_package({name!r}): expected a module name like "mypkg"')
    _trusted.add(name)


def trusted_packages() -> Tuple[str, ...]:
    """The packages whose modules params text may import, sorted."""
    return tuple(sorted(_trusted))


def _is_trusted(module: str) -> bool:
    return any(module == t or module.startswith(t + '.') for t in _trusted)


def check_function_name(name: str, key: str) -> None:
    """Refuses `name` (``module.function``, the value of param `key`) unless its module
    lies in a trusted package other than ``builtins``; call it before importing `name`.

    Importing runs the module's top level and calling the function runs it on
    arguments that are params too (``examples_fn(split)``), so a params.txt that names
    a function must pass the rule a class path passes.
    """
    module = name.rpartition('.')[0]
    if module and _is_trusted(module) and module.split('.')[0] != 'builtins':
        return
    top = module.split('.')[0] or name
    allowed = [t for t in trusted_packages() if t != 'builtins']
    raise TextFormatError(
        f'{key} {name!r} names module {module!r}, outside the trusted packages {allowed}: '
        "params import no other code; define the function in the model's own package or "
        f'call tfpipe.params_text.trust_package({top!r}) first')


def is_dtype(value: Any) -> bool:
    # If TensorFlow was never imported nothing can be a DType, so we never import it.
    tf = sys.modules.get('tensorflow')
    return tf is not None and isinstance(value, tf.dtypes.DType)


class ParamsPlaceholder:
    """The text form of a nested Params: ``Params()`` or ``Params(cls=module.Class)``.

    `cls` is PLAIN for a plain Params, else the class of an InstantiableParams
    (or None when it has none yet).
    """
    PLAIN = object()

    def __init__(self, cls: Any) -> None:
        self.cls = cls

    def __repr__(self) -> str:
        if self.cls is self.PLAIN:
            return 'Params()'
        return f'Params(cls={format_value(self.cls)})'


# -- writing ---------------------------------------------------------------------------

def format_path(path: KeyPath) -> str:
    return ''.join(('.' if i else '') + key if kind == '.' else f'[{key!r}]'
                   for i, (kind, key) in enumerate(path))


def format_value(value: Any) -> str:
    """One line that parse_line reads back to an equal value (for supported types)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    for base in (int, float, str):  # the base repr: an IntEnum's would not read back
        if isinstance(value, base):
            return base.__repr__(value)
    if isinstance(value, ParamsPlaceholder):
        return repr(value)
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
    text = repr(value).replace('\n', '\\n')
    return text if len(text) <= limit else text[:limit - 3] + '...'


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

    Nested Params in the value come back as ParamsPlaceholder.
    """
    path, end = parse_path(line)
    sep = _SEP_RE.match(line, end)
    if not path or sep is None or sep.end() == len(line):
        raise TextFormatError('expected "key : value"')
    try:
        tree = ast.parse(line[sep.end():], mode='eval')
    except (SyntaxError, ValueError) as e:
        raise TextFormatError(f'cannot parse the value: {e}') from e
    return path, _interpret(tree.body)


def _untrusted(path: str, module: str) -> TextFormatError:
    top = module.split('.')[0]
    return TextFormatError(
        f'{path!r} names module {module!r}, outside the trusted packages '
        f'{list(trusted_packages())}: reading params imports no other code; move the class '
        f'into a trusted package or call tfpipe.params_text.trust_package({top!r}) first')


def _resolve_dotted(path: str) -> Any:
    """``tf.<dtype>`` or the ``module.QualName`` of a class in a trusted package."""
    parts = path.split('.')
    if parts[0] == 'tf' and len(parts) == 2:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        try:
            return tf.dtypes.as_dtype(parts[1])
        except (TypeError, ValueError) as e:
            raise TextFormatError(f'{path!r} is not a TensorFlow dtype') from e
    for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix
        module_name = '.'.join(parts[:i])
        if not _is_trusted(module_name):  # checked before importing anything
            raise _untrusted(path, module_name)
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            missing = (getattr(e, 'name', None) or '\0') + '.'
            if isinstance(e, ModuleNotFoundError) and (module_name + '.').startswith(missing):
                continue  # this prefix is not a module (or its package is missing)
            raise TextFormatError(f'importing {module_name!r} for {path!r} failed: {e}') from e
        for attr in parts[i:]:
            obj = getattr(obj, attr, ParamsPlaceholder.PLAIN)
            if obj is ParamsPlaceholder.PLAIN:
                raise TextFormatError(f'{path!r}: {module_name!r} has no {attr!r}')
        if not isinstance(obj, type):
            raise TextFormatError(f'{path!r} is not a class; only classes are read by path')
        return obj
    raise TextFormatError(f'{path!r} is not the import path of a class')


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
        raise TextFormatError(f'unknown name {node.id!r}: quote strings and write classes '
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
            raise TextFormatError('dict keys must be str literals')
        return dict(zip(keys, map(_interpret, node.values)))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == 'Params' and not node.args):
        if not node.keywords:
            return ParamsPlaceholder(ParamsPlaceholder.PLAIN)
        if len(node.keywords) == 1 and node.keywords[0].arg == 'cls':
            cls = _interpret(node.keywords[0].value)
            if cls is None or isinstance(cls, type):
                return ParamsPlaceholder(cls)
        raise TextFormatError('expected Params() or Params(cls=module.Class)')
    raise TextFormatError(f'{type(node).__name__} is not allowed: values are literals, '
                          f'module.Class, tf.<dtype> or Params(...)')
