"""Measured peak bytes per device: which allocators, and the trainer's report of them."""
import glob
import os
import re

import tensorflow as tf

from tfpipe import memory_stats


def test_one_allocator_for_all_logical_cpus_and_none_for_another_process():
    devices = ['/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:3',
               '/job:worker/replica:0/task:1/device:CPU:0', 'GPU:1']
    assert memory_stats.allocator_devices(devices) == ['CPU:0', 'GPU:1']


def test_an_allocator_without_statistics_is_left_out():
    # pytest's process loads TensorFlow with whichever CPU allocator its environment chose;
    # the default one keeps no peak (it raises or answers 0) and must be left out.
    try:
        keeps = tf.config.experimental.get_memory_info('CPU:0')['peak'] > 0
    except (ValueError, tf.errors.InvalidArgumentError):
        keeps = False
    peaks = memory_stats.peak_bytes(['CPU:0', '/job:worker/replica:0/task:1/device:CPU:0'])
    if keeps:
        assert list(peaks) == ['CPU:0'] and peaks['CPU:0'] > 0
    else:
        assert peaks == {}
        assert memory_stats.format_peaks({}) == ''
    assert memory_stats.format_peaks({'CPU:0': 3 * 2 ** 20}) == 'peak CPU:0 3.0 MiB'


def test_trainer_reports_the_peak_in_its_progress_line_and_summaries(trained_4_steps):
    """`python -m trainer` turns the BFC allocator on unless told otherwise."""
    lines = [line for line in trained_4_steps.stderr.splitlines() if 'step 4/4' in line]
    match = re.search(r'peak CPU:0 ([\d.]+) MiB', lines[-1])
    assert match and float(match.group(1)) > 0, lines
    peaks = []
    train_dir = os.path.join(trained_4_steps.logdir, 'train')
    for path in glob.glob(os.path.join(train_dir, 'events.out.tfevents.*')):
        for event in tf.compat.v1.train.summary_iterator(path):
            peaks += [tf.make_ndarray(v.tensor) for v in event.summary.value
                      if v.tag == 'peak_bytes/CPU:0']
    assert len(peaks) >= 1 and all(p > 0 for p in peaks)
    # The summary and the line report the same allocator peak (MiB rounded to 0.1).
    assert abs(peaks[-1] / 2 ** 20 - float(match.group(1))) <= 0.05
