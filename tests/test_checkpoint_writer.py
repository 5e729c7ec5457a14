"""The checkpoint writer thread, on its own: it writes at the lowest CPU priority (so a
save takes no cores from the step beside it), leaves the caller's priority alone, and
writes the values of the save, not later ones; and inspect_model predicts the bytes its
snapshot copies."""
import os
import sys
import threading

import pytest
import tensorflow as tf

from tfpipe import checkpoint_writer


def _writer(tmp_path, on_written):
    weight = tf.Variable([1.0, 2.0])
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(weight=weight), str(tmp_path),
                                         max_to_keep=2)
    return weight, checkpoint_writer.CheckpointWriter(manager, tf.train.CheckpointOptions(),
                                                      True, on_written)


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='per-thread nice is Linux')
def test_the_writer_thread_runs_at_nice_19_and_the_caller_keeps_its_priority(tmp_path):
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []

    def on_written(record):
        seen.append((threading.get_native_id(),
                     os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), record.step))

    _, writer = _writer(tmp_path, on_written)
    writer.save(1)
    writer.wait()
    assert len(seen) == 1
    thread, nice, step = seen[0]
    assert thread != threading.get_native_id() and step == 1
    assert nice == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller


def test_a_save_writes_the_values_at_the_save_not_later_ones(tmp_path):
    weight, writer = _writer(tmp_path, lambda record: None)
    writer.save(1)
    weight.assign([5.0, 6.0])  # while (or after) the thread writes
    writer.wait()
    restored = tf.Variable([0.0, 0.0])
    tf.train.Checkpoint(weight=restored).restore(str(tmp_path / 'ckpt-1')).expect_partial()
    assert restored.numpy().tolist() == [1.0, 2.0]


def test_inspect_model_predicts_the_snapshots_bytes(tmp_path, data_dir):
    """The host copy an asynchronous save holds (inspect_model's async_checkpoints line) is
    what the writer's snapshot copies from a real trainer's checkpoint after a step."""
    from tests import trainer_helpers as th
    from trainer import experiment, inspect_modes, runtime_options, train_job
    params = experiment.load_params(th.FAST)
    params.input.train.data_dir = data_dir
    trainer = train_job.Trainer(params, str(tmp_path), runtime_options.RuntimeOptions())
    trainer._step(next(trainer.iterator))  # noqa: SLF001 - the slots exist after a step
    _, copied = checkpoint_writer.snapshot(trainer.manager.checkpoint)
    predicted = inspect_modes.checkpointed_bytes(params, trainer.task)
    assert predicted > 0 and abs(predicted - copied) <= 0.01 * copied, (predicted, copied)
