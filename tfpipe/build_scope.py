"""A value that layers read while they are being built, set by whoever builds them.

PipeliningLayer builds each cell's layers inside scopes that tell them where they
live: the tensor-parallel group of the cell (`tensor_parallel.building`) and the
expert group of the replica (`expert_parallel.building`). A layer reads the value in
its constructor, so the layer's params stay free of device details and the same
params build a layer for any T or P. Thread-local, so builds on two threads do not
see each other's groups; nested settings restore the outer one on exit.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Generic, Iterator, TypeVar

T = TypeVar('T')


class BuildScope(Generic[T]):
    """The value set by the innermost `setting`, else `default`."""

    def __init__(self, default: T):
        self._default = default
        self._local = threading.local()

    @contextlib.contextmanager
    def setting(self, value: T) -> Iterator[None]:
        previous = getattr(self._local, 'value', None)
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = previous

    def current(self) -> T:
        return getattr(self._local, 'value', None) or self._default
