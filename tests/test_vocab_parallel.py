"""The vocabulary split over T devices: lookup and cross-entropy equal the whole table's.

The math is checked against plain tensors here, with an add_n standing in for the
all-reduce and each shard on its own logical CPU; tests/test_tensor_parallel_lm.py
checks the same functions inside the pipelined LM, with TensorFlow's collectives.
"""
import numpy as np
import pytest
import tensorflow as tf

from tfpipe.layers import vocab_parallel as vp

V = 258  # the byte vocabulary: 4 does not divide it
DEVICES = [f'/CPU:{i}' for i in range(4)]


def add_n_all_reduce(tensors, op):
    with tf.device(DEVICES[0]):
        total = tf.add_n(list(tensors)) if op == 'sum' else tf.reduce_max(tf.stack(tensors), 0)
    return [tf.identity(total) for _ in tensors]


@pytest.mark.parametrize('num_shards', [1, 2, 3, 4])
def test_ranges_cover_the_vocabulary_once_with_sizes_within_one(num_shards):
    ranges = vp.vocab_ranges(V, num_shards)
    assert ranges[0][0] == 0 and ranges[-1][1] == V
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_ranges_refuse_more_devices_than_ids():
    with pytest.raises(ValueError, match='at least one id'):
        vp.vocab_ranges(3, 4)


def _case(seed=0):
    rng = np.random.default_rng(seed)
    logits = tf.constant(rng.normal(size=(3, 5, V)) * 4, tf.float64)
    labels = rng.integers(0, V, size=(3, 5))
    labels[0, :4] = [0, 64, 65, V - 1]  # the first and last ids of shards
    weights = tf.constant(rng.uniform(size=(3, 5)), tf.float64)
    return logits, tf.constant(labels, tf.int32), weights


@pytest.mark.parametrize('num_shards', [1, 2, 4])
def test_cross_entropy_and_its_gradient_equal_the_unsplit_softmax(num_shards):
    logits, labels, weights = _case()
    ranges = vp.vocab_ranges(V, num_shards)

    def loss(split):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            if split:
                xent = vp.cross_entropy([logits[..., a:b] for a, b in ranges], labels, ranges,
                                        add_n_all_reduce, DEVICES)
            else:
                xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                      logits=logits)
            total = tf.reduce_sum(xent * weights)
        return xent, tape.gradient(total, logits)

    (xent, grad), (ref, ref_grad) = loss(True), loss(False)
    np.testing.assert_allclose(xent, ref, atol=1e-12)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-12)


def test_cross_entropy_is_finite_for_huge_logits():
    logits, labels, _ = _case(1)
    logits = logits * 1e4  # exp would overflow without the all-reduced max
    ranges = vp.vocab_ranges(V, 4)
    xent = vp.cross_entropy([logits[..., a:b] for a, b in ranges], labels, ranges,
                            add_n_all_reduce, DEVICES)
    ref = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    np.testing.assert_allclose(xent, ref, rtol=1e-12)


@pytest.mark.parametrize('num_shards', [2, 4])
def test_lookup_and_its_gradient_equal_the_whole_tables(num_shards):
    rng = np.random.default_rng(2)
    table = tf.constant(rng.normal(size=(V, 6)), tf.float64)
    ids = tf.constant([[0, 64, 65, 257], [129, 130, 3, 3]], tf.int32)
    ranges = vp.vocab_ranges(V, num_shards)
    dy = tf.constant(rng.normal(size=(2, 4, 6)), tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(table)
        shards = [table[a:b] for a, b in ranges]
        rows = add_n_all_reduce(vp.lookup_parts(shards, ids, ranges, DEVICES), 'sum')
        total = tf.reduce_sum(rows[0] * dy)
    np.testing.assert_array_equal(rows[0], tf.gather(table, ids))
    assert all(np.array_equal(r, rows[0]) for r in rows[1:])
    expected = tf.math.unsorted_segment_sum(tf.reshape(dy, [-1, 6]), tf.reshape(ids, [-1]), V)
    np.testing.assert_allclose(tf.convert_to_tensor(tape.gradient(total, table)), expected,
                               atol=1e-12)


def test_gather_puts_the_shards_back_in_vocabulary_order():
    logits, _, _ = _case(3)
    ranges = vp.vocab_ranges(V, 4)
    whole = vp.gather([logits[..., a:b] for a, b in ranges], DEVICES[1])
    np.testing.assert_array_equal(whole, logits)
