"""Tests for tfpipe.pipeline.microbatch: split a batch into micro-batches and back."""
import numpy as np
import pytest
import tensorflow as tf

from tfpipe.pipeline import microbatch


def _nested(batch=10):
    x = tf.reshape(tf.range(batch * 3, dtype=tf.float32), [batch, 3])
    ids = tf.range(batch, dtype=tf.int32)
    mask = tf.cast(tf.reshape(tf.range(batch * 2) % 2, [batch, 2]), tf.int64)
    return {'x': x, 'extra': (ids, {'mask': mask})}


def _assert_same(a, b):
    tf.nest.assert_same_structure(a, b)
    for u, v in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
        assert u.dtype == v.dtype
        assert u.shape == v.shape
        np.testing.assert_array_equal(u.numpy(), v.numpy())


@pytest.mark.parametrize('batch,m,sizes', [
    (10, 4, [3, 3, 2, 2]),
    (8, 4, [2, 2, 2, 2]),
    (3, 5, [1, 1, 1]),
    (7, 1, [7]),
    (1, 3, [1]),
    (9, 2, [5, 4]),
])
def test_micro_batch_sizes(batch, m, sizes):
    assert microbatch.micro_batch_sizes(batch, m) == sizes


def test_micro_batch_sizes_errors():
    with pytest.raises(ValueError, match=r'num_micro_batches is 0: num_micro_batches '
                                         r'must be >= 1'):
        microbatch.micro_batch_sizes(8, 0)
    with pytest.raises(ValueError, match=r'batch size is 0.*at least one example'):
        microbatch.micro_batch_sizes(0, 2)


def test_offsets():
    assert microbatch.offsets([3, 3, 2, 2]) == [0, 3, 6, 8]
    assert microbatch.offsets([5]) == [0]
    assert microbatch.offsets([]) == []


def test_batch_size():
    assert microbatch.batch_size(_nested(6)) == 6
    assert microbatch.batch_size(tf.zeros([4, 2])) == 4
    assert microbatch.batch_size([np.zeros([5, 1]), np.ones(5)]) == 5


def test_batch_size_scalar():
    with pytest.raises(ValueError, match=r"inputs\['a'\]\[1\] is a scalar: every input "
                                         r'needs a leading batch dimension'):
        microbatch.batch_size({'a': (tf.zeros([2]), tf.constant(1.0))})


def test_batch_size_unknown():
    @tf.function(input_signature=[tf.TensorSpec([None, 3])])
    def f(x):
        return microbatch.batch_size({'x': x})

    with pytest.raises(ValueError, match=r"inputs\['x'\] \(shape \(None, 3\)\) has an "
                                         r'unknown batch dimension; give the input a '
                                         r'static batch size'):
        f.get_concrete_function()


def test_batch_size_unknown_rank():
    @tf.function(input_signature=[tf.TensorSpec(None)])
    def f(x):
        return microbatch.batch_size(x)

    with pytest.raises(ValueError, match=r'unknown batch dimension.*drop_remainder=True'):
        f.get_concrete_function()


def test_batch_size_disagree():
    inputs = {'x': tf.zeros([8, 2]), 'mask': tf.zeros([6]), 'y': tf.zeros([8])}
    with pytest.raises(ValueError, match=r"inputs disagree on the batch dimension: "
                                         r"inputs\['mask'\]=6, inputs\['x'\]=8, "
                                         r"inputs\['y'\]=8; every tensor in the inputs "
                                         r'must have the same leading \(batch\) size'):
        microbatch.batch_size(inputs)


@pytest.mark.parametrize('empty', [{}, (), [], {'a': ()}])
def test_batch_size_empty(empty):
    with pytest.raises(ValueError, match=r'contain no tensors: pass at least one tensor'):
        microbatch.batch_size(empty)


def test_batch_size_not_convertible():
    with pytest.raises(ValueError, match=r"inputs\['a'\] is object.*not convertible"):
        microbatch.batch_size({'a': object()})


@pytest.mark.parametrize('m,sizes', [(1, [10]), (2, [5, 5]), (4, [3, 3, 2, 2]),
                                     (10, [1] * 10), (13, [1] * 10)])
def test_split_merge_round_trip_eager(m, sizes):
    inputs = _nested(10)
    parts = microbatch.split(inputs, m)
    assert [microbatch.batch_size(p) for p in parts] == sizes
    for part, start, size in zip(parts, microbatch.offsets(sizes), sizes):
        tf.nest.assert_same_structure(part, inputs)
        assert part['x'].shape == [size, 3]
        assert part['extra'][1]['mask'].dtype == tf.int64
        np.testing.assert_array_equal(part['extra'][0].numpy(),
                                      np.arange(start, start + size, dtype=np.int32))
    _assert_same(microbatch.merge(parts), inputs)


def test_split_merge_round_trip_in_tf_function():
    inputs = _nested(10)
    signature = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), inputs)

    @tf.function(input_signature=[signature])
    def round_trip(batch):
        parts = microbatch.split(batch, 4)
        shapes = [p['x'].shape.as_list() for p in parts]
        assert shapes == [[3, 3], [3, 3], [2, 3], [2, 3]]  # static at trace time
        return microbatch.merge(parts), parts

    merged, parts = round_trip(inputs)
    _assert_same(merged, inputs)
    assert [p['extra'][0].shape[0] for p in parts] == [3, 3, 2, 2]


def test_split_one_micro_batch_is_identity():
    inputs = _nested(4)
    parts = microbatch.split(inputs, 1)
    assert len(parts) == 1 and parts[0] is inputs
    single = {'a': tf.zeros([1, 2])}
    assert microbatch.split(single, 3)[0] is single  # batch 1: nothing to cut


def test_split_one_micro_batch_adds_no_ops():
    @tf.function(input_signature=[tf.TensorSpec([4, 2])])
    def f(x):
        return microbatch.merge(microbatch.split({'x': x}, 1))['x']

    graph = f.get_concrete_function().graph
    op_types = {op.type for op in graph.get_operations()}
    assert op_types <= {'Placeholder', 'Identity', 'NoOp'}


def test_split_numpy_leaves():
    parts = microbatch.split({'a': np.arange(6), 'b': np.ones([6, 2], np.float32)}, 3)
    assert [p['a'].numpy().tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p['b'].dtype == tf.float32 for p in parts)


def test_split_errors():
    with pytest.raises(ValueError, match=r'num_micro_batches is 0: num_micro_batches '
                                         r'must be >= 1'):
        microbatch.split(tf.zeros([4]), 0)
    with pytest.raises(ValueError, match='inputs disagree on the batch dimension'):
        microbatch.split((tf.zeros([4]), tf.zeros([3])), 2)
    with pytest.raises(ValueError, match='is a scalar'):
        microbatch.split(tf.constant(3.0), 2)


def test_merge_single_is_identity():
    part = {'x': tf.zeros([2])}
    assert microbatch.merge([part]) is part


def test_merge_errors():
    with pytest.raises(ValueError, match=r'pass a non-empty list of micro-batch'):
        microbatch.merge([])
    with pytest.raises(ValueError, match=r'micro-batch 1 has a different structure from '
                                         r'micro-batch 0'):
        microbatch.merge([{'x': tf.zeros([2])}, {'y': tf.zeros([2])}])
    with pytest.raises(ValueError, match=r"inputs\['loss'\] is a scalar in every "
                                         r'micro-batch.*reduce per-micro-batch scalars'):
        microbatch.merge([{'loss': tf.constant(1.0)}, {'loss': tf.constant(2.0)}])
