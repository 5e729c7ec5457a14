"""Real tfds datasets (cifar10, wmt14) in tests, where nothing may be downloaded.

`tfds.testing.mock_data` serves fake examples but leaves `is_prepared()` False,
so TfdsInput would rightly refuse the dataset as not prepared. The tests, not
the library, arrange that the mocked dataset also counts as prepared.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

import tensorflow_datasets as tfds


@contextlib.contextmanager
def prepared_mock_data(**mock_data_kwargs: Any) -> Iterator[None]:
    """`tfds.testing.mock_data(**kwargs)` with every builder reporting prepared data."""
    with tfds.testing.mock_data(**mock_data_kwargs), \
            mock.patch.object(tfds.core.DatasetBuilder, 'is_prepared', return_value=True):
        yield
