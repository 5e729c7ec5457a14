"""The memory inspect_model predicts against the peak the trainer measures (issue 17).

The logical CPUs of this host share one allocator, so the figure to predict is
the host's: `--mode=inspect_model` prints it (model state, held micro-batches,
the measured working sets of the cells running at once, the input pipeline's
buffers) and the trainer's progress line prints the measured peak. Both run as
the user runs them, in fresh processes with the trainer's BFC allocator; the
trainer job alone (evaler and decoder threads in one process add their own).
"""
import re
import subprocess

import pytest

from tests import trainer_helpers as th

PREDICTED = re.compile(r'host allocator .*: peak ([\d.]+) MiB')
MEASURED = re.compile(r'peak CPU:0 ([\d.]+) MiB')
TOLERANCE = 0.15  # the goal


def _run(tmp_path, model, data_dir, *flags):
    result = th.run(model, str(tmp_path / 'run'), data_dir, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize('model', ['image.shapes.AmoebaNetPipe', 'mt.reverse.TransformerPipe'])
def test_predicted_host_peak_within_15_percent_of_the_trainers(tmp_path, data_dir, model):
    inspect = _run(tmp_path, model, data_dir, '--mode=inspect_model')
    assert 'backward working sets measured' in inspect.stdout
    predicted = float(PREDICTED.findall(inspect.stdout)[-1])
    trained = _run(tmp_path, model, data_dir, '--job=trainer', '--max_steps=10')
    measured = float(MEASURED.findall(trained.stderr)[-1])
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted, measured)


def test_without_allocator_statistics_the_working_set_is_an_estimate_and_says_so(
        tmp_path, data_dir):
    env = {**th.env(), 'TF_CPU_ALLOCATOR_USE_BFC': 'false'}
    result = subprocess.run(th.command(th.FAST, str(tmp_path / 'run'), data_dir,
                                       '--mode=inspect_model'),
                            env=env, cwd=th.REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'estimated from layer outputs: the allocator keeps no statistics' in result.stdout
    assert 'all devices' in result.stdout and 'host allocator' not in result.stdout
