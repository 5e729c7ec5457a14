"""Params-configured input generators over tensorflow-datasets.

`TfdsInput.Params().Set(dataset=..., split=..., batch_size=...).Instantiate()
.Dataset()` gives batches with static shapes (the pipeline unrolls its
micro-batches at trace time, so every batch must look the same: fixed batch
size via `drop_remainder`, text padded to `max_length`), as dicts in one of the
layouts the tasks read.

Nothing here downloads. tfpipe's own datasets (`tfpipe_shapes`,
`tfpipe_reverse`) are generated into `data_dir` on first use; any other
dataset must already be prepared in `data_dir`, or `MissingDataError` says how
to prepare it. The order is a function of `seed` alone, and the iterator of
`Dataset()` can be saved in a tf.train.Checkpoint, so a resumed run continues
with the next unseen batch.

Your own data: `DatasetInput.Params().Set(examples_fn='mypkg.data.make', ...)`
calls `mypkg.data.make(split)` for a `tf.data.Dataset` of single examples and
then shuffles, repeats, batches and checkpoints it exactly as a tfds split.

Token ids (shared with `tfpipe.datasets.reverse`): PAD_ID = 0 pads, EOS_ID = 1
ends every target, sources carry no EOS. The byte tokeniser of
'seq2seq_text' maps UTF-8 byte b to b + BYTE_OFFSET (vocabulary 258), so real
translation data needs no vocabulary file.
"""
from __future__ import annotations

import difflib
import importlib
from typing import Callable, Dict, Sequence, Union

import tensorflow as tf
import tensorflow_datasets as tfds

from tfpipe import datasets
from tfpipe.datasets.reverse import EOS_ID, PAD_ID
from tfpipe.hyperparams import InstantiableParams, Params

__all__ = ['BYTE_OFFSET', 'BYTE_VOCAB_SIZE', 'EOS_ID', 'PAD_ID', 'PREPROCESSORS',
           'DatasetInput', 'MissingDataError', 'TfdsInput', 'byte_detokenize', 'byte_tokenize',
           'register_preprocessor']

BYTE_OFFSET = 2  # byte b becomes id b + 2, so PAD (0) and EOS (1) stay free
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET

Example = Dict[str, tf.Tensor]
# A preprocessor is built from the input's params and maps one stored example
# to the layout a task reads; it runs inside tf.data, so it must be graph code.
PreprocessorFactory = Callable[[Params], Callable[[Example], Example]]
PREPROCESSORS: Dict[str, PreprocessorFactory] = {}


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


def byte_tokenize(text: tf.Tensor) -> tf.Tensor:
    """UTF-8 bytes of a string scalar as int32 ids in [2, 258)."""
    raw = tf.io.decode_raw(tf.convert_to_tensor(text, tf.string), tf.uint8)
    return tf.cast(raw, tf.int32) + BYTE_OFFSET


def byte_detokenize(ids: Union[Sequence[int], tf.Tensor]) -> str:
    """Inverse of `byte_tokenize` for reading model output: skips PAD, stops at EOS."""
    if isinstance(ids, tf.Tensor):
        ids = ids.numpy().tolist()
    out = bytearray()
    for i in ids:
        if i == EOS_ID:
            break
        if i != PAD_ID:
            out.append(int(i) - BYTE_OFFSET)
    return out.decode('utf-8', errors='replace')


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


def _tfds_is_mocked() -> bool:
    """Whether `tfds.testing.mock_data` is active.

    It serves fake examples without any files, so "not prepared" is expected
    there and must not stop tests of inputs built on real datasets.
    """
    as_dataset = tfds.core.DatasetBuilder.as_dataset
    return getattr(as_dataset, '__module__', '') == 'tensorflow_datasets.testing.mocking'


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
        p.Define('shuffle_buffer', 0, 'Shuffle buffer size; 0: keep the stored order. The '
                 'buffer is part of every iterator checkpoint.')
        p.Define('repeat', False, 'Repeat forever (training).')
        p.Define('seed', 1234, 'Seed of file and example shuffling: same seed, same order.')
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
        if params.shuffle_buffer < 0:
            raise ValueError(f'shuffle_buffer={params.shuffle_buffer} must be >= 0')
        if params.preprocess.startswith('seq2seq') and params.max_length < 1:
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
        if builder.is_prepared() or _tfds_is_mocked():
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
        """Batches of dict examples with fully static shapes, in an order fixed by seed."""
        p = self.params
        shuffle = p.shuffle_buffer > 0
        # No autocache: tfds would cache small datasets (cifar10 included) in memory,
        # and a tf.data cache is written into every iterator checkpoint.
        read_config = tfds.ReadConfig(shuffle_seed=p.seed, try_autocache=False)
        ds = self._builder.as_dataset(split=p.split, shuffle_files=shuffle,
                                      read_config=read_config)
        if shuffle:  # before repeat: every epoch is a full pass, reshuffled
            ds = ds.shuffle(p.shuffle_buffer, seed=p.seed, reshuffle_each_iteration=True)
        if p.repeat:
            ds = ds.repeat()
        ds = ds.map(PREPROCESSORS[p.preprocess](p), num_parallel_calls=tf.data.AUTOTUNE,
                    deterministic=True)
        ds = ds.batch(p.batch_size, drop_remainder=True)
        for key, spec in ds.element_spec.items():
            if not spec.shape.is_fully_defined():
                raise ValueError(f'{p.name}: feature {key!r} of {p.dataset} has shape '
                                 f'{spec.shape} after preprocess {p.preprocess!r}; the '
                                 'pipeline needs static shapes')
        return ds.prefetch(2)


# What each preprocessor reads from a stored example: feature -> (dtype kind, rank).
_Expected = Dict[str, tuple]
_EXPECTED_FEATURES: Dict[str, Callable[[Params], _Expected]] = {
    'image_classification': lambda p: {'image': ('float', 3), 'label': ('int', 0)},
    'seq2seq': lambda p: {'src': ('int', 1), 'tgt': ('int', 1)},
    'seq2seq_text': lambda p: {p.source_key: ('string', 0), p.target_key: ('string', 0)},
}
_KIND_DTYPES = {'float': lambda d: d.is_floating or d == tf.uint8,
                'int': lambda d: d.is_integer, 'string': lambda d: d == tf.string}
_KIND_TEXT = {'float': 'float (or uint8)', 'int': 'int', 'string': 'string'}


def _describe(expected: _Expected) -> str:
    dims = {0: '[]', 1: '[length]', 3: '[H, W, C]'}
    return '{' + ', '.join(f'{k!r}: {_KIND_TEXT[kind]} {dims.get(rank, rank)}'
                           for k, (kind, rank) in expected.items()) + '}'


def _import_function(name: str) -> Callable:
    """The module-level function `module.function` named by `name`, imported."""
    module, _, attr = name.rpartition('.')
    if not module or not attr:
        raise ValueError(f"examples_fn={name!r} is not a dotted name: set it to "
                         "'module.function', e.g. 'mypkg.data.make'")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module + '.').startswith(e.name + '.'):
            raise  # the module exists but one of its own imports fails: its error
        raise ValueError(f'examples_fn {name!r}: there is no module {module!r}; is its package '
                         'installed or on PYTHONPATH?') from None
    fn = getattr(loaded, attr, None)
    if not callable(fn):
        raise ValueError(f'examples_fn {name!r}: module {module} has no function {attr!r}; '
                         'define `def ' + attr + '(split) -> tf.data.Dataset` there')
    return fn


class _ExamplesSource:
    """Stands in for a tfds builder: TfdsInput reads a split only through `as_dataset`.

    Handing TfdsInput this object instead of a builder sends the user's
    examples down the very same shuffle / repeat / preprocess / batch /
    checkpoint path as a tfds split, with no second copy of that code.
    """

    def __init__(self, examples: tf.data.Dataset):
        self._examples = examples

    def as_dataset(self, split: str, shuffle_files: bool = False,
                   read_config: object = None) -> tf.data.Dataset:
        del split, shuffle_files, read_config  # one split, in the function's own order
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
        if p.preprocess.startswith('seq2seq') and p.max_length < 1:
            raise ValueError(f'{p.preprocess} needs max_length >= 1 for static shapes')
        # Checked now, before a trainer writes anything: the function, what it
        # returns, its features and their shapes after preprocessing.
        self._builder = _ExamplesSource(self._Examples(_import_function(p.examples_fn)))

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
        processed = examples.map(PREPROCESSORS[p.preprocess](p)).element_spec
        for key, s in processed.items():
            if not s.shape.is_fully_defined():
                raise ValueError(f'examples_fn {p.examples_fn}({p.split!r}): feature {key!r} '
                                 f'has shape {s.shape}, not static: the pipeline needs the same '
                                 'shape in every example (fix H, W, C; pad images)')
        return examples
