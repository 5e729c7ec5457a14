"""Registry of model params classes, keyed by where they live.

A class decorated with `@model_registry.RegisterSingleTaskModel` is registered
under a key that says which module to import to find it:

- in this repository's `params/<task>/<dataset>.py`: `<task>.<dataset>.<ClassName>`;
- in any other importable module, e.g. your own package's `mypkg/lm.py`:
  `mypkg.lm.<ClassName>` (the module path plus the class name).

Looking a key up imports only that one module, so a broken or slow params file
elsewhere costs nothing. Listing imports every module of `params/` and every
module that an installed distribution declares as a `tfpipe.models` entry
point, e.g. in its pyproject.toml::

    [project.entry-points."tfpipe.models"]
    mypkg = "mypkg.lm"
"""
from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import pkgutil
from typing import Type

PARAMS_PACKAGE = 'params'
ENTRY_POINT_GROUP = 'tfpipe.models'

_registry: dict[str, type] = {}


def _key_of(cls: type) -> str:
    if '<locals>' in cls.__qualname__:
        raise ValueError(
            f'{cls.__qualname__} is defined inside a function; a registered model must be a '
            f'module-level class so its key {cls.__module__}.{cls.__name__} can import it')
    parts = cls.__module__.split('.')
    if len(parts) == 3 and parts[0] == PARAMS_PACKAGE:
        return f'{parts[1]}.{parts[2]}.{cls.__qualname__}'
    return f'{cls.__module__}.{cls.__qualname__}'


def _origin(cls: type) -> str:
    """'file.py:line' of a class definition (where a duplicate must be fixed)."""
    try:
        return f'{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}'
    except (OSError, TypeError):
        return f'{cls.__module__}.{cls.__qualname__}'


def RegisterSingleTaskModel(cls: type) -> type:
    """Class decorator: registers a model params class under its module-derived key.

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
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry_point.load()  # importing the module registers its classes


def list_models() -> list[str]:
    """Every registered key (imports every params module and `tfpipe.models` entry point)."""
    _import_all()
    return sorted(_registry)


def _unknown(key: str, why: str) -> ValueError:
    try:
        known = list_models()
    except Exception:  # noqa: BLE001 - a broken installed package must not hide `why`
        known = sorted(_registry)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = f'did you mean {", ".join(close)}?' if close else 'see --list_models'
    return ValueError(f'unknown model {key!r} ({why}): {hint}')


def _is_missing(module: str, error: ModuleNotFoundError) -> bool:
    """Whether `error` says `module` (or a package above it) does not exist.

    A module that exists but fails importing something else is the module's own
    error, to be shown as it is.
    """
    return error.name is not None and (module + '.').startswith(error.name + '.')


def _import_module(module: str) -> bool:
    """Imports `module`; False if it (or a package above it) does not exist."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not _is_missing(module, e):
            raise
        return False
    return True


def get_class(key: str) -> Type:
    """The params class registered as `key`, importing only its module.

    `<task>.<dataset>.<Class>` is looked up in `params/<task>/<dataset>.py`
    first; any other `<module>.<Class>` in that module.
    """
    if key in _registry:
        return _registry[key]
    parts = key.split('.')
    if len(parts) < 2 or not all(parts):
        raise _unknown(key, 'keys look like <task>.<dataset>.<ClassName> for params/ or '
                            '<module>.<ClassName> for your own package')
    module, name = '.'.join(parts[:-1]), parts[-1]
    in_tree = f'{PARAMS_PACKAGE}.{module}'
    if len(parts) == 3 and _import_module(in_tree):
        if key not in _registry:
            raise _unknown(key, f'{in_tree.replace(".", "/")}.py registers no class {name!r}')
        return _registry[key]
    if not _import_module(module):
        tree_file = f' nor {in_tree.replace(".", "/")}.py' if len(parts) == 3 else ''
        raise _unknown(key, f'there is no module {module}{tree_file}; is its package '
                            'installed or on PYTHONPATH?')
    cls = getattr(importlib.import_module(module), name, None)
    if not isinstance(cls, type):
        raise _unknown(key, f'module {module} has no class {name!r}')
    if key not in _registry:
        raise ValueError(f'model {key} is not registered: decorate class {name} in module '
                         f'{module} with @model_registry.RegisterSingleTaskModel')
    return _registry[key]


def get_params(key: str):
    """The full model Params tree of the model registered as `key`."""
    return get_class(key)().Model()
