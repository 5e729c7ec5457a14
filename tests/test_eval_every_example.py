"""Evaluation and decoding see every example asked for, and say how many they saw.

A split of 100 examples with batch size 16 (6 full batches and 4 left over):
the evaler's metrics and the decoder's records must equal those computed by
hand over all 100 examples, with a BatchNorm whose moving statistics are far
from the identity, so padding that leaked into eval statistics would show.
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import model_registry
from tfpipe import checkpoints, datasets, fprop_context, layers
from trainer import eval_jobs

SPLIT = 'validation[:100]'
BATCH_SIZE = 16
STEP = 3


def _params(data_dir):
    params = model_registry.get_params('image.shapes.SmallConvPipe')
    body = list(params.task.pipeline.body)
    body.insert(1, layers.BatchNorm.Params().Set(name='bn', dim=8))
    params.task.pipeline.Set(body=body, balance=[4, 2])
    params.task.eval.Set(samples_per_summary=1000, decoder_samples_per_summary=1000)
    for split in ('dev', 'test'):
        params.input.Get(split).Set(split=SPLIT, batch_size=BATCH_SIZE, data_dir=data_dir)
    return params


@pytest.fixture(scope='module')
def evaluated(data_dir, tmp_path_factory):
    """(logdir, hand-computed logits and labels of all 100 examples)."""
    logdir = str(tmp_path_factory.mktemp('eval'))
    params = _params(data_dir)
    task = params.task.Instantiate()
    rng = np.random.default_rng(0)
    bn = task.VariablesByPath()
    bn['task/pipe/bn/moving_mean'].assign(rng.normal(0.3, 0.2, [8]).astype(np.float32))
    bn['task/pipe/bn/moving_variance'].assign(rng.uniform(0.2, 3.0, [8]).astype(np.float32))
    step = tf.Variable(STEP, dtype=tf.int64)
    manager = tf.train.CheckpointManager(checkpoints.make(task.VariablesByPath(), step=step),
                                         os.path.join(logdir, 'train'), max_to_keep=1,
                                         checkpoint_name='ckpt')
    manager.save(checkpoint_number=STEP)

    stored = tfds.as_numpy(datasets.prepare('tfpipe_shapes', data_dir).as_dataset(
        split=SPLIT, batch_size=-1))
    images = tf.constant(stored['image'] / 255.0, tf.float32)
    with fprop_context.evaluation():
        logits = task.ComputePredictions(task.theta, {'image': images}).numpy()
    for cls in (eval_jobs.Evaler, eval_jobs.Decoder):
        cls(params, 'dev' if cls is eval_jobs.Evaler else 'test', logdir, STEP).run()
    return logdir, logits.astype(np.float64), stored['label']


def _scores(path):
    with open(path) as f:
        return {k: float(v) for k, v in (line.split(': ') for line in f.read().splitlines())}


def test_evaler_metrics_equal_a_hand_computation_over_every_example(evaluated):
    logdir, logits, labels = evaluated
    assert len(labels) == 100 and len(labels) % BATCH_SIZE
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    expected_loss = -log_probs[np.arange(len(labels)), labels].mean()
    expected_accuracy = (logits.argmax(axis=1) == labels).mean()
    scores = _scores(os.path.join(logdir, 'eval_dev', f'score-{STEP}.txt'))
    assert scores.keys() == {'loss', 'accuracy', 'num_examples'}
    assert scores['num_examples'] == 100
    np.testing.assert_allclose(scores['loss'], expected_loss, rtol=2e-5)
    np.testing.assert_allclose(scores['accuracy'], expected_accuracy, atol=1e-6)
    assert 0.0 < expected_accuracy < 1.0  # a metric that could have come out otherwise


def test_decoder_records_every_example_once_without_padding(evaluated):
    logdir, logits, labels = evaluated
    with open(os.path.join(logdir, 'decoder_test', f'decoder_out-{STEP}.jsonl')) as f:
        records = [json.loads(line) for line in f]
    assert [r['label'] for r in records] == labels.tolist()
    assert [r['prediction'] for r in records] == logits.argmax(axis=1).tolist()
    scores = _scores(os.path.join(logdir, 'decoder_test', f'score-{STEP}.txt'))
    assert scores['num_examples'] == 100
    np.testing.assert_allclose(scores['accuracy'], (logits.argmax(axis=1) == labels).mean(),
                               atol=1e-6)


def test_fewer_examples_asked_than_the_split_holds_are_evaluated_exactly(data_dir):
    tfds_input = _params(data_dir).input.dev.Instantiate()
    batches = list(tfds_input.EvalDataset(37))
    assert [b['image'].shape[0] for b in batches] == [BATCH_SIZE] * 3
    weights = np.concatenate([b['weight'].numpy() for b in batches])
    assert weights.tolist() == [1.0] * 37 + [0.0] * 11
    stored = tfds.as_numpy(datasets.prepare('tfpipe_shapes', data_dir).as_dataset(
        split=SPLIT, batch_size=-1))
    labels = np.concatenate([b['label'].numpy() for b in batches])
    np.testing.assert_array_equal(labels[:37], stored['label'][:37])
    assert (labels[37:] == 0).all()  # padding is zeros
    with pytest.raises(ValueError, match='num_examples=0'):
        tfds_input.EvalDataset(0)


def test_seq2seq_metrics_ignore_padding_examples():
    """A batch plus rows of weight 0 has the metrics of the batch alone, whatever they hold."""
    params = model_registry.get_params('mt.reverse.TransformerPipe')
    task = params.task.Instantiate()
    rng = np.random.default_rng(1)
    src = rng.integers(2, 20, size=[6, 13]).astype(np.int32)
    tgt = np.concatenate([src[:, ::-1][:, :12], np.ones([6, 1], np.int32)], axis=1)
    batch = {'src': tf.constant(src), 'tgt': tf.constant(tgt)}
    padded = {'src': tf.constant(np.concatenate([src, src[:2] + 1])),
              'tgt': tf.constant(np.concatenate([tgt, tgt[:2]])),
              'weight': tf.constant([1.0] * 6 + [0.0] * 2)}
    with fprop_context.evaluation():
        plain = task.ComputeLoss(task.theta, task.ComputePredictions(task.theta, batch), batch)
        masked = task.ComputeLoss(task.theta, task.ComputePredictions(task.theta, padded),
                                  padded)
    for name in ('loss', 'token_accuracy'):
        np.testing.assert_allclose(masked[name][0].numpy(), plain[name][0].numpy(), rtol=1e-5)
        assert float(masked[name][1]) == float(plain[name][1]) == 6 * 13
