"""Language-model input: documents of any length packed into fixed-length rows.

A document of n tokens t1..tn is n + 1 (input, target) pairs, inputs
[EOD, t1, .., tn] and targets [t1, .., tn, EOD]: every document is predicted
from its own start and predicts its own end, and no pair spans two documents.
The pairs of consecutive documents are concatenated and cut every `length`
pairs into rows. Within a row each piece of a document is a segment (ids 1, 2,
..), with positions restarting at 0; the only padding (segment 0, ids PAD) ends
the last row of the stream.

Exactness: with `layers.PackedTransformerBlock` (attention only inside a
segment) and `layers.PackedPositionEmbedding` (positions per segment), a
document that lies whole in a row gets exactly the outputs it would get alone
(masked attention weights are exactly 0; only float summation order differs,
tests/test_lm.py checks 1e-5), and padding changes nothing. A document longer
than the room left in its row continues in the next row as a new segment at
position 0: its later tokens lose the context before the cut, as in any
fixed-length LM; they never see another document.

The rows are built by one `tf.data` scan over the documents in their stored
order, before any shuffle, so the position of an input iterator counts rows
and a resumed run rebuilds the same rows.
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import tensorflow as tf

from tfpipe.datasets.reverse import EOS_ID, PAD_ID

__all__ = ['EOD_ID', 'TEXT_KEY', 'pack_documents', 'row_features', 'unigram_log_perplexity']

EOD_ID = EOS_ID  # ends (and starts) every document
TEXT_KEY = 'text'
_NO_DOCUMENT = -1  # the document index of padding
Tokenizer = Callable[[tf.Tensor], tf.Tensor]


def _pairs(text: tf.Tensor, index: tf.Tensor, tokenize: Tokenizer) -> tf.Tensor:
    """[n + 1, 3] int32: (input, target, document index) of one document's tokens."""
    ids = tokenize(text)
    eod = tf.constant([EOD_ID], tf.int32)
    inputs, targets = tf.concat([eod, ids], 0), tf.concat([ids, eod], 0)
    return tf.stack([inputs, targets, tf.fill(tf.shape(inputs), index)], 1)


def pack_documents(documents: tf.data.Dataset, length: int,
                   tokenize: Tokenizer) -> tf.data.Dataset:
    """{'text': string} documents -> {'row': int32 [length, 3]} rows (see the module doc).

    Empty documents are skipped. Columns: input id, target id, document index
    (-1 for padding); `row_features` turns a row into what the task reads.
    """
    docs = documents.filter(lambda ex: tf.strings.length(ex[TEXT_KEY]) > 0).enumerate()
    pairs = docs.map(lambda i, ex: (_pairs(ex[TEXT_KEY], tf.cast(i, tf.int32), tokenize),
                                    tf.constant(False)))
    last = tf.data.Dataset.from_tensors((tf.zeros([0, 3], tf.int32), tf.constant(True)))

    def cut(buffer: tf.Tensor, element) -> tuple:
        more, is_last = element
        buffer = tf.concat([buffer, more], 0)
        size = tf.shape(buffer)[0]
        # The end of the stream flushes a partial row, padded.
        rows = tf.where(is_last, (size + length - 1) // length, size // length)
        padding = tf.tile([[PAD_ID, PAD_ID, _NO_DOCUMENT]],
                          [tf.maximum(rows * length - size, 0), 1])
        buffer = tf.concat([buffer, padding], 0)
        full = tf.reshape(buffer[:rows * length], [rows, length, 3])
        return buffer[rows * length:], full

    rows = pairs.concatenate(last).scan(tf.zeros([0, 3], tf.int32), cut)
    return rows.unbatch().map(lambda row: {'row': tf.ensure_shape(row, [length, 3])})


def row_features(row: tf.Tensor) -> Dict[str, tf.Tensor]:
    """A packed row -> {'inputs', 'targets', 'segment_ids', 'positions'}, int32 [length]."""
    document = row[:, 2]
    real = tf.cast(document != _NO_DOCUMENT, tf.int32)
    starts = tf.concat([[True], document[1:] != document[:-1]], 0)
    run = tf.cumsum(tf.cast(starts, tf.int32)) - 1  # which piece of the row each pair is in
    first = tf.cast(tf.where(starts)[:, 0], tf.int32)
    positions = tf.range(tf.shape(row)[0]) - tf.gather(first, run)
    return {'inputs': row[:, 0], 'targets': row[:, 1], 'segment_ids': (run + 1) * real,
            'positions': positions * real}


def unigram_log_perplexity(batches: tf.data.Dataset, vocab_size: int) -> float:
    """Log-perplexity of the best context-free model of these batches' own targets.

    The entropy of the targets' empirical distribution (counting every real
    token once, as the evaler does): a model that beats it has learned to use
    context; no unigram model, even one fitted to this very split, does better.
    """
    counts = np.zeros([vocab_size])
    for batch in batches:
        weights = batch['segment_ids'].numpy() > 0
        if 'weight' in batch:
            weights &= batch['weight'].numpy()[:, None] > 0
        counts += np.bincount(batch['targets'].numpy()[weights], minlength=vocab_size)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())
