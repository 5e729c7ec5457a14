"""Asynchronous checkpoints in a real trainer: a save in flight is never read, and a
SIGKILL during it resumes from the previous checkpoint to the uninterrupted result."""
import os
import re
import subprocess
import time

import numpy as np

from tests import trainer_helpers as th
from tfpipe import checkpoint_writer, checkpoints


def test_kill_during_an_async_save_resumes_from_the_previous_checkpoint(tmp_path, data_dir,
                                                                        trained_4_steps):
    logdir = str(tmp_path / 'killed')
    train_dir = os.path.join(logdir, 'train')
    # The writer of ckpt-2 stops once its data files are written, before the state file
    # lists it: step 3 runs beside it, and the save of step 3 waits for it (one in flight).
    proc = th.popen(th.command(th.FAST, logdir, data_dir, *th.fast_flags(4, 1),
                               '--gin_bindings=trainer.async_checkpoints=True'),
                    {**th.env(), checkpoint_writer.HOLD_ENV: '2'}, subprocess.PIPE,
                    subprocess.STDOUT)
    out, deadline = '', time.time() + 240
    while time.time() < deadline and not (f'{checkpoint_writer.HOLD_ENV}: holding' in out
                                          and 'step 3/4' in out):
        line = proc.stdout.readline()
        assert line, out[-3000:]  # the trainer ended early
        out += line
    assert os.path.exists(os.path.join(train_dir, 'ckpt-2.index'))
    assert checkpoints.latest(train_dir) == os.path.join(train_dir, 'ckpt-1'), out[-3000:]
    assert 'step 4/4' not in out  # the save of step 3 waits for the held one
    proc.kill()
    proc.wait()
    assert checkpoints.latest(train_dir) == os.path.join(train_dir, 'ckpt-1')

    # Resumed with synchronous saves (the default): ckpt-1 restores, and steps 2..4 end
    # where the uninterrupted run ended.
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(4, 2),
                    '--gin_bindings=trainer.async_checkpoints=False')
    assert result.returncode == 0, th.failure(result)
    assert re.search(r'restored \S+ckpt-1 at step 1: \d+\.\d+ s, \d+\.\d+ MB', result.stderr)
    assert re.search(r'saved \S+ckpt-4: step 4, \d+\.\d+ s, \d+\.\d+ MB \(synchronous\)',
                     result.stderr)
    final = checkpoints.latest(train_dir)
    assert checkpoints.step_of(final) == 4
    expected = th.model_values(checkpoints.latest(os.path.join(trained_4_steps.logdir,
                                                               'train')))
    actual = th.model_values(final)
    assert expected.keys() == actual.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    # The held save's line names what training waited for while it ran beside step 3.
    assert re.search(r'saved \S+ckpt-1: step 1, \d+\.\d+ s, \d+\.\d+ MB \(asynchronous: '
                     r'training waited \d+\.\d+ s for the snapshot', out), out[-3000:]
