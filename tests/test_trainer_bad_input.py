"""Bad input to the trainer: exit status 2, one line naming the fix, logdir unchanged."""
import os

import pytest

from tests import trainer_helpers as th
from tfpipe import checkpoints


@pytest.fixture(scope='module')
def trained(tmp_path_factory, data_dir):
    logdir = str(tmp_path_factory.mktemp('trained') / 'run')
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(2, 2))
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir


CASES = [
    ('unknown model', 'image.shapes.SmallConvPip', [], r"unknown model 'image.shapes.SmallConvPip'"
     r".*did you mean image.shapes.SmallConvPipe"),
    ('override typo', th.FAST, [th.overrides(**{'task.train.max_step': 3})],
     r"did you mean 'max_steps'"),
    ('wrong type', th.FAST, ["--params_override=task.train.max_steps='many'"], r'max_steps'),
    ('bad balance', th.FAST, [th.overrides(**{'task.pipeline.balance': [2, 2]})],
     r'covers 4 layers but the body has 5'),
    ('missing data', 'image.cifar10.AmoebaNetD', [], r'cifar10.*tfds build'),
    ('another model', 'mt.reverse.TransformerPipe', [],
     r'holds checkpoints of model image.shapes.SmallConvPipe.*new --logdir'),
    ('bad job', th.FAST, ['--job=trainr'], r"unknown --job 'trainr'"),
]


@pytest.mark.parametrize('what,model,flags,message', CASES, ids=[c[0] for c in CASES])
def test_bad_input_leaves_logdir_unchanged(trained, data_dir, what, model, flags,
                                           message, tmp_path):
    import re
    logdir, data = trained, data_dir
    if what == 'missing data':  # a fresh logdir: it must not even be created
        logdir, data = str(tmp_path / 'fresh'), str(tmp_path / 'empty_tfds')
    before = th.snapshot(trained)
    result = th.run(model, logdir, data, '--max_steps=3', *flags)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(message, th.error_line(result)), th.error_line(result)
    assert th.snapshot(trained) == before
    assert os.path.exists(logdir) == (logdir == trained)


def test_unreadable_checkpoint(tmp_path, data_dir):
    logdir = str(tmp_path / 'run')
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(2, 2))
    assert result.returncode == 0, result.stderr[-3000:]
    latest = checkpoints.latest(os.path.join(logdir, 'train'))
    for path in [latest + '.index']:
        with open(path, 'r+b') as f:
            f.seek(0)
            f.write(b'\0garbage' * 8)
    before = th.snapshot(logdir)
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(4, 2))
    assert result.returncode == 2
    assert 'unreadable' in th.error_line(result) or 'cannot be restored' in th.error_line(result)
    assert th.snapshot(logdir) == before


def test_evaler_on_an_unreadable_checkpoint(tmp_path, data_dir):
    logdir = str(tmp_path / 'run')
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(2, 2))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(checkpoints.latest(os.path.join(logdir, 'train')) + '.index', 'r+b') as f:
        f.write(b'\0garbage' * 8)
    before = th.snapshot(logdir)
    result = th.run(th.FAST, logdir, data_dir, '--job=evaler_dev', '--max_steps=2')
    assert result.returncode == 2, result.stderr[-3000:]
    assert 'unreadable' in th.error_line(result)
    assert th.snapshot(logdir) == before


def test_evaler_with_missing_data(tmp_path):
    logdir = str(tmp_path / 'fresh')
    result = th.run('image.cifar10.AmoebaNetD', logdir, str(tmp_path / 'empty'),
                    '--job=evaler_test')
    assert result.returncode == 2, result.stderr[-3000:]
    assert 'tfds build cifar10' in th.error_line(result)
    assert not os.path.exists(logdir)


@pytest.mark.parametrize('flags,message', [
    ([th.overrides(**{'input.train.batch_size': 8})],
     r'input.train changed since the checkpoints.*batch_size : 16 -> 8.*new --logdir'),
    (['--gin_bindings=trainer.save_interval_steps=0'], r'trainer.save_interval_steps=0 must be'),
    ([th.overrides(**{'task.train.summary_interval_steps': 0})],
     r'task.train.summary_interval_steps=0 must be an int >= 1'),
    (['--job=evaler_dev,evaler_dev'], r'names a job twice'),
])
def test_bad_resume_and_runtime_knobs(trained, data_dir, flags, message):
    import re
    before = th.snapshot(trained)
    result = th.run(th.FAST, trained, data_dir, '--max_steps=3', *flags)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(message, th.error_line(result)), th.error_line(result)
    assert th.snapshot(trained) == before
