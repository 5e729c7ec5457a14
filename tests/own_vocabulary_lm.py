"""A language model trained with a vocabulary of its own, as a user's subword one would be.

The tokenizer maps byte b to 257 - b: the same 258 ids as bytes, so the shipped LM's
shapes fit, but every text means other ids, and a job that fell back to bytes would
feed and print another vocabulary's tokens.
"""
from typing import Sequence

import tensorflow as tf

import model_registry
from params.lm.pystdlib import TinyTransformerLM


def flipped(text: tf.Tensor) -> tf.Tensor:
    """Byte b -> id 257 - b (ids in [2, 258), as 0 pads and 1 ends documents)."""
    return 257 - tf.cast(tf.io.decode_raw(text, tf.uint8), tf.int32)


def unflipped(ids: Sequence[int]) -> str:
    """The inverse of `flipped`, for generated ids."""
    return bytes(257 - i for i in ids if 2 <= i < 258).decode('utf-8', errors='replace')


@model_registry.RegisterSingleTaskModel
class FlippedBytesLM(TinyTransformerLM):
    """TinyTransformerLM on tests.lm_corpus with the `flipped` vocabulary."""

    def InputParams(self, split, training):
        return super().InputParams(split, training).Set(
            examples_fn='tests.lm_corpus.documents', tokenizer='tests.own_vocabulary_lm.flipped',
            detokenizer='tests.own_vocabulary_lm.unflipped')
