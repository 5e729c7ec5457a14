"""Input checkpoints hold the position (epoch, index), not the shuffle buffer.

A resumed run must still see exactly the batches an uninterrupted run sees:
checked here across an epoch boundary, with a buffer as large as the split,
and in the trainer's own checkpoint.
"""
import os

import numpy as np
import tensorflow as tf

import model_registry
from tfpipe import checkpoints, inputs
from trainer import runtime_options, train_job

BATCHES_PER_EPOCH = 16  # tfpipe_shapes validation: 1024 examples, batch 64


def _input(data_dir, repeat=True):
    return inputs.TfdsInput.Params().Set(
        data_dir=data_dir, dataset='tfpipe_shapes', split='validation', batch_size=64,
        shuffle_buffer=1024, repeat=repeat).Instantiate()


def _labels(batches):
    return [b['label'].numpy() for b in batches]


def _size(directory):
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def test_resume_from_a_position_checkpoint_across_epochs(data_dir, tmp_path):
    tfds_input = _input(data_dir)
    straight = _labels(tfds_input.Dataset().take(3 * BATCHES_PER_EPOCH))
    first, second = (np.concatenate(straight[i * 16:(i + 1) * 16]) for i in range(2))
    assert not np.array_equal(first, second)  # each epoch is reshuffled...
    assert np.array_equal(np.sort(first), np.sort(second))  # ...as a full pass

    iterator = tfds_input.Iterator()
    seen = _labels(next(iterator) for _ in range(BATCHES_PER_EPOCH + 5))  # into epoch 1
    path = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / 'position' / 'ckpt'))
    assert (int(iterator.epoch.numpy()), int(iterator.index.numpy())) == (1, 5 * 64)

    resumed = tfds_input.Iterator()
    tf.train.Checkpoint(iterator=resumed).restore(path).assert_consumed()
    after = _labels(next(resumed) for _ in range(BATCHES_PER_EPOCH))  # crosses into epoch 2
    for expected, actual in zip(straight, seen + after):
        np.testing.assert_array_equal(actual, expected)

    # Restoring into an iterator that is already running moves it back, too.
    tf.train.Checkpoint(iterator=resumed).restore(path).assert_consumed()
    np.testing.assert_array_equal(next(resumed)['label'].numpy(), straight[21])

    position_bytes = _size(str(tmp_path / 'position'))
    buffered = iter(tfds_input.Dataset())
    next(buffered)
    tf.train.Checkpoint(iterator=buffered).save(str(tmp_path / 'buffer' / 'ckpt'))
    assert position_bytes < 2_000 < 500_000 < _size(str(tmp_path / 'buffer'))


def test_a_non_repeating_input_ends_after_one_pass(data_dir):
    tfds_input = _input(data_dir, repeat=False)
    assert len(list(tfds_input.Iterator())) == BATCHES_PER_EPOCH


def test_the_trainers_checkpoint_holds_the_input_position_not_its_buffer(data_dir, tmp_path):
    params = model_registry.get_params('image.shapes.SmallConvPipe')
    params.input.train.Set(data_dir=data_dir, shuffle_buffer=4096)
    options = runtime_options.RuntimeOptions(max_steps=2, save_interval_steps=2)
    trainer = train_job.Trainer(params, str(tmp_path), options)
    assert trainer.run() == 2
    path = checkpoints.latest(str(tmp_path))
    saved = dict(tf.train.list_variables(path))
    input_entries = {name: shape for name, shape in saved.items()
                     if name.startswith('iterator/')}
    assert input_entries == {'iterator/epoch/.ATTRIBUTES/VARIABLE_VALUE': [],
                             'iterator/index/.ATTRIBUTES/VARIABLE_VALUE': []}
    reader = tf.train.load_checkpoint(path)
    assert reader.get_tensor('iterator/index/.ATTRIBUTES/VARIABLE_VALUE') == 2 * 16
    data_bytes = sum(os.path.getsize(os.path.join(str(tmp_path), f))
                     for f in os.listdir(str(tmp_path)) if f.startswith('ckpt-2.'))
    assert data_bytes < 100_000  # a 4096-image buffer alone would be 3 MB


def test_a_share_reads_its_examples_of_each_batch_and_its_position_restores_into_any_share(
        data_dir, tmp_path):
    """A trainer client's iterator (Iterator(share)): across an epoch boundary it yields
    exactly its examples of each whole batch, and its position, which counts whole
    batches, restores into the whole-batch iterator and into another share."""
    tfds_input = _input(data_dir)
    whole = tfds_input.Iterator()
    straight = [next(whole) for _ in range(BATCHES_PER_EPOCH + 3)]
    halves = [tfds_input.Iterator(range(0, 32)), tfds_input.Iterator(range(32, 64))]
    for expected in straight[:BATCHES_PER_EPOCH + 1]:
        got = [next(half) for half in halves]
        for key in ('image', 'label'):
            np.testing.assert_array_equal(
                np.concatenate([g[key].numpy() for g in got]), expected[key].numpy())
    assert halves[0].batch_bytes == halves[1].batch_bytes == whole.batch_bytes // 2
    for half in halves:
        assert (int(half.epoch.numpy()), int(half.index.numpy())) == (1, 64)
    path = tf.train.Checkpoint(iterator=halves[1]).save(str(tmp_path / 'share' / 'ckpt'))
    for resumed, share in ((tfds_input.Iterator(), range(64)),
                           (tfds_input.Iterator(range(10, 21)), range(10, 21))):
        tf.train.Checkpoint(iterator=resumed).restore(path).assert_consumed()
        for expected in straight[BATCHES_PER_EPOCH + 1:]:
            np.testing.assert_array_equal(next(resumed)['label'].numpy(),
                                          expected['label'].numpy()[share.start:share.stop])
