"""Image classification with a pipelined body (the paper's AmoebaNet workload)."""
from __future__ import annotations

import re
from typing import Optional

import numpy as np
import tensorflow as tf

from tfpipe.tasks.base_task import BaseTask, ServingSignature


_LABEL_CHECK = 'tfpipe: label outside [0, num_classes):'
_LABEL_CHECK_RE = re.compile(re.escape(_LABEL_CHECK) + r'\] \[(-?\d+)\]')


def bad_label(error: tf.errors.OpError) -> Optional[int]:
    """The label that failed ImageClassifier's range check, if that is what `error` is."""
    match = _LABEL_CHECK_RE.search(error.message)
    return int(match.group(1)) if match else None


class ImageClassifier(BaseTask):
    """batch {'image': [B,H,W,C] float, 'label': [B] int} -> logits [B, num_classes]."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('num_classes', 0, 'Number of classes; the body must end with this width.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        if self.params.num_classes < 2:
            raise ValueError(f'{self.path}: num_classes={self.params.num_classes} must be >= 2')

    def PipelineInputs(self, batch):
        return batch['image']

    def PipelineTargets(self, batch):
        return batch['label']

    def PerExampleLoss(self, logits, labels):
        # Checked here, where every loss of the task is computed: a label out of range is
        # an InvalidArgumentError deep in TensorFlow on CPU and a silent NaN on GPU, while
        # this assert's message `bad_label` reads back for a one-line error.
        in_range = (labels >= 0) & (labels < self.params.num_classes)
        first_bad = labels[tf.argmin(tf.cast(in_range, tf.int32))]
        check = tf.debugging.Assert(tf.reduce_all(in_range), [_LABEL_CHECK, first_bad])
        with tf.control_dependencies([check]):
            labels = tf.identity(labels)
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    def ComputeLoss(self, theta, logits, batch):
        labels = batch['label']
        loss = self.PerExampleLoss(logits, labels)
        weights = tf.cast(self.ExampleWeights(batch), loss.dtype)
        total = tf.reduce_sum(weights)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=labels.dtype), labels),
                          loss.dtype)
        return {'loss': (tf.math.divide_no_nan(tf.reduce_sum(loss * weights), total), total),
                'accuracy': (tf.math.divide_no_nan(tf.reduce_sum(correct * weights), total),
                             total)}

    def Decode(self, theta, batch):
        probs = tf.nn.softmax(self.ComputePredictions(theta, batch))
        return {'label': batch['label'], 'prediction': tf.argmax(probs, -1),
                'confidence': tf.reduce_max(probs, -1)}

    def ServingSignatures(self, features):
        """serving_default: image float32 [batch, H, W, C] -> probabilities float32
        [batch, num_classes] and classes int64 [batch] (the decoder's prediction)."""
        def serve(image):
            probs = tf.nn.softmax(self.ServingPredictions({'image': image}))
            return {'probabilities': probs, 'classes': tf.argmax(probs, -1)}
        image = tf.TensorSpec([None, *features['image'].shape], tf.float32, name='image')
        return {'serving_default': ServingSignature({'image': image}, serve)}

    def PostProcessDecodeOut(self, decode_out):
        return [{'label': int(l), 'prediction': int(p), 'confidence': round(float(c), 4)}
                for l, p, c in zip(decode_out['label'], decode_out['prediction'],
                                   decode_out['confidence'])]

    def DecodeMetrics(self, records):
        correct = [r['label'] == r['prediction'] for r in records]
        return {'accuracy': float(np.mean(correct)) if correct else 0.0}
