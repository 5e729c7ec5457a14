"""Registry of model params classes, keyed by where they live.

A class defined in `params/<task>/<dataset>.py` and decorated with
`@model_registry.RegisterSingleTaskModel` is registered as
`<task>.<dataset>.<ClassName>`: the key says which file to open. Looking a key
up imports only that one module, so a broken or slow params file elsewhere
costs nothing; listing imports them all.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from typing import Type

PARAMS_PACKAGE = 'params'

_registry: dict[str, type] = {}


def _key_of(cls: type) -> str:
    parts = cls.__module__.split('.')
    if len(parts) != 3 or parts[0] != PARAMS_PACKAGE:
        raise ValueError(
            f'{cls.__name__} is defined in module {cls.__module__!r}; registered models must '
            f'live in {PARAMS_PACKAGE}/<task>/<dataset>.py so the key <task>.<dataset>.'
            f'{cls.__name__} names the file')
    return f'{parts[1]}.{parts[2]}.{cls.__name__}'


def _origin(cls: type) -> str:
    """'file.py:line' of a class definition (where a duplicate must be fixed)."""
    try:
        return f'{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}'
    except (OSError, TypeError):
        return f'{cls.__module__}.{cls.__qualname__}'


def RegisterSingleTaskModel(cls: type) -> type:
    """Class decorator: registers a model params class under its file-derived key.

    Two different class objects under one key (a class defined twice in its
    file, or a params module imported twice) are an error naming both places.
    """
    key = _key_of(cls)
    existing = _registry.get(key)
    if existing is not None and existing is not cls:
        raise ValueError(f'model {key} is registered twice: at {_origin(existing)} and at '
                         f'{_origin(cls)}; rename one of the classes')
    _registry[key] = cls
    return cls


def _import_all() -> None:
    package = importlib.import_module(PARAMS_PACKAGE)
    for info in pkgutil.walk_packages(package.__path__, PARAMS_PACKAGE + '.'):
        if info.name.count('.') == 2:
            importlib.import_module(info.name)


def list_models() -> list[str]:
    """Every registered key (imports every params module)."""
    _import_all()
    return sorted(_registry)


def _unknown(key: str, why: str) -> ValueError:
    close = difflib.get_close_matches(key, list_models(), n=3, cutoff=0.5)
    hint = f'did you mean {", ".join(close)}?' if close else 'see --list_models'
    return ValueError(f'unknown model {key!r} ({why}): {hint}')


def get_class(key: str) -> Type:
    """The params class registered as `key`, importing only its module."""
    parts = key.split('.')
    if len(parts) != 3 or not all(parts):
        raise _unknown(key, 'keys look like <task>.<dataset>.<ClassName>')
    module = f'{PARAMS_PACKAGE}.{parts[0]}.{parts[1]}'
    if key not in _registry:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise
            raise _unknown(key, f'there is no {module.replace(".", "/")}.py') from None
    if key not in _registry:
        raise _unknown(key, f'{module.replace(".", "/")}.py registers no class '
                            f'{parts[2]!r}')
    return _registry[key]


def get_params(key: str):
    """The full model Params tree of the model registered as `key`."""
    return get_class(key)().Model()
