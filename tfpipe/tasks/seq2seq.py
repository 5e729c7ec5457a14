"""Sequence to sequence with a pipelined decoder-only Transformer.

The source and the target are one sequence, [src, EOS, tgt[:-1]], run through a
causal Transformer; the outputs at the target positions predict tgt. One stack
of identical blocks is what pipelines best (the paper's Transformer workload),
and a prefix-conditioned decoder is a sequence-to-sequence model in that form.
Decoding is greedy: one pipelined forward per target position.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfpipe import fprop_context, metrics
from tfpipe.layers import vocab_parallel
from tfpipe.tasks.base_task import BaseTask, ServingSignature


def _strip(ids, eos_id: int, pad_id: int) -> list[int]:
    out = []
    for i in ids:
        if i == eos_id:
            break
        if i != pad_id:
            out.append(int(i))
    return out


class Seq2SeqTask(BaseTask):
    """batch {'src': [B,T] int, 'tgt': [B,T] int} -> logits over tgt positions."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 0, 'Output vocabulary; the body ends with this width.')
        p.Define('pad_id', 0, 'Padding id (no loss).')
        p.Define('eos_id', 1, 'End-of-sequence id; also starts the target.')
        return p

    def PipelineInputs(self, batch):
        src, tgt = batch['src'], batch['tgt']
        eos = tf.fill([tf.shape(tgt)[0], 1], tf.cast(self.params.eos_id, tgt.dtype))
        return tf.concat([src, eos, tgt[:, :-1]], axis=1)

    def PipelineTargets(self, batch):
        return batch['tgt']

    def _TargetLogits(self, logits, tgt):
        return logits[:, -tgt.shape[1]:, :]

    def _TokenLoss(self, logits, tgt):
        # A tensor-parallel softmax's vocabulary shards (tensor_parallel > 1), gathered.
        logits = vocab_parallel.whole(logits)
        mask = tf.cast(tf.not_equal(tgt, self.params.pad_id), logits.dtype)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tgt, logits=self._TargetLogits(logits, tgt))
        return xent * mask, mask

    def PerExampleLoss(self, logits, tgt):
        xent, mask = self._TokenLoss(logits, tgt)
        return tf.reduce_sum(xent, 1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0)

    def ComputeLoss(self, theta, logits, batch):
        tgt = batch['tgt']
        xent, mask = self._TokenLoss(logits, tgt)
        weights = tf.cast(self.ExampleWeights(batch), mask.dtype)[:, None]
        xent, mask = xent * weights, mask * weights  # padding examples count no tokens
        tokens = tf.reduce_sum(mask)
        hyp = tf.argmax(self._TargetLogits(vocab_parallel.whole(logits), tgt), -1,
                        output_type=tgt.dtype)
        correct = tf.cast(tf.equal(hyp, tgt), mask.dtype) * mask
        return {'loss': (tf.reduce_sum(xent) / tf.maximum(tokens, 1.0), tokens),
                'token_accuracy': (tf.reduce_sum(correct) / tf.maximum(tokens, 1.0), tokens)}

    def Decode(self, theta, batch):
        src, tgt = batch['src'], batch['tgt']
        hyp = tf.zeros_like(tgt)
        with fprop_context.evaluation():
            for i in range(tgt.shape[1]):
                hyp = self._DecodeStep(lambda b: self.ComputePredictions(theta, b), src, hyp, i)
        return {'src': src, 'tgt': tgt, 'hyp': hyp}

    def _DecodeStep(self, predict, src, hyp, i):
        """`hyp` with position i set to the argmax of `predict` (batch -> logits) given the
        positions before it; i may be a tensor (a while loop's counter)."""
        logits = vocab_parallel.whole(predict({'src': src, 'tgt': hyp}))
        step_ids = tf.argmax(logits[:, src.shape[1] + i, :], -1, output_type=hyp.dtype)
        return tf.where(tf.range(hyp.shape[1])[None, :] == i, step_ids[:, None], hyp)

    def ServingSignatures(self, features):
        """serving_default: src int32 [batch, S] (token ids, padded with pad_id) -> ids
        int32 [batch, T], the greedy decoding (the decoder's hyp; cut at the first eos_id).

        One forward per position in a tf.while_loop, so the graph does not grow with T.
        """
        src_spec, tgt_spec = features['src'], features['tgt']
        length = tgt_spec.shape[0]

        def serve(src):
            hyp = tf.zeros([tf.shape(src)[0], length], tgt_spec.dtype)
            _, hyp = tf.while_loop(
                lambda i, _: i < length,
                lambda i, h: (i + 1, self._DecodeStep(self.ServingPredictions, src, h, i)),
                (tf.constant(0), hyp))
            return {'ids': hyp}
        src = tf.TensorSpec([None, *src_spec.shape], src_spec.dtype, name='src')
        return {'serving_default': ServingSignature({'src': src}, serve)}

    def PostProcessDecodeOut(self, decode_out):
        p = self.params
        return [{'src': _strip(s, p.eos_id, p.pad_id), 'ref': _strip(t, p.eos_id, p.pad_id),
                 'hyp': _strip(h, p.eos_id, p.pad_id)}
                for s, t, h in zip(decode_out['src'], decode_out['tgt'], decode_out['hyp'])]

    def DecodeMetrics(self, records):
        if not records:
            return {'exact_match': 0.0, 'bleu': 0.0}
        return {'exact_match': float(np.mean([r['ref'] == r['hyp'] for r in records])),
                'bleu': metrics.corpus_bleu([r['ref'] for r in records],
                                            [r['hyp'] for r in records])}
