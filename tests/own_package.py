"""A user's package outside the repository, written into a temporary directory.

`byomodels` has what a user brings: a model written from scratch on a
DatasetInput fed by its own `examples_fn`, a model subclassing a built-in one,
a class left unregistered, broken data functions and a module that fails on
import, plus a dist-info declaring a `tfpipe.models` entry point, so that the
directory on PYTHONPATH looks like an installed distribution.
"""
from __future__ import annotations

import os
import pathlib

DATA = '''
"""Two classes of 8x8 grey images: the bright square is in the left or the right half."""
import numpy as np
import tensorflow as tf

SIZES = {'train': 256, 'dev': 64, 'test': 32}


def make(split):
    rng = np.random.default_rng({'train': 0, 'dev': 1, 'test': 2}[split])
    n = SIZES[split]
    labels = rng.integers(0, 2, n)
    images = rng.uniform(0, 0.2, (n, 8, 8, 1)).astype(np.float32)
    for i, label in enumerate(labels):
        row, col = rng.integers(0, 6), rng.integers(0, 2) + 4 * label
        images[i, row:row + 3, col:col + 2] += 0.8
    return tf.data.Dataset.from_tensor_slices({'image': images, 'label': labels})


def make_bad_label(split):
    return make(split).map(lambda ex: {'image': ex['image'], 'label': ex['label'] * 2})


def make_from_generator(split):
    examples = make(split)
    return tf.data.Dataset.from_generator(lambda: examples.as_numpy_iterator(),
                                          output_signature=examples.element_spec)


def make_list(split):
    return [1, 2, 3]


def make_wrong_features(split):
    return make(split).map(lambda ex: {'pixels': ex['image'], 'label': ex['label']})


def make_dynamic(split):
    return make(split).map(lambda ex: {'image': ex['image'][:ex['label'] + 7],
                                       'label': ex['label']})
'''

MODELS = '''
"""Models of a user's own package."""
import model_registry
from params.image.shapes import SmallConvPipe
from tfpipe import inputs, layers, optimizers
from tfpipe.base_model_params import SingleTaskModelParams
from tfpipe.pipeline.pipelining_layer import PipeliningLayer
from tfpipe.tasks.classifier import ImageClassifier


@model_registry.RegisterSingleTaskModel
class TinyNet(SingleTaskModelParams):
    """Written from scratch: conv + dense in K=2 cells, its own data."""

    def _Input(self, split, training):
        return inputs.DatasetInput.Params().Set(
            examples_fn='byomodels.data.make', split=split, batch_size=16,
            shuffle_buffer=256 if training else 0, repeat=training)

    def Train(self):
        return self._Input('train', True)

    def Dev(self):
        return self._Input('dev', False)

    def Test(self):
        return self._Input('test', False)

    def Task(self):
        p = ImageClassifier.Params().Set(num_classes=2)
        body = [layers.Conv2D.Params().Set(name='conv', filter_shape=(3, 3, 1, 8),
                                           activation='relu'),
                layers.Pooling2D.Params().Set(name='pool', window_shape=(4, 4),
                                              window_stride=(4, 4)),
                layers.Flatten.Params().Set(name='flat'),
                layers.Dense.Params().Set(name='logits', input_dim=32, output_dim=2)]
        p.pipeline = PipeliningLayer.Params().Set(name='pipe', body=body, balance=[2, 2],
                                                  num_micro_batches=2, recompute='always')
        p.train.Set(max_steps=60, learning_rate=0.01, save_interval_steps=30)
        p.train.optimizer = optimizers.Adam.Params()
        p.eval.Set(samples_per_summary=64, decoder_samples_per_summary=32)
        return p


@model_registry.RegisterSingleTaskModel
class WiderShapes(SmallConvPipe):
    """Subclassing a built-in model: the same task on tfpipe_shapes, more steps."""

    def Task(self):
        p = super().Task()
        p.train.max_steps = 400
        return p


class Unregistered(TinyNet):
    """Not decorated, so the trainer refuses it."""
'''

BROKEN = '''
raise RuntimeError('byomodels.broken fails on import on purpose')
'''


def write(root: pathlib.Path) -> str:
    """Writes the package under `root`; returns the directory to put on PYTHONPATH."""
    package = root / 'byomodels'
    package.mkdir(parents=True)
    (package / '__init__.py').write_text('')
    (package / 'data.py').write_text(DATA)
    (package / 'models.py').write_text(MODELS)
    (package / 'broken.py').write_text(BROKEN)
    info = root / 'byomodels-0.1.dist-info'
    info.mkdir()
    (info / 'METADATA').write_text('Metadata-Version: 2.1\nName: byomodels\nVersion: 0.1\n')
    (info / 'entry_points.txt').write_text('[tfpipe.models]\nbyomodels = byomodels.models\n')
    return str(root)


def env_with(path: str, base: dict) -> dict:
    env = dict(base)
    env['PYTHONPATH'] = path + os.pathsep + env['PYTHONPATH']
    return env
