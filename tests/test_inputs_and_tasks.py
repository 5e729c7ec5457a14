"""Inputs over tfds (generated and mocked real datasets), tasks and metrics."""
import numpy as np
import pytest
import tensorflow as tf

import model_registry
from tests import tfds_mocks
from tfpipe import fprop_context, inputs, metrics
from tfpipe.datasets import reverse


def input_params(**kw):
    return inputs.TfdsInput.Params().Set(**kw)


def test_shapes_batches_are_static_and_normalised(data_dir):
    ds = input_params(dataset='tfpipe_shapes', split='validation', batch_size=8,
                      data_dir=data_dir).Instantiate().Dataset()
    assert ds.element_spec['image'].shape == (8, 16, 16, 3)
    batch = next(iter(ds))
    assert batch['image'].dtype == tf.float32 and batch['label'].dtype == tf.int32
    assert 0.0 <= float(tf.reduce_min(batch['image'])) <= float(tf.reduce_max(batch['image'])) \
        <= 1.0
    assert set(batch['label'].numpy()) <= {0, 1, 2, 3}


def test_reverse_batches_pad_and_keep_eos(data_dir):
    ds = input_params(dataset='tfpipe_reverse', split='test', batch_size=4, max_length=13,
                      preprocess='seq2seq', data_dir=data_dir).Instantiate().Dataset()
    batch = next(iter(ds))
    assert batch['src'].shape == (4, 13) and batch['tgt'].shape == (4, 13)
    for src, tgt in zip(batch['src'].numpy(), batch['tgt'].numpy()):
        tokens = src[src != reverse.PAD_ID]
        n = len(tokens)
        np.testing.assert_array_equal(tgt[:n], tokens[::-1])
        assert tgt[n] == reverse.EOS_ID and (tgt[n + 1:] == reverse.PAD_ID).all()


def test_iterator_checkpoint_resumes_at_the_next_batch(data_dir, tmp_path):
    p = input_params(dataset='tfpipe_shapes', split='train', batch_size=4, shuffle_buffer=64,
                     repeat=True, data_dir=data_dir)
    it = iter(p.Instantiate().Dataset())
    next(it)
    ckpt = tf.train.Checkpoint(iterator=it)
    path = ckpt.save(str(tmp_path / 'it'))
    expected = [next(it)['label'].numpy() for _ in range(3)]
    fresh = iter(p.Instantiate().Dataset())
    tf.train.Checkpoint(iterator=fresh).restore(path).assert_consumed()
    actual = [next(fresh)['label'].numpy() for _ in range(3)]
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


def test_same_seed_same_order(data_dir):
    p = input_params(dataset='tfpipe_shapes', split='train', batch_size=16, shuffle_buffer=256,
                     repeat=True, data_dir=data_dir, seed=7)
    first = next(iter(p.Instantiate().Dataset()))['label'].numpy()
    again = next(iter(p.Instantiate().Dataset()))['label'].numpy()
    np.testing.assert_array_equal(first, again)


def test_cifar10_through_mock_data():
    with tfds_mocks.prepared_mock_data(num_examples=8):
        batch = next(iter(input_params(dataset='cifar10', split='train', batch_size=4,
                                       generate_if_missing=False).Instantiate().Dataset()))
    assert batch['image'].shape == (4, 32, 32, 3) and batch['label'].shape == (4,)
    assert float(tf.reduce_max(batch['image'])) <= 1.0


def test_wmt_through_mock_data_is_byte_tokenised():
    with tfds_mocks.prepared_mock_data(num_examples=8):
        ds = input_params(dataset='wmt14_translate/de-en', split='train', batch_size=2,
                          preprocess='seq2seq_text', max_length=16).Instantiate().Dataset()
        batch = next(iter(ds))
    assert batch['src'].shape == (2, 16) and batch['tgt'].shape == (2, 16)
    assert (batch['tgt'].numpy() == reverse.EOS_ID).any(axis=1).all()
    assert batch['src'].numpy().max() < inputs.BYTE_VOCAB_SIZE


def test_byte_tokenizer():
    ids = inputs.byte_tokenize(tf.constant('Hä')).numpy()
    assert list(ids) == [ord('H') + 2, 0xC3 + 2, 0xA4 + 2]


def test_missing_real_dataset_says_how_to_prepare_it(tmp_path):
    with pytest.raises(ValueError, match=r"cifar10 split 'train' is not in .*never downloads: "
                                         r"run `tfds build cifar10 --data_dir=DIR`"):
        input_params(dataset='cifar10', data_dir=str(tmp_path)).Instantiate()
    assert not any(p.is_file() for p in tmp_path.rglob('*'))  # nothing was downloaded


def test_corpus_bleu():
    assert metrics.corpus_bleu([[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5]]) == pytest.approx(100.0)
    assert metrics.corpus_bleu([[1, 2, 3, 4]], [[5, 6, 7, 8]]) == 0.0
    partial = metrics.corpus_bleu([[1, 2, 3, 4, 5, 6]], [[1, 2, 3, 4, 9, 9]])
    assert 0.0 < partial < 100.0
    short = metrics.corpus_bleu([[1, 2, 3, 4, 5, 6, 7, 8]], [[1, 2, 3, 4, 5]])
    assert short < 100.0 * np.exp(1 - 8 / 5) + 1e-9  # brevity penalty


def small_seq2seq_task():
    params = model_registry.get_params('mt.reverse.TransformerPipe')
    params.task.pipeline.body = [p.Set(dtype=tf.float64) for p in params.task.pipeline.body]
    return params.task.Instantiate()


def seq2seq_batch():
    rng = np.random.default_rng(0)
    src = rng.integers(2, reverse.VOCAB_SIZE, size=[8, 13]).astype(np.int32)
    src[:, 9:] = reverse.PAD_ID
    tgt = np.zeros_like(src)
    tgt[:, :9] = src[:, 8::-1]
    tgt[:, 9] = reverse.EOS_ID
    return {'src': tf.constant(src), 'tgt': tf.constant(tgt)}


def test_seq2seq_forward_backward_equals_tape_on_its_loss():
    task = small_seq2seq_task()
    batch = seq2seq_batch()
    with fprop_context.training(step=3):
        loss, grads = task.ForwardBackward(task.theta, batch)
        with tf.GradientTape() as tape:
            logits = task.ComputePredictions(task.theta, batch)
            ref = tf.reduce_mean(task.PerExampleLoss(logits, batch['tgt']))
        ref_grads = tape.gradient(ref, task.theta)
    np.testing.assert_allclose(loss.numpy(), ref.numpy(), rtol=1e-10)
    for g, r in zip(tf.nest.flatten(grads), tf.nest.flatten(ref_grads)):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-8, atol=1e-12)


def test_seq2seq_decode_is_causal_and_greedy():
    task = small_seq2seq_task()
    batch = seq2seq_batch()
    # Decode unrolls one forward pass per target token into the traced graph: 5 tokens
    # show greedy, causal decoding as well as 13 and trace 5 model copies, not 13.
    batch['tgt'] = batch['tgt'][:, :5]
    out = {k: v.numpy() for k, v in tf.function(
        lambda b: task.Decode(task.theta, b))(batch).items()}
    # Greedy: each decoded token is the argmax given the tokens decoded before it.
    with fprop_context.evaluation():
        logits = task.ComputePredictions(task.theta, {'src': batch['src'],
                                                      'tgt': tf.constant(out['hyp'])}).numpy()
    np.testing.assert_array_equal(logits[:, 13:, :].argmax(-1), out['hyp'])
    records = task.PostProcessDecodeOut(out)
    assert len(records) == 8 and records[0]['src'] == list(batch['src'].numpy()[0, :9])
    scores = task.DecodeMetrics(records)
    assert set(scores) == {'exact_match', 'bleu'}
