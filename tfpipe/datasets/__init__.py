"""Data sets shipped with tfpipe: generated locally, deterministically, offline.

Importing this package registers the builders with tfds (``tfpipe_shapes``,
``tfpipe_reverse``), so ``tfds.builder('tfpipe_shapes', data_dir=...)`` finds
them. :func:`prepare` builds one into a data_dir if it is not there yet; it is
the only place tfpipe generates data, and it never touches the network.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Type

import tensorflow_datasets as tfds

from tfpipe.datasets import reverse, shapes
from tfpipe.datasets.reverse import ReverseBuilder
from tfpipe.datasets.shapes import ShapesBuilder

__all__ = ['BUILDERS', 'ReverseBuilder', 'ShapesBuilder', 'is_tfpipe_dataset', 'prepare',
           'reverse', 'shapes']

BUILDERS: Dict[str, Type[tfds.core.GeneratorBasedBuilder]] = {
    ShapesBuilder.name: ShapesBuilder,
    ReverseBuilder.name: ReverseBuilder,
}


def is_tfpipe_dataset(name: str) -> bool:
    """Whether ``name`` (optionally ``name/config`` or ``name:version``) is ours."""
    return name.split('/')[0].split(':')[0] in BUILDERS


def prepare(name: str, data_dir: Optional[str] = None) -> tfds.core.DatasetBuilder:
    """Returns the builder of tfpipe data set ``name``, generating it if needed.

    ``data_dir`` None means the tfds default (``~/tensorflow_datasets`` or
    ``$TFDS_DATA_DIR``). Generation is skipped when the data is already there,
    so this is cheap to call on every run. The download config turns off the
    GCS lookup tfds would otherwise try first: on an offline machine that lookup
    hangs or fails, and there is nothing to fetch anyway.
    """
    base = name.split('/')[0].split(':')[0]
    if base not in BUILDERS:
        raise ValueError(f'{name!r} is not a tfpipe data set; known: {sorted(BUILDERS)}')
    if data_dir is not None:
        data_dir = os.fspath(data_dir)
    builder = BUILDERS[base](data_dir=data_dir)
    if not builder.is_prepared():
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
            try_download_gcs=False,
            compute_stats=tfds.download.ComputeStatsMode.SKIP))
    return builder
