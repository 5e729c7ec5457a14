"""``pystdlib``: the running interpreter's standard library source, as LM documents.

Why it exists: a language model needs real text, and every machine that runs
tfpipe has megabytes of it already, the Python standard library's own `.py`
files (31 MB in CPython 3.11), so nothing is downloaded or prepared. Each file
is one document; a file belongs to train, dev or test by a hash of its path
inside the library (90/5/5 %), so the split is the same on every run and a file
never moves between splits when others are added. Within a split the files are
ordered by another hash, which mixes the library's packages in the stream of
documents. The text differs between Python versions; the split rule does not.
"""
from __future__ import annotations

import os
import sysconfig
import zlib
from typing import List

import tensorflow as tf

__all__ = ['SPLITS', 'documents', 'source_files', 'stdlib_dir']

# Percent of files per split, by the hash of the relative path (0..99).
SPLITS = {'train': range(0, 90), 'dev': range(90, 95), 'test': range(95, 100)}
_SKIP_DIRS = ('site-packages', 'dist-packages', '__pycache__')


def stdlib_dir() -> str:
    return sysconfig.get_paths()['stdlib']


def _hash(text: str, salt: str) -> int:
    return zlib.crc32((salt + text).encode())


def source_files(split: str, root: str | None = None) -> List[str]:
    """The `.py` files of `split` under `root` (default: this interpreter's stdlib)."""
    if split not in SPLITS:
        raise ValueError(f'pystdlib has no split {split!r}: use one of {sorted(SPLITS)}')
    root = root or stdlib_dir()
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
        for name in names:
            if name.endswith('.py'):
                rel = os.path.relpath(os.path.join(directory, name), root)
                if _hash(rel, 'split') % 100 in SPLITS[split]:
                    files.append(rel)
    files.sort(key=lambda rel: (_hash(rel, 'order'), rel))
    return [os.path.join(root, rel) for rel in files]


def documents(split: str) -> tf.data.Dataset:
    """{'text': string} per file of the split: an `examples_fn` for DatasetInput."""
    files = source_files(split)
    if not files:
        raise ValueError(f'no .py files found under {stdlib_dir()}: pystdlib needs the Python '
                         'standard library source (install the python3 package with its .py '
                         'files)')
    return tf.data.Dataset.from_tensor_slices(files).map(lambda f: {'text': tf.io.read_file(f)})
