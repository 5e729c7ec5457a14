"""Models as users write them, for the memory prediction (tests/test_memory_prediction.py).

Registered like a user's own package (docs/own_models_and_data.md): data from an
`examples_fn`, sizes no tfpipe default chose. The trainer imports them as
`--model=tests.memory_models.<Class>` from the repository root.

- `WideConvNet`: a wide plain conv net on its own 32x32 RGB images, shuffled
  whole (the shuffle buffer holds the split).
- `WideMLP`: a user's wide MLP on the same images, trained with Adam, whose
  update (not a backward) sets the peak: 10.5M weights against activations of a
  few MiB.
- `LongDocumentLM`: a byte LM whose training text has one long document among
  short ones (`LONG_DOCUMENT_BYTES`): packing it holds the whole document's
  token pairs at once.
"""
import numpy as np
import tensorflow as tf

import model_registry
from tfpipe import inputs, optimizers
from tfpipe import layers
from tfpipe.base_model_params import SingleTaskModelParams
from tfpipe.bodies import TRANSFORMER_TIES, transformer_lm_body
from tfpipe.pipeline.pipelining_layer import PipeliningLayer
from tfpipe.tasks.classifier import ImageClassifier
from tfpipe.tasks.lm import LanguageModel

IMAGES = {'train': 256, 'dev': 64}
IMAGE_SIZE = 32
NUM_CLASSES = 10
LONG_DOCUMENT_BYTES = 2 * 2 ** 20
SHORT_DOCUMENTS = 64


def images(split: str) -> tf.data.Dataset:
    """Noise images whose label is the brightest of 10 horizontal bands, made by tf.data
    ops: a numpy split would be copied into TensorFlow's allocator or read in place at
    random (docs/memory.md), moving the measured peak by its size from run to run."""
    seed = {'train': 0, 'dev': 1}[split]

    def example(i: tf.Tensor) -> dict:
        label = tf.cast(i % NUM_CLASSES, tf.int32)
        noise = tf.random.stateless_uniform([IMAGE_SIZE, IMAGE_SIZE, 3],
                                            seed=tf.stack([tf.constant(seed, tf.int64), i]))
        band = tf.cast(tf.range(IMAGE_SIZE) // 3 == label, tf.float32)[:, None, None]
        return {'image': noise + band, 'label': label}
    return tf.data.Dataset.range(IMAGES[split]).map(example)


def documents(split: str) -> tf.data.Dataset:
    """Short lines of text and, in the middle of train, one document of
    LONG_DOCUMENT_BYTES (a whole book, a log file)."""
    rng = np.random.default_rng({'train': 0, 'dev': 1}[split])
    words = ['def', 'return', 'self', 'x', 'y', '=', '+', '(', ')', ':', 'if', 'for']
    texts = [' '.join(rng.choice(words, size=40)) for _ in range(SHORT_DOCUMENTS)]
    if split == 'train':
        line = ' '.join(rng.choice(words, size=200)) + '\n'
        texts.insert(SHORT_DOCUMENTS // 2, line * (LONG_DOCUMENT_BYTES // len(line)))
    return tf.data.Dataset.from_tensor_slices({'text': tf.constant(texts, tf.string)})


@model_registry.RegisterSingleTaskModel
class WideConvNet(SingleTaskModelParams):
    """Three 3x3 convolutions of 64-128 channels on 32x32 images, K=2, M=2."""

    def _Input(self, split, training):
        return inputs.DatasetInput.Params().Set(
            examples_fn='tests.memory_models.images', split=split, batch_size=32,
            shuffle_buffer=256 if training else 0, repeat=training)

    def Train(self):
        return self._Input('train', True)

    def Dev(self):
        return self._Input('dev', False)

    def Task(self):
        p = ImageClassifier.Params().Set(num_classes=NUM_CLASSES)
        body = [
            layers.Conv2D.Params().Set(name='conv0', filter_shape=(3, 3, 3, 64),
                                       activation='relu'),
            layers.Conv2D.Params().Set(name='conv1', filter_shape=(3, 3, 64, 128),
                                       activation='relu'),
            layers.Pooling2D.Params().Set(name='pool0'),
            layers.Conv2D.Params().Set(name='conv2', filter_shape=(3, 3, 128, 128),
                                       activation='relu'),
            layers.GlobalAvgPool.Params().Set(name='pool1'),
            layers.Dense.Params().Set(name='logits', input_dim=128, output_dim=NUM_CLASSES),
        ]
        p.pipeline = PipeliningLayer.Params().Set(name='pipe', body=body, balance=[3, 3],
                                                  num_micro_batches=2)
        p.train.Set(max_steps=100, learning_rate=0.003)
        p.train.optimizer = optimizers.Adam.Params()
        return p


@model_registry.RegisterSingleTaskModel
class WideMLP(WideConvNet):
    """3072 -> 2048 -> 2048 -> 10 on the flattened images, batch 64, K=2, M=2, Adam."""

    def _Input(self, split, training):
        return super()._Input(split, training).Set(batch_size=64)

    def Task(self):
        p = super().Task()
        pixels = IMAGE_SIZE * IMAGE_SIZE * 3
        p.pipeline.body = [
            layers.Flatten.Params().Set(name='flatten'),
            layers.Dense.Params().Set(name='fc0', input_dim=pixels, output_dim=2048,
                                      activation='relu'),
            layers.Dense.Params().Set(name='fc1', input_dim=2048, output_dim=2048,
                                      activation='relu'),
            layers.Dense.Params().Set(name='logits', input_dim=2048, output_dim=NUM_CLASSES),
        ]
        p.pipeline.balance = [2, 2]
        return p


@model_registry.RegisterSingleTaskModel
class LongDocumentLM(SingleTaskModelParams):
    """2 causal blocks of width 64 on rows of 128 bytes, K=2, M=2, over `documents`."""

    LENGTH = 128

    def _Input(self, split, training):
        return inputs.DatasetInput.Params().Set(
            examples_fn='tests.memory_models.documents', split=split, preprocess='lm',
            max_length=self.LENGTH, batch_size=16,
            shuffle_buffer=1024 if training else 0, repeat=training)

    def Train(self):
        return self._Input('train', True)

    def Dev(self):
        return self._Input('dev', False)

    def Task(self):
        p = LanguageModel.Params().Set(vocab_size=inputs.BYTE_VOCAB_SIZE)
        p.pipeline = PipeliningLayer.Params().Set(
            name='pipe', body=transformer_lm_body(inputs.BYTE_VOCAB_SIZE, self.LENGTH, 64, 256,
                                                  4, 2),
            balance=[3, 4], num_micro_batches=2, tied_weights=dict(TRANSFORMER_TIES))
        p.train.Set(max_steps=100, learning_rate=0.003)
        p.train.optimizer = optimizers.Adam.Params()
        return p
