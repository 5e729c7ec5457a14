"""Params-configured input generators over tensorflow-datasets.

`TfdsInput.Params().Set(dataset=..., split=..., batch_size=...).Instantiate()`
gives batches with static shapes (the pipeline unrolls its micro-batches at
trace time, so every batch must look the same: a fixed batch size, text padded
to `max_length`), as dicts in one of the layouts the tasks read:

- `Dataset()` / `Iterator()` for training: the last partial batch of a split is
  dropped. The order is a function of `seed` alone; `Iterator()` is saved in a
  tf.train.Checkpoint as its position (epoch, index), so a resumed run continues
  with the next unseen batch without the shuffle buffer in every checkpoint.
- `EvalDataset(n)` for evaluation and decoding: each of the first n examples
  exactly once, the last batch padded and marked by a 'weight' of 0.

Nothing here downloads. tfpipe's own datasets (`tfpipe_shapes`,
`tfpipe_reverse`) are generated into `data_dir` on first use; any other
dataset must already be prepared in `data_dir`, or `MissingDataError` says how
to prepare it.

Your own data: `DatasetInput.Params().Set(examples_fn='mypkg.data.make', ...)`
calls `mypkg.data.make(split)` for a `tf.data.Dataset` of single examples and
then shuffles, repeats, batches and checkpoints it exactly as a tfds split.

Language models: `preprocess='lm'` reads documents `{'text': string}` of any
length and packs them into rows of `max_length` tokens (tfpipe.lm_inputs).

Token ids (shared with `tfpipe.datasets.reverse`): PAD_ID = 0 pads, EOS_ID = 1
ends every target, sources carry no EOS. The byte tokeniser of
'seq2seq_text' maps UTF-8 byte b to b + BYTE_OFFSET (vocabulary 258), so real
translation data needs no vocabulary file. The tokenizers live in tfpipe/tokenizers.py;
their names stay importable from here (`__all__`).
"""
from __future__ import annotations

import difflib
import functools
from typing import Callable, Dict, Optional

import tensorflow as tf
import tensorflow_datasets as tfds

from tfpipe import datasets, input_iterator, lm_inputs
from tfpipe.tokenizers import (BYTE_OFFSET, BYTE_VOCAB_SIZE, byte_detokenize, byte_tokenize,
                               detokenizer, import_function, tokenizer)
from tfpipe.input_iterator import Example, InputIterator
from tfpipe.datasets.reverse import EOS_ID, PAD_ID
from tfpipe.hyperparams import InstantiableParams, Params

__all__ = ['BYTE_OFFSET', 'BYTE_VOCAB_SIZE', 'EOS_ID', 'PAD_ID', 'PREPROCESSORS',
           'DatasetInput', 'InputIterator', 'MissingDataError', 'TfdsInput', 'byte_detokenize',
           'byte_tokenize', 'detokenizer', 'register_preprocessor', 'tokenizer']

# A preprocessor is built from the input's params and maps one stored example
# to the layout a task reads; it runs inside tf.data, so it must be graph code.
PreprocessorFactory = Callable[[Params], Callable[[Example], Example]]
PREPROCESSORS: Dict[str, PreprocessorFactory] = {}
# A preprocessor that changes how many examples there are (documents -> packed rows)
# also regroups the stored stream, before the shuffle: an input position then counts
# its output, and a resumed run regroups the same way up to it.
StreamRegrouper = Callable[[Params, tf.data.Dataset], tf.data.Dataset]
STREAM_REGROUPERS: Dict[str, StreamRegrouper] = {
    'lm': lambda p, documents: lm_inputs.pack_documents(documents, p.max_length, tokenizer(p)),
}
_NEEDS_MAX_LENGTH = ('seq2seq', 'seq2seq_text', 'lm')
# tf.data converts every map function with AutoGraph. tfpipe's own are plain graph code,
# and converting them re-parses their source (with the eval jobs' functions, ~0.4 CPU s of
# each trainer's start): they skip it, as `_Preprocess` does for the built-in preprocessors.
_as_is = tf.autograph.experimental.do_not_convert


class MissingDataError(ValueError):
    """A dataset is not prepared where we looked, and tfpipe will not download it.

    A ValueError, so the trainer reports it as bad input in one line.
    """


def register_preprocessor(name: str) -> Callable[[PreprocessorFactory], PreprocessorFactory]:
    """Decorator: makes a preprocessor factory usable as `p.preprocess = name`."""
    def _register(factory: PreprocessorFactory) -> PreprocessorFactory:
        if name in PREPROCESSORS:
            raise ValueError(f'preprocessor {name!r} is already registered')
        PREPROCESSORS[name] = factory
        return factory
    return _register


def _pad_to(ids: tf.Tensor, length: int) -> tf.Tensor:
    """Truncates or right-pads with PAD_ID to exactly `length` (static)."""
    ids = ids[:length]
    ids = tf.pad(ids, [[0, length - tf.shape(ids)[0]]], constant_values=PAD_ID)
    return tf.ensure_shape(ids, [length])


def _with_eos(ids: tf.Tensor, length: int) -> tf.Tensor:
    """ids[:length-1] + [EOS], padded: a target ends with EOS even when truncated."""
    return _pad_to(tf.concat([ids[:length - 1], [EOS_ID]], 0), length)


def _strip_final_eos(ids: tf.Tensor) -> tf.Tensor:
    """ids without a trailing EOS, so `_with_eos` never doubles it."""
    n = tf.shape(ids)[0]
    ends_with_eos = tf.logical_and(n > 0, tf.equal(ids[tf.maximum(n - 1, 0)], EOS_ID))
    return ids[:n - tf.cast(ends_with_eos, tf.int32)]


def _feature(ex: Example, key: str, p: Params) -> tf.Tensor:
    if key not in ex:
        raise ValueError(f'{p.name}: preprocess {p.preprocess!r} reads feature {key!r}, but '
                       f'{p.dataset} has {sorted(ex)}; set source_key/target_key')
    return ex[key]


@register_preprocessor('image_classification')
def _image_classification(p: Params) -> Callable[[Example], Example]:
    """{'image': float32 [H, W, C] in [0, 1], 'label': int32 []}; other features dropped."""
    def fn(ex: Example) -> Example:
        image = _feature(ex, 'image', p)
        scale = 1.0 / 255.0 if image.dtype == tf.uint8 else 1.0
        return {'image': tf.cast(image, tf.float32) * scale,
                'label': tf.cast(_feature(ex, 'label', p), tf.int32)}
    return fn


@register_preprocessor('seq2seq')
def _seq2seq(p: Params) -> Callable[[Example], Example]:
    """Integer sequences to {'src', 'tgt'} int32 [max_length]; tgt ends with one EOS.

    Reads the features 'src' and 'tgt' (tfpipe_reverse). A target that is stored
    with its EOS keeps exactly one, also when truncated.
    """
    def fn(ex: Example) -> Example:
        src = tf.cast(_feature(ex, 'src', p), tf.int32)
        tgt = _strip_final_eos(tf.cast(_feature(ex, 'tgt', p), tf.int32))
        return {'src': _pad_to(src, p.max_length), 'tgt': _with_eos(tgt, p.max_length)}
    return fn


@register_preprocessor('seq2seq_text')
def _seq2seq_text(p: Params) -> Callable[[Example], Example]:
    """String pairs (p.source_key, p.target_key) byte-tokenised into the 'seq2seq' form."""
    def fn(ex: Example) -> Example:
        src = byte_tokenize(_feature(ex, p.source_key, p))
        tgt = byte_tokenize(_feature(ex, p.target_key, p))
        return {'src': _pad_to(src, p.max_length), 'tgt': _with_eos(tgt, p.max_length)}
    return fn


@register_preprocessor('lm')
def _lm(p: Params) -> Callable[[Example], Example]:
    """A packed row -> {'inputs', 'targets', 'segment_ids', 'positions'} int32 [max_length]."""
    del p  # the rows are cut to max_length by STREAM_REGROUPERS['lm']
    return lambda ex: lm_inputs.row_features(ex['row'])


def _regroup(p: Params, stored: tf.data.Dataset) -> tf.data.Dataset:
    regroup = STREAM_REGROUPERS.get(p.preprocess)
    return stored if regroup is None else regroup(p, stored)


class TfdsInput:
    """Batches of a tfds dataset split, preprocessed into a task's layout."""

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.Define('name', 'input', 'Name of this input.')
        p.Define('dataset', '', "tfds name, e.g. 'tfpipe_shapes', 'cifar10', "
                 "'wmt14_translate/de-en'.")
        p.Define('split', 'train', 'tfds split, e.g. train, validation, test, train[:90%].')
        p.Define('batch_size', 32, 'Examples per batch (training drops the last partial batch; '
                 'EvalDataset pads it).')
        p.Define('data_dir', None, 'tfds data dir; None: the tfds default.')
        p.Define('shuffle_buffer', 0, 'Shuffle buffer size, reseeded every epoch; 0: keep the '
                 'stored order. Not in Iterator() checkpoints.')
        p.Define('repeat', False, 'Repeat forever (training).')
        p.Define('seed', 1234, 'Seed of the file order and of each epoch\'s example shuffle: '
                 'same seed, same order.')
        p.Define('max_length', 0, "Static length of token sequences (pad or truncate; 'lm': "
                 'the length of a packed row).')
        p.Define('preprocess', 'image_classification', f'One of {sorted(PREPROCESSORS)}.')
        p.Define('source_key', 'en', "seq2seq_text: feature holding the source string.")
        p.Define('target_key', 'de', "seq2seq_text: feature holding the target string.")
        p.Define('tokenizer', '', "'lm': dotted name of `def tokenize(text) -> int32 ids` "
                 '(graph code; ids >= 2, as 0 pads and 1 ends documents); empty: UTF-8 bytes.')
        p.Define('detokenizer', '', "'lm': dotted name of `def detokenize(ids) -> str`, the "
                 "tokenizer's inverse, for the text of generated ids; empty: UTF-8 bytes.")
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
        if params.shuffle_buffer < 0:
            raise ValueError(f'shuffle_buffer={params.shuffle_buffer} must be >= 0')
        if params.preprocess in _NEEDS_MAX_LENGTH and params.max_length < 1:
            raise ValueError(f'{params.preprocess} needs max_length >= 1 for static shapes')
        # Fail at construction, before a trainer writes anything, if the data is absent.
        self._builder = self._Builder()

    def _Builder(self) -> tfds.core.DatasetBuilder:
        p = self.params
        ours = datasets.is_tfpipe_dataset(p.dataset)
        if ours and p.generate_if_missing:
            return datasets.prepare(p.dataset, p.data_dir)
        try:  # reads metadata (from code or data_dir) only; it never downloads
            builder = tfds.builder(p.dataset, data_dir=p.data_dir)
        except tfds.core.registered.DatasetNotFoundError:
            # tfds' own message lists every dataset it knows, hundreds of lines.
            base = p.dataset.split('/')[0].split(':')[0]
            known = tfds.list_builders(with_community_datasets=False)
            close = difflib.get_close_matches(base, known, n=3)
            raise ValueError(f'unknown dataset {p.dataset!r}: tfds has no builder of that '
                             f'name and nothing is prepared under it in '
                             f'{p.data_dir or "the tfds data_dir"}; close names: '
                             f'{close}') from None
        if builder.is_prepared():
            return builder
        root = str(builder.data_dir_root)
        if ours:
            how = (f'set generate_if_missing=True or call tfpipe.datasets.prepare('
                   f'{p.dataset!r}, {root!r})')
        else:
            how = (f'run `tfds build {p.dataset} --data_dir=DIR` on a machine with internet '
                   'access and copy DIR here, or point --tfds_data_dir at an existing copy')
        raise MissingDataError(f'dataset {p.dataset} split {p.split!r} is not in {root} '
                               f'(no prepared data at {builder.data_dir}); tfpipe never '
                               f'downloads: {how}')

    def Dataset(self) -> tf.data.Dataset:
        """Batches of dict examples with fully static shapes, in an order fixed by seed.

        The last partial batch of a non-repeating input is dropped (training); use
        EvalDataset to see every example. Its tf.data iterator checkpoints hold the
        shuffle buffer; `Iterator()` checkpoints only the position.
        """
        return self._Batches(0, 0).map(_as_is(lambda batch, epoch, index: batch)).prefetch(2)

    def Iterator(self, share: Optional[range] = None) -> InputIterator:
        """An iterator over Dataset()'s batches whose checkpoint is its position only.

        `share`: yield only examples [share.start, share.stop) of each batch (a
        trainer client's micro-batches, `replicas.examples_of_group`); the others
        are skipped before they are decoded or preprocessed. The position still
        counts whole batches, so it restores into an iterator of any share.
        """
        p = self.params
        if share is not None and not (0 <= share.start < share.stop <= p.batch_size
                                      and share.step == 1):
            raise ValueError(f'{p.name}: share {share} is not a run of examples within a batch '
                             f'of {p.batch_size}')
        return InputIterator(functools.partial(self._Batches, share=share))

    def EvalDataset(self, num_examples: int) -> tf.data.Dataset:
        """Every one of the first `num_examples` examples (all, if the split is smaller).

        Batches keep the static batch_size: the last partial batch is padded with
        zero examples, and a 'weight' feature (float32 [batch_size]) is 1 for real
        examples and 0 for padding, so metrics and decoders can ignore the padding.
        """
        p = self.params
        if num_examples < 1:
            raise ValueError(f'{p.name}: num_examples={num_examples} must be >= 1')
        ds = self._Epochs(0).take(num_examples).map(_as_is(lambda ex, epoch, index: ex))
        ds = ds.map(self._Preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        ds = ds.map(_as_is(lambda ex: {**ex, 'weight': tf.ones([], tf.float32)}))
        ds = ds.batch(p.batch_size).map(_as_is(functools.partial(_pad_batch, size=p.batch_size)))
        self._CheckStatic(ds.element_spec)
        return ds.prefetch(2)

    @tf.autograph.experimental.do_not_convert
    def _Preprocess(self, ex: Example) -> Example:
        """The preprocessor on the decoded example, inside tf.data's map.

        Not converted by AutoGraph: tfpipe's decoding and built-in preprocessors are
        plain graph code (no Python branch on a tensor), and rewriting them took ~0.5 s
        of every trainer's start-up (evalers' and clients' included). A preprocessor
        registered outside tfpipe is converted, as tf.data's map would convert it."""
        factory = PREPROCESSORS[self.params.preprocess]
        fn = factory(self.params)
        if factory.__module__ != __name__:
            fn = tf.autograph.to_graph(fn)
        return fn(self._Decode(ex))

    def _DeferredDecoders(self) -> Optional[dict]:
        """tfds decoders that leave images encoded until `_Decode`.

        The seeded shuffle sees every stored example (the order depends on all of
        them, not on their values), but a trainer client decodes only its share:
        its image features travel through the shuffle buffer as their stored
        (PNG/JPEG) bytes. Only for a share: tiny images (tfpipe_shapes' 16x16) are
        larger as PNG than decoded, and a whole batch decodes everything anyway.
        """
        features = getattr(getattr(self._builder, 'info', None), 'features', None)
        if not isinstance(features, tfds.features.FeaturesDict):
            return None  # your own examples (DatasetInput): nothing is encoded
        skipped = {key: tfds.decode.SkipDecoding() for key, feature in features.items()
                   if isinstance(feature, tfds.features.Image)}
        return skipped or None

    def _Decode(self, ex: Example) -> Example:
        """Decodes the features `_DeferredDecoders` left encoded (strings); others pass."""
        skipped = self._DeferredDecoders() or {}
        return {key: (self._builder.info.features[key].decode_example(value)
                      if key in skipped and value.dtype == tf.string else value)
                for key, value in ex.items()}

    def _Epochs(self, start_epoch: int, decode_later: bool = False) -> tf.data.Dataset:
        """(example, epoch, index in epoch) from the start of `start_epoch` on.

        Epoch e is the stored split (files in one seeded order, the same every
        epoch) through a shuffle buffer seeded by (seed, e): any epoch's order is
        a function of the seed alone, so a position (epoch, index) is all a
        checkpoint needs to continue the same sequence. `decode_later`: images stay
        encoded (`_DeferredDecoders`) and `_Preprocess` decodes them.
        """
        p = self.params
        shuffle = p.shuffle_buffer > 0
        # No autocache: tfds would cache small datasets (cifar10 included) in memory,
        # and a tf.data cache is written into tf.data iterator checkpoints.
        read_config = tfds.ReadConfig(shuffle_seed=p.seed, try_autocache=False,
                                      shuffle_reshuffle_each_iteration=False)
        stored = _regroup(p, self._builder.as_dataset(split=p.split, shuffle_files=shuffle,
                                                      read_config=read_config,
                                                      decoders=self._DeferredDecoders()
                                                      if decode_later else None))

        @tf.autograph.experimental.do_not_convert  # plain graph code: see _Preprocess
        def epoch_examples(epoch: tf.Tensor) -> tf.data.Dataset:
            # This function's graph would inherit the user's global seed, which would
            # then enter the shuffle's seed pair: the order would depend on it, and a
            # global seed of 0 makes TensorFlow compare the tensor seed with 0 in Python
            # (an error). Cleared here, in this graph only: the order is the params'.
            tf.random.set_seed(None)
            ds = stored
            if shuffle:
                ds = ds.shuffle(p.shuffle_buffer, seed=_epoch_seed(p.seed, epoch),
                                reshuffle_each_iteration=False)
            return ds.enumerate().map(_as_is(lambda index, ex: (ex, epoch, index)))

        end = _NO_END if p.repeat else 1
        ds = tf.data.Dataset.range(start_epoch, end).flat_map(epoch_examples)
        # A shuffle built inside flat_map owns a seed-generator resource that tf.data
        # calls external state and refuses to save. Its seeds are fixed per epoch
        # (no reshuffling), so it has no state to lose: tf.data iterator
        # checkpoints of Dataset() may ignore it and still restore exactly.
        options = tf.data.Options()
        options.experimental_external_state_policy = \
            tf.data.experimental.ExternalStatePolicy.IGNORE
        return ds.with_options(options)

    def _Batches(self, start_epoch: int, start_index: int,
                 share: Optional[range] = None) -> tf.data.Dataset:
        """(batch, epoch, index): the batches from a position on, each with the position
        (epoch, index of the next example) after it.

        With `share` a batch holds only those examples of each whole batch: the
        whole batch is cut from the shuffled stream (still encoded), its share
        kept and only that decoded and preprocessed.
        """
        p = self.params
        partial = share is not None and len(share) < p.batch_size
        ds = self._Epochs(start_epoch, decode_later=partial).skip(start_index)
        if partial:
            ds = ds.window(p.batch_size, drop_remainder=True).flat_map(
                _as_is(functools.partial(input_iterator.share_of_window, share=share,
                                         size=p.batch_size)))
        size = p.batch_size if share is None else len(share)
        ds = ds.map(_as_is(lambda ex, epoch, index: (self._Preprocess(ex), epoch, index)),
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        ds = ds.batch(size, drop_remainder=True)
        self._CheckStatic(ds.element_spec[0])
        return ds.map(_as_is(lambda batch, epochs, indices: (batch, epochs[-1], indices[-1] + 1)))

    def _CheckStatic(self, spec: Dict[str, tf.TensorSpec]) -> None:
        p = self.params
        for key, feature in spec.items():
            if not feature.shape.is_fully_defined():
                raise ValueError(f'{p.name}: feature {key!r} of {p.dataset} has shape '
                                 f'{feature.shape} after preprocess {p.preprocess!r}; the '
                                 'pipeline needs static shapes')


_NO_END = 2 ** 62  # the last epoch of a repeating input: never reached


def _epoch_seed(seed: int, epoch: tf.Tensor) -> tf.Tensor:
    """The shuffle seed of one epoch: a stateless hash of (seed, epoch)."""
    return tf.random.stateless_uniform([], seed=tf.stack([tf.constant(seed, tf.int64), epoch]),
                                       minval=0, maxval=2 ** 31 - 1, dtype=tf.int64)


def _pad_batch(batch: Example, size: int) -> Example:
    """Pads a (last, partial) batch with zero examples to the static `size`."""
    n = tf.shape(batch['weight'])[0]
    out = {}
    for key, value in batch.items():
        padding = [[0, size - n]] + [[0, 0]] * (value.shape.rank - 1)
        out[key] = tf.ensure_shape(tf.pad(value, padding), [size] + value.shape[1:].as_list())
    return out


# What each preprocessor reads from a stored example: feature -> (dtype kind, rank).
_Expected = Dict[str, tuple]
_EXPECTED_FEATURES: Dict[str, Callable[[Params], _Expected]] = {
    'image_classification': lambda p: {'image': ('float', 3), 'label': ('int', 0)},
    'seq2seq': lambda p: {'src': ('int', 1), 'tgt': ('int', 1)},
    'seq2seq_text': lambda p: {p.source_key: ('string', 0), p.target_key: ('string', 0)},
    'lm': lambda p: {lm_inputs.TEXT_KEY: ('string', 0)},
}
_KIND_DTYPES = {'float': lambda d: d.is_floating or d == tf.uint8,
                'int': lambda d: d.is_integer, 'string': lambda d: d == tf.string}
_KIND_TEXT = {'float': 'float (or uint8)', 'int': 'int', 'string': 'string'}


def _describe(expected: _Expected) -> str:
    dims = {0: '[]', 1: '[length]', 3: '[H, W, C]'}
    return '{' + ', '.join(f'{k!r}: {_KIND_TEXT[kind]} {dims.get(rank, rank)}'
                           for k, (kind, rank) in expected.items()) + '}'


def _reads_a_generator(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset` reads a Python generator (`from_generator`) anywhere upstream.

    `from_generator` is a flat_map whose function runs a GeneratorDataset, so the
    datasets upstream (`_inputs`) and the graphs of their functions (`_map_func`) are
    searched: private tf.data attributes, read only, and cheap where serialising the
    dataset's graph would copy every in-memory array in it.
    """
    pending = [dataset]
    while pending:
        current = pending.pop()
        function = getattr(current, '_map_func', None)
        if function is not None and any(op.type == 'GeneratorDataset'
                                        for op in function.function.graph.get_operations()):
            return True
        pending.extend(current._inputs())  # noqa: SLF001
    return False


class _ExamplesSource:
    """Stands in for a tfds builder: TfdsInput reads a split only through `as_dataset`.

    Handing TfdsInput this object instead of a builder sends the user's
    examples down the very same shuffle / repeat / preprocess / batch /
    checkpoint path as a tfds split, with no second copy of that code.
    """

    def __init__(self, examples: tf.data.Dataset):
        self._examples = examples

    def as_dataset(self, split: str, shuffle_files: bool = False, read_config: object = None,
                   decoders: object = None) -> tf.data.Dataset:
        del split, shuffle_files, read_config, decoders  # one split, in the function's order
        return self._examples


class DatasetInput(TfdsInput):
    """Batches of your own `tf.data.Dataset`: `examples_fn(split)` gives single examples.

    `examples_fn` is the dotted name of a module-level function (so params.txt
    names it and every job imports the same one). It returns a
    `tf.data.Dataset` of dicts in the layout `preprocess` reads, e.g. for
    'image_classification' `{'image': float [H, W, C], 'label': int []}`; the
    dataset must be checkpointable (`from_tensor_slices`, `range`, files, not
    `from_generator`) for the trainer to save the input position. Everything
    after that (shuffle, repeat, batch, static-shape check, iterator
    checkpoints) is TfdsInput's.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = super().Params()
        p.Delete('dataset', 'split', 'data_dir', 'generate_if_missing')
        p.Define('examples_fn', '', "Dotted name of `def make(split) -> tf.data.Dataset` of "
                 "single examples, e.g. 'mypkg.data.make'.")
        p.Define('split', 'train', 'Passed to examples_fn: any name your function knows.')
        return p

    def __init__(self, params: Params):  # pylint: disable=super-init-not-called
        self.params = params
        p = params
        if p.preprocess not in PREPROCESSORS:
            raise ValueError(f'unknown preprocess {p.preprocess!r}: use one of '
                             f'{sorted(PREPROCESSORS)}')
        if p.batch_size < 1 or p.shuffle_buffer < 0:
            raise ValueError(f'{p.name}: batch_size={p.batch_size} must be >= 1 and '
                             f'shuffle_buffer={p.shuffle_buffer} >= 0')
        if p.preprocess in _NEEDS_MAX_LENGTH and p.max_length < 1:
            raise ValueError(f'{p.preprocess} needs max_length >= 1 for static shapes')
        # Checked now, before a trainer writes anything: the function, what it
        # returns, its features and their shapes after preprocessing.
        self._builder = _ExamplesSource(self._Examples(import_function(p.examples_fn)))

    def _Examples(self, fn: Callable) -> tf.data.Dataset:
        p = self.params
        expected = _EXPECTED_FEATURES[p.preprocess](p)
        want = (f'expected a tf.data.Dataset of single examples {_describe(expected)} '
                f'(preprocess {p.preprocess!r})')
        examples = fn(p.split)
        if not isinstance(examples, tf.data.Dataset):
            raise ValueError(f'examples_fn {p.examples_fn}({p.split!r}) returned a '
                             f'{type(examples).__name__}: {want}')
        spec = examples.element_spec
        if not isinstance(spec, dict) or not all(
                isinstance(s, tf.TensorSpec) for s in spec.values()):
            raise ValueError(f'examples_fn {p.examples_fn}({p.split!r}) yields {spec}: {want}')
        for key, (kind, rank) in expected.items():
            if key not in spec:
                raise ValueError(f'examples_fn {p.examples_fn}({p.split!r}) yields features '
                                 f'{sorted(spec)}, without {key!r}: {want}')
            s = spec[key]
            if not _KIND_DTYPES[kind](s.dtype) or s.shape.rank != rank:
                raise ValueError(f'examples_fn {p.examples_fn}({p.split!r}): feature {key!r} is '
                                 f'{s.dtype.name} {s.shape}: {want}')
        if _reads_a_generator(examples):
            raise ValueError(
                f'examples_fn {p.examples_fn}({p.split!r}) returned a dataset made with '
                'tf.data.Dataset.from_generator, whose position a checkpoint cannot hold: a '
                'resumed run would start the generator again; build it with '
                'from_tensor_slices (e.g. on the generator\'s output as arrays), range or '
                'files')
        regrouped = _regroup(p, examples)
        if p.preprocess in STREAM_REGROUPERS and not any(True for _ in regrouped.take(1)):
            raise ValueError(f'examples_fn {p.examples_fn}({p.split!r}) gave an empty corpus '
                             '(no example with any text): return at least one non-empty '
                             'document for this split')
        processed = regrouped.map(PREPROCESSORS[p.preprocess](p)).element_spec
        for key, s in processed.items():
            if not s.shape.is_fully_defined():
                raise ValueError(f'examples_fn {p.examples_fn}({p.split!r}): feature {key!r} '
                                 f'has shape {s.shape}, not static: the pipeline needs the same '
                                 'shape in every example (fix H, W, C; pad images)')
        return examples
