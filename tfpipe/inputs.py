"""Params-configured input generators over tensorflow-datasets.

`TfdsInput.Params().Set(dataset=..., split=..., batch_size=...).Instantiate()
.Dataset()` gives batches with static shapes (the pipeline unrolls its
micro-batches at trace time), as dicts in one of the layouts the tasks read.

Nothing here downloads. tfpipe's own datasets (`tfpipe_shapes`,
`tfpipe_reverse`) are generated into `data_dir` on first use; any other
dataset must already be prepared in `data_dir`, or the error says how to
prepare it. The iterator of `Dataset()` can be saved in a tf.train.Checkpoint,
so a resumed run continues with the next unseen batch.
"""
from __future__ import annotations

import os
from typing import Callable

import tensorflow as tf
import tensorflow_datasets as tfds

from tfpipe import datasets
from tfpipe.datasets.reverse import EOS_ID, PAD_ID
from tfpipe.hyperparams import InstantiableParams, Params

BYTE_OFFSET = 2  # byte b becomes id b + 2, so PAD (0) and EOS (1) stay free
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET


def _pad_to(ids: tf.Tensor, length: int) -> tf.Tensor:
    """Truncates or right-pads with PAD_ID to exactly `length` (static)."""
    ids = ids[:length]
    ids = tf.pad(ids, [[0, length - tf.shape(ids)[0]]], constant_values=PAD_ID)
    return tf.ensure_shape(ids, [length])


def _with_eos(ids: tf.Tensor, length: int) -> tf.Tensor:
    """ids[:length-1] + [EOS], padded: the target always ends with EOS."""
    return _pad_to(tf.concat([ids[:length - 1], [EOS_ID]], 0), length)


def byte_tokenize(text: tf.Tensor) -> tf.Tensor:
    """UTF-8 bytes of a string scalar as int32 ids in [2, 258)."""
    return tf.cast(tf.io.decode_raw(text, tf.uint8), tf.int32) + BYTE_OFFSET


def _image_classification(p: Params) -> Callable[[dict], dict]:
    def fn(ex):
        return {'image': tf.cast(ex['image'], tf.float32) / 255.0,
                'label': tf.cast(ex['label'], tf.int32)}
    return fn


def _seq2seq(p: Params) -> Callable[[dict], dict]:
    def fn(ex):
        tgt = tf.cast(ex['tgt'], tf.int32)
        if tgt.shape.rank == 1 and p.max_length:
            # tfpipe_reverse targets already end with EOS; keep them intact.
            tgt = _pad_to(tgt, p.max_length)
        return {'src': _pad_to(tf.cast(ex['src'], tf.int32), p.max_length), 'tgt': tgt}
    return fn


def _seq2seq_text(p: Params) -> Callable[[dict], dict]:
    def fn(ex):
        return {'src': _pad_to(byte_tokenize(ex[p.source_key]), p.max_length),
                'tgt': _with_eos(byte_tokenize(ex[p.target_key]), p.max_length)}
    return fn


PREPROCESSORS: dict[str, Callable[[Params], Callable[[dict], dict]]] = {
    'image_classification': _image_classification,
    'seq2seq': _seq2seq,
    'seq2seq_text': _seq2seq_text,
}


class TfdsInput:
    """Batches of a tfds dataset split, preprocessed into a task's layout."""

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.Define('name', 'input', 'Name of this input.')
        p.Define('dataset', '', "tfds name, e.g. 'tfpipe_shapes', 'cifar10', "
                 "'wmt14_translate/de-en'.")
        p.Define('split', 'train', 'tfds split, e.g. train, validation, test, train[:90%].')
        p.Define('batch_size', 32, 'Examples per batch (the last partial batch is dropped).')
        p.Define('data_dir', None, 'tfds data dir; None: the tfds default.')
        p.Define('shuffle_buffer', 0, 'Shuffle buffer size; 0: keep the stored order.')
        p.Define('repeat', False, 'Repeat forever (training).')
        p.Define('seed', 1234, 'Seed of the shuffle.')
        p.Define('max_length', 0, 'Static length of token sequences (pad or truncate).')
        p.Define('preprocess', 'image_classification', f'One of {sorted(PREPROCESSORS)}.')
        p.Define('source_key', 'en', "seq2seq_text: feature holding the source string.")
        p.Define('target_key', 'de', "seq2seq_text: feature holding the target string.")
        p.Define('generate_if_missing', True, "Generate tfpipe's own datasets into data_dir "
                 'when absent.')
        return p

    def __init__(self, params: Params):
        self.params = params
        if not params.dataset:
            raise ValueError('input has no dataset: set input.<split>.dataset to a tfds name')
        if params.preprocess not in PREPROCESSORS:
            raise ValueError(f'unknown preprocess {params.preprocess!r}: use one of '
                             f'{sorted(PREPROCESSORS)}')
        if params.batch_size < 1:
            raise ValueError(f'batch_size={params.batch_size} must be >= 1')
        if params.preprocess.startswith('seq2seq') and params.max_length < 1:
            raise ValueError(f'{params.preprocess} needs max_length >= 1 for static shapes')
        self._builder = self._Builder()

    def _Builder(self) -> tfds.core.DatasetBuilder:
        p = self.params
        if datasets.is_tfpipe_dataset(p.dataset) and p.generate_if_missing:
            return datasets.prepare(p.dataset, p.data_dir)
        data_dir = p.data_dir or os.path.expanduser('~/tensorflow_datasets')
        try:
            builder = tfds.builder(p.dataset, data_dir=data_dir)
            # Reading (not is_prepared()) is the test: it honours tfds.testing.mock_data.
            builder.as_dataset(split=p.split)
        except Exception as e:  # noqa: BLE001 - any failure here means: not usable from here
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f'dataset {p.dataset} split {p.split!r} is not in {data_dir} ({reason[:160]}); '
                f'tfpipe never downloads: run `tfds build {p.dataset.split("/")[0]} '
                '--data_dir=DIR` on a machine with internet access and copy DIR here, or '
                'point --tfds_data_dir at an existing copy') from None
        return builder

    def Dataset(self) -> tf.data.Dataset:
        p = self.params
        read_config = tfds.ReadConfig(shuffle_seed=p.seed)
        ds = self._builder.as_dataset(split=p.split, shuffle_files=p.shuffle_buffer > 0,
                                      read_config=read_config)
        if p.repeat:
            ds = ds.repeat()
        if p.shuffle_buffer > 0:
            ds = ds.shuffle(p.shuffle_buffer, seed=p.seed, reshuffle_each_iteration=True)
        ds = ds.map(PREPROCESSORS[p.preprocess](p), num_parallel_calls=tf.data.AUTOTUNE,
                    deterministic=True)
        return ds.batch(p.batch_size, drop_remainder=True).prefetch(2)
