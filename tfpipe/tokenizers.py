"""Text to token ids and back, and the functions a params value names.

Bytes are the default vocabulary: UTF-8 byte b becomes id b + BYTE_OFFSET
(vocabulary 258), so PAD_ID (0) and EOS_ID (1) stay free and real text needs no
vocabulary file. An input's `tokenizer` / `detokenizer` params name functions of your
own instead (a SentencePiece model's), imported by `import_function` only after the
name passes the trust rule (params_text.check_function_name): a recorded params file
must not run code from an untrusted module.
"""
from __future__ import annotations

import importlib
from typing import Callable, Sequence, Union

import tensorflow as tf

from tfpipe import params_text
from tfpipe.datasets.reverse import EOS_ID, PAD_ID
from tfpipe.hyperparams import Params

BYTE_OFFSET = 2  # byte b becomes id b + 2, so PAD (0) and EOS (1) stay free
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET


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


def tokenizer(p: Params) -> Callable[[tf.Tensor], tf.Tensor]:
    """'lm': bytes, or the function p.tokenizer names (e.g. a SentencePiece model's)."""
    if not p.tokenizer:
        return byte_tokenize
    return import_function(p.tokenizer, 'tokenizer', '(text: tf.string scalar) -> int32 ids')


def detokenizer(p: Params) -> Callable[[Sequence[int]], str]:
    """The inverse of `tokenizer(p)`, for the text of generated ids: bytes, or the function
    p.detokenizer names.

    Refused for a tokenizer of your own without one: decoding its ids as bytes would
    print another vocabulary's text.
    """
    if p.detokenizer:
        return import_function(p.detokenizer, 'detokenizer', '(ids: list of int) -> str')
    if not p.tokenizer:
        return byte_detokenize
    raise ValueError(f'tokenizer {p.tokenizer!r} has no detokenizer, and its ids are not '
                     "bytes: set the input's detokenizer (e.g. --params_override=input.train."
                     "detokenizer='mypkg.vocab.detokenize') to its `def detokenize(ids) -> str`")


def import_function(name: str, param: str = 'examples_fn',
                     signature: str = '(split) -> tf.data.Dataset') -> Callable:
    """The module-level function `module.function` named by `name` (the value of the
    input's `param`), imported."""
    module, _, attr = name.rpartition('.')
    if not module or not attr:
        raise ValueError(f"{param}={name!r} is not a dotted name: set it to "
                         "'module.function', e.g. 'mypkg.data.make'")
    params_text.check_function_name(name, param)  # before the import runs its top level
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module + '.').startswith(e.name + '.'):
            raise  # the module exists but one of its own imports fails: its error
        raise ValueError(f'{param} {name!r}: there is no module {module!r}; is its package '
                         'installed or on PYTHONPATH?') from None
    fn = getattr(loaded, attr, None)
    if not callable(fn):
        raise ValueError(f'{param} {name!r}: module {module} has no function {attr!r}; '
                         f'define `def {attr}{signature}` there')
    return fn
