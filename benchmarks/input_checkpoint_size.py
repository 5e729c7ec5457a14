"""Input checkpoint size of the cifar10 and wmt14 configs, and the cost of a resume.

    python benchmarks/input_checkpoint_size.py [--quick]

The real datasets are not on this machine, so tfds is mocked with generated
examples of the real features and sizes: CIFAR-10 images (uint8 32x32x3, label,
id) and WMT'14 sentence pairs (en/de strings of 20..260 bytes, mean 140, close
to the corpus' ~140 characters per sentence). The inputs are exactly those of
params/image/cifar10.py and params/mt/wmt14_ende.py (shuffle buffers 10000 and
100000). Rows:

- `tf.data iterator`: a checkpoint of the tf.data iterator of `Dataset()`, which
  is what the trainer saved before (the shuffle buffer is in it);
- `Iterator()`: the trainer's input checkpoint now (epoch and index);
- resume: seconds from restoring `Iterator()` at the end of an epoch to its
  first batch (it reads through the epoch up to its position once).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from unittest import mock

import tensorflow as tf
import tensorflow_datasets as tfds

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_registry  # noqa: E402  pylint: disable=wrong-import-position


def cifar10_examples(n: int) -> tf.data.Dataset:
    def example(i):
        image = tf.random.stateless_uniform([32, 32, 3], seed=[i, 0], maxval=256, dtype=tf.int32)
        return {'id': tf.strings.format('train_{}', i), 'image': tf.cast(image, tf.uint8),
                'label': i % 10}
    return tf.data.Dataset.range(n).map(example)


def wmt14_examples(n: int) -> tf.data.Dataset:
    text = tf.constant(' '.join(['lorem ipsum dolor sit amet'] * 12))

    def sentence(i, salt):
        length = tf.random.stateless_uniform([], seed=[i, salt], minval=20, maxval=261,
                                             dtype=tf.int32)
        return tf.strings.substr(text, 0, length)
    return tf.data.Dataset.range(n).map(lambda i: {'en': sentence(i, 1), 'de': sentence(i, 2)})


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def measure(model: str, examples_fn, epoch_size: int, batches: int) -> None:
    params = model_registry.get_params(model).input.train.Copy().Set(data_dir='/nonexistent')

    def as_dataset(self, split, **kwargs):
        del self, split, kwargs
        return examples_fn(epoch_size)

    with tfds.testing.mock_data(as_dataset_fn=as_dataset), \
            mock.patch.object(tfds.core.DatasetBuilder, 'is_prepared', return_value=True):
        tfds_input = params.Instantiate()
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            iterator = iter(tfds_input.Dataset())
            for _ in range(batches):
                next(iterator)
            tf.train.Checkpoint(iterator=iterator).save(os.path.join(tmp, 'data', 'ckpt'))
            rows.append(('tf.data iterator', directory_bytes(os.path.join(tmp, 'data'))))
            if hasattr(tfds_input, 'Iterator'):
                position = tfds_input.Iterator()
                for _ in range(batches):
                    next(position)
                tf.train.Checkpoint(iterator=position).save(os.path.join(tmp, 'pos', 'ckpt'))
                rows.append(('Iterator()', directory_bytes(os.path.join(tmp, 'pos'))))
                resumed = tfds_input.Iterator()
                resumed.epoch.assign(0)
                resumed.index.assign(epoch_size - params.batch_size)
                start = time.perf_counter()
                next(resumed)
                rows.append((f'resume at example {epoch_size - params.batch_size} of the epoch '
                             '(seconds)', round(time.perf_counter() - start, 2)))
    print(f'{model}: shuffle_buffer {params.shuffle_buffer}, batch {params.batch_size}, '
          f'{batches} batches read')
    for name, value in rows:
        print(f'  {name}: {value:,}' + (' bytes' if isinstance(value, int) else ''))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--quick', action='store_true', help='smaller epochs for the resume row')
    args = parser.parse_args()
    measure('image.cifar10.AmoebaNetD', cifar10_examples, 50000, 10)
    measure('mt.wmt14_ende.TransformerPipe', wmt14_examples,
            200000 if args.quick else 1000000, 10)


if __name__ == '__main__':
    main()
