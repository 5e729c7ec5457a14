"""A small generated text corpus for language-model tests, and broken ones.

`documents` is an `examples_fn`: documents of 0..300 characters of pseudo-code
lines drawn from a fixed vocabulary of words, different per split, the same on
every run. The others are the bad input a user may bring.
"""
import numpy as np
import tensorflow as tf

NUM_DOCUMENTS = {'train': 200, 'dev': 40, 'test': 20}
_WORDS = ['def', 'return', 'self', 'x', 'y', '=', '+', '(', ')', ':', 'if', 'for', 'in']


def texts(split: str) -> list[str]:
    rng = np.random.default_rng({'train': 0, 'dev': 1, 'test': 2}[split])
    out = []
    for _ in range(NUM_DOCUMENTS[split]):
        lines = [' '.join(rng.choice(_WORDS, size=rng.integers(1, 8)))
                 for _ in range(rng.integers(0, 12))]
        out.append('\n'.join(lines))
    return out


def documents(split: str) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices({'text': tf.constant(texts(split), tf.string)})


def unicode(split: str) -> tf.data.Dataset:
    """One document of characters that are several UTF-8 bytes each."""
    return tf.data.Dataset.from_tensor_slices({'text': tf.constant(['πλάτων αἰών'])})


def empty(split: str) -> tf.data.Dataset:
    """Documents that are all empty strings: no text at all."""
    return tf.data.Dataset.from_tensor_slices({'text': tf.constant(['', ''], tf.string)})


def numbers(split: str) -> tf.data.Dataset:
    """'text' that is not a string."""
    return tf.data.Dataset.from_tensor_slices({'text': tf.range(5)})


def codepoints(text: tf.Tensor) -> tf.Tensor:
    """A tokenizer of one id per Unicode character (ids >= 2), standing in for a subword one."""
    return tf.strings.unicode_decode(text, 'UTF-8') + 2
