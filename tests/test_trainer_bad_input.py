"""Bad input to the trainer: exit status 2, one line naming the fix, logdir unchanged."""
import os

import pytest

from tests import trainer_helpers as th
from tfpipe import checkpoints


@pytest.fixture(scope='module')
def trained(tmp_path_factory, trained_2_steps):
    """This module's own copy: its tests check that nothing in it changes."""
    return trained_2_steps.copy_to(tmp_path_factory.mktemp('trained') / 'run')


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


def test_unreadable_checkpoint(tmp_path, data_dir, trained_2_steps):
    logdir = trained_2_steps.copy_to(tmp_path / 'run')
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


def test_evaler_on_an_unreadable_checkpoint(tmp_path, data_dir, trained_2_steps):
    logdir = trained_2_steps.copy_to(tmp_path / 'run')
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


def _copy_of(trained, tmp_path):
    import shutil
    logdir = str(tmp_path / 'copy')
    shutil.copytree(trained, logdir)
    return logdir


def _truncate(path, size):
    with open(path, 'r+b') as f:
        f.truncate(size)


def _case_logdir_is_a_file(trained, tmp_path):
    path = tmp_path / 'a_file'
    path.write_text('not a directory\n')
    return str(path), [], r'--logdir \S+/a_file is a file: give a directory path'


def _case_truncated_data_file(trained, tmp_path):
    logdir = _copy_of(trained, tmp_path)
    _truncate(os.path.join(logdir, 'train', 'ckpt-2.data-00000-of-00001'), 1000)
    return logdir, [], r'checkpoint \S+/ckpt-2 cannot be restored .*move it out of the train dir'


def _case_gin_syntax_error(trained, tmp_path):
    path = tmp_path / 'bad.gin'
    path.write_text('trainer.save_interval_steps = \n')
    return trained, [f'--gin_file={path}'], r'gin: \S+/bad.gin line 1: .*fix the binding'


def _case_tfds_data_dir_is_a_file(trained, tmp_path):
    path = tmp_path / 'a_file'
    path.write_text('not a directory\n')
    return str(tmp_path / 'fresh'), [f'--tfds_data_dir={path}'], \
        r'--tfds_data_dir \S+/a_file is a file: give a directory path'


def _case_no_logical_cpus(trained, tmp_path):
    return (str(tmp_path / 'fresh'), ['--num_logical_cpus=0'],
            r'--num_logical_cpus=0 must be >= 1')


def _case_gpu_without_a_gpu(trained, tmp_path):
    import tensorflow as tf
    assert not tf.config.list_physical_devices('GPU'), 'this case needs a machine without GPU'
    return (str(tmp_path / 'fresh'), ['--run_locally=gpu'],
            r'^error: (?!.*num_logical_cpus)--run_locally=gpu but TensorFlow sees no GPU on '
            r'this machine: use --run_locally=cpu')  # not --num_logical_cpus: gpu ignores it


def _case_refused_params_file(trained, tmp_path):
    logdir = _copy_of(trained, tmp_path)
    with open(os.path.join(logdir, 'train', 'params.txt'), 'a') as f:
        f.write('task.train.max_stepz : 3\n')
    return logdir, [], r'\S+/copy/train/params.txt: .*max_stepz.*use a new --logdir'


def _case_garbled_state_file(trained, tmp_path):
    logdir = _copy_of(trained, tmp_path)
    with open(os.path.join(logdir, 'train', 'checkpoint'), 'w') as f:
        f.write('model_checkpoint_path: "ckpt-2\n')  # cut off mid-string
    return logdir, [], (r'\S+/copy/train/checkpoint is unreadable; the newest readable '
                        r'checkpoint there is ckpt-2: to resume from it, write the line '
                        r'\'model_checkpoint_path: "ckpt-2"\' into \S+/train/checkpoint')


# Each costs a process; variants of the same check are unit tests in test_trainer_logdir.py.
MORE_CASES = [_case_logdir_is_a_file, _case_truncated_data_file, _case_gin_syntax_error,
              _case_tfds_data_dir_is_a_file, _case_no_logical_cpus, _case_gpu_without_a_gpu,
              _case_refused_params_file, _case_garbled_state_file]


@pytest.mark.parametrize('case', MORE_CASES, ids=[c.__name__[6:] for c in MORE_CASES])
def test_bad_environment_is_one_line_and_exit_2(trained, data_dir, tmp_path, case):
    """Each ended in a traceback (or, for the state file, in training from step 0)."""
    import re
    logdir, flags, message = case(trained, tmp_path)
    existed = os.path.exists(logdir)
    before, before_tmp = th.snapshot(trained), th.snapshot(str(tmp_path))
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(4, 2), *flags)  # flags win
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(message, th.error_line(result)), th.error_line(result)
    assert 'Traceback' not in result.stderr
    assert th.snapshot(trained) == before
    assert th.snapshot(str(tmp_path)) == before_tmp  # the copies and files are unchanged too
    assert os.path.exists(logdir) == existed


@pytest.fixture
def read_only_copy(trained, tmp_path):
    """A copy of `trained` on a tmpfs mounted read-only (root writes through chmod)."""
    import shutil
    import subprocess
    mount = tmp_path / 'ro'
    mount.mkdir()
    if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=16m', 'tmpfs', str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip('needs permission to mount a tmpfs (root)')
    try:
        shutil.copytree(trained, str(mount / 'run'))
        subprocess.run(['mount', '-o', 'remount,ro', str(mount)], check=True)
        yield str(mount / 'run')
    finally:
        subprocess.run(['umount', str(mount)], check=True)


def test_read_only_logdir(read_only_copy, data_dir):
    before = th.snapshot(read_only_copy)
    result = th.run(th.FAST, read_only_copy, data_dir, *th.fast_flags(4, 2))
    assert result.returncode == 2, result.stderr[-3000:]
    assert th.error_line(result) == (f'error: --logdir {read_only_copy} is not writable: give '
                                     'a directory this user can write, e.g. under /tmp')
    assert th.snapshot(read_only_copy) == before


@pytest.mark.parametrize('flags', [['--job=trainr'], ['--pipeline_trace_step=3']])
def test_bad_flags_are_refused_before_tensorflow_loads(tmp_path, data_dir, flags):
    """A refusal that needs no model is cheap: ~0.1 s of CPU instead of TensorFlow's ~3 s
    import (trainer/main.py `_check_flags_before_tensorflow`). -X importtime lists every
    module the process imported."""
    import subprocess
    import sys
    logdir = str(tmp_path / 'fresh')
    cmd = th.command(th.FAST, logdir, data_dir, '--max_steps=2', *flags)
    assert cmd[0] == sys.executable
    result = subprocess.run([sys.executable, '-X', 'importtime', *cmd[1:]], env=th.env(),
                            cwd=th.REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert flags[0].split('=')[0] in th.error_line(result)
    imported = [line.rsplit('|', 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith('import time:')]
    assert 'tfpipe' in imported and 'tensorflow' not in imported
    assert not os.path.exists(logdir)
