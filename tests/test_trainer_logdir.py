"""What the trainer keeps in its logdir: one job per dir, checkpoints never orphaned,
params.txt of the checkpoints, clean stops (end of data, full disk), honest progress."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from tests import trainer_helpers as th
from tfpipe import checkpoints
from trainer import logdir_access, runtime_options, throughput, train_job

# --- 18: one live job per job dir ------------------------------------------------------


def test_a_second_lock_on_a_job_dir_names_the_holder(tmp_path):
    job_dir = str(tmp_path / 'train')
    first = logdir_access.JobDirLock(job_dir, 'trainer').acquire()
    with pytest.raises(logdir_access.JobDirBusyError) as e:
        logdir_access.JobDirLock(job_dir, 'trainer').acquire()
    assert f'pid {os.getpid()} on host {socket.gethostname()}' in str(e.value)
    assert f'{job_dir}/job.lock' in str(e.value)
    first.release()
    logdir_access.JobDirLock(job_dir, 'trainer').acquire().release()


def test_the_lock_of_a_killed_job_is_released(tmp_path):
    job_dir = str(tmp_path / 'eval_dev')
    code = ('import sys, time; from trainer import logdir_access; '
            f'lock = logdir_access.JobDirLock({job_dir!r}, "evaler_dev").acquire(); '
            'print("locked", flush=True); time.sleep(600)')
    proc = subprocess.Popen([sys.executable, '-c', code], env=th.env(), cwd=th.REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == 'locked'
        with pytest.raises(logdir_access.JobDirBusyError, match=f'pid {proc.pid} on host'):
            logdir_access.JobDirLock(job_dir, 'evaler_dev').acquire()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        logdir_access.JobDirLock(job_dir, 'evaler_dev').acquire().release()
    finally:
        proc.kill()
        proc.wait()


def test_a_logdir_under_a_file_or_on_proc_is_refused_before_writing(tmp_path):
    (tmp_path / 'a_file').write_text('not a directory\n')
    with pytest.raises(ValueError, match=f'--logdir {tmp_path}/a_file/run lies under the file '
                       f'{tmp_path}/a_file: give a directory path'):
        logdir_access.check_directory(str(tmp_path / 'a_file' / 'run'), '--logdir')
    # Root writes through permission bits, and os.access says yes on /proc, which refuses
    # every new directory: the lock, the first write, turns that into a one-line error.
    logdir_access.check_directory('/proc/tfpipe_test_logdir', '--logdir')
    with pytest.raises(ValueError, match=r'cannot write /proc/tfpipe_test_logdir/train/job.lock'
                       r' \(No such file or directory\): give a --logdir on a writable file '
                       r'system'):
        logdir_access.JobDirLock('/proc/tfpipe_test_logdir/train', 'trainer').acquire()
    assert not os.path.exists('/proc/tfpipe_test_logdir')


def _read_until(proc, needle: str, timeout: float = 240) -> str:
    out, deadline = '', time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out += line
        if needle in line:
            return out
    raise AssertionError(f'{needle!r} not seen:\n{out[-3000:]}')


def test_second_trainer_and_second_evaler_are_refused_and_the_evaler_says_it_waits(
        tmp_path, data_dir):
    logdir = str(tmp_path / 'run')
    train_dir = os.path.join(logdir, 'train')
    evaler = th.start(th.FAST, logdir, data_dir, '--job=evaler_dev')
    trainer = th.start(th.FAST, logdir, data_dir, *th.fast_flags(100000, 100000))
    try:
        # A standalone evaler waiting for its first checkpoint says so, and where.
        _read_until(evaler, f'eval_dev: waiting for a checkpoint in {train_dir}')
        _read_until(trainer, 'step 2/')
        trainer.send_signal(signal.SIGSTOP)  # holds its lock without using the CPU
        for job, holder, job_dir in [('trainer', trainer, 'train'),
                                     ('evaler_dev', evaler, 'eval_dev')]:
            lock = os.path.join(logdir, job_dir, 'job.lock')
            with open(lock) as f:
                held = f.read()
            result = th.run(th.FAST, logdir, data_dir, f'--job={job}', '--max_steps=3')
            assert result.returncode == 2, result.stderr[-3000:]
            assert th.error_line(result).startswith(
                f'error: {logdir}/{job_dir} is in use by a running {job}: pid {holder.pid} on '
                f'host {socket.gethostname()} since ')
            with open(lock) as f:
                assert f.read() == held
        assert checkpoints.latest(train_dir) is None  # nobody saved into the held dir
    finally:
        for proc in (trainer, evaler):
            proc.kill()
            proc.wait()


# --- 17: a garbled state file never means "start from step 0" ----------------------------


def _save_checkpoints(directory: str, steps) -> tf.train.CheckpointManager:
    v = tf.Variable(0.0)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), directory, max_to_keep=5,
                                         checkpoint_name='ckpt')
    for step in steps:
        v.assign(float(step))
        manager.save(checkpoint_number=step)
    return manager


def test_garbled_state_file_names_the_newest_readable_checkpoint_and_its_fix_works(tmp_path):
    directory = str(tmp_path)
    _save_checkpoints(directory, [2, 4, 6])
    with open(os.path.join(directory, 'ckpt-6.index'), 'wb') as f:
        f.write(b'\0garbage' * 8)  # the newest is unreadable: ckpt-4 is the one to name
    state = os.path.join(directory, 'checkpoint')
    for garbled in ['', 'model_checkpoint_path: "ckpt', '\x00\xff\x00 binary junk']:
        with open(state, 'w') as f:
            f.write(garbled)
        with pytest.raises(checkpoints.CheckpointError) as e:
            checkpoints.latest(directory)
        assert f'{state} is unreadable; the newest readable checkpoint there is ckpt-4' in str(
            e.value)
    fix = str(e.value).split("write the line '")[1].split("' into")[0]
    with open(state, 'w') as f:
        f.write(fix + '\n')
    assert checkpoints.latest(directory) == os.path.join(directory, 'ckpt-4')


def test_state_file_listing_none_of_the_checkpoints_is_refused(tmp_path):
    directory = str(tmp_path)
    _save_checkpoints(directory, [2])
    with open(os.path.join(directory, 'checkpoint'), 'w') as f:
        f.write('model_checkpoint_path: "ckpt-9"\n')
    with pytest.raises(checkpoints.CheckpointError, match=r"lists checkpoints \['ckpt-9'\] but "
                       r'none of their files exist; the newest readable checkpoint there is '
                       r'ckpt-2'):
        checkpoints.latest(directory)


def test_garbled_state_file_without_checkpoints_is_a_fresh_start(tmp_path):
    with open(tmp_path / 'checkpoint', 'w') as f:
        f.write('garbage {{{')
    assert checkpoints.latest(str(tmp_path)) is None  # nothing to lose


# --- 19: train/params.txt describes the checkpoints ---------------------------------------


def test_params_txt_keeps_describing_the_checkpoints_after_a_dead_attempt(tmp_path, data_dir,
                                                                          trained_2_steps):
    logdir = trained_2_steps.copy_to(tmp_path / 'run')
    train_dir = os.path.join(logdir, 'train')
    with open(os.path.join(train_dir, 'params.txt')) as f:
        of_checkpoints = f.read()
    assert 'task.train.learning_rate : 0.01\n' in of_checkpoints
    # An attempt that dies (NaN) before its first checkpoint.
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(50, 1000),
                    th.overrides(**{'task.train.learning_rate': 1e30}))
    assert result.returncode == 3 and 'training stopped' in th.error_line(result)
    assert checkpoints.step_of(checkpoints.latest(train_dir)) == 2
    with open(os.path.join(train_dir, 'params.txt')) as f:
        assert f.read() == of_checkpoints
    with open(os.path.join(train_dir, 'params-attempt.txt')) as f:
        assert 'task.train.learning_rate : 1e+30\n' in f.read()


_UNRESTORED = 'could not be found in the restored object'


def test_a_resume_warns_only_of_saved_values_that_nothing_restores(tmp_path, data_dir,
                                                                    trained_2_steps):
    """The checkpoint's batch split record is read, never restored into the run; TensorFlow
    printed 3 warning lines about its 'unrestored values' at every resume. A value that
    nothing restores (here `stray`, written beside the run's own) still gets them."""
    clean = trained_2_steps.copy_to(tmp_path / 'clean')
    result = th.run(th.FAST, clean, data_dir, *th.fast_flags(3, 3))
    assert result.returncode == 0, th.failure(result)
    assert 'at step 2' in result.stderr  # resumed
    assert 'unrestored values' not in result.stderr and _UNRESTORED not in result.stderr, [
        line for line in result.stderr.splitlines() if 'restored' in line]

    import model_registry
    from trainer import batch_split
    logdir = trained_2_steps.copy_to(tmp_path / 'stray')
    train_dir = os.path.join(logdir, 'train')
    params = model_registry.get_params(th.FAST)
    params.input.train.data_dir = data_dir
    trainer = train_job.Trainer(params, train_dir, runtime_options.RuntimeOptions(max_steps=3))
    trainer.restore_latest()
    stray = tf.Module()
    stray.value = tf.Variable(1.0)
    tf.train.CheckpointManager(checkpoints.make(
        trainer.task.VariablesByPath(), step=trainer.global_step, optimizer=trainer.optimizer,
        iterator=trainer.iterator, batch_split=batch_split.SplitRecord(trainer.split),
        stray=stray), train_dir, max_to_keep=5).save(checkpoint_number=3)
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(3, 3))
    assert result.returncode == 0, th.failure(result)
    unrestored = [line for line in result.stderr.splitlines() if _UNRESTORED in line]
    assert unrestored and all(line.endswith('(root).stray.value') for line in unrestored), (
        unrestored)


def test_params_txt_records_the_max_steps_gin_set_and_an_evaler_stops_there(tmp_path,
                                                                             data_dir):
    """gin's trainer.max_steps=4 used to leave params.txt at the model's max_steps, so an
    evaler on the logdir waited for a step no trainer would run."""
    logdir = str(tmp_path / 'run')
    result = th.run(th.FAST, logdir, data_dir, '--job=trainer',
                    '--gin_bindings=trainer.max_steps=4',
                    '--gin_bindings=trainer.save_interval_steps=2')
    assert result.returncode == 0, th.failure(result)
    for name in ('params.txt', 'params-attempt.txt'):
        with open(os.path.join(logdir, 'train', name)) as f:
            text = f.read()
        assert 'task.train.max_steps : 4\n' in text, name
        assert 'task.train.save_interval_steps : 2\n' in text, name
    result = th.run(th.FAST, logdir, data_dir, '--job=evaler_dev', timeout=240)
    assert result.returncode == 0, th.failure(result)
    assert os.path.exists(os.path.join(logdir, 'eval_dev'))


# --- 10: a training input that ends ------------------------------------------------------


def test_non_repeating_training_input_stops_cleanly_with_a_checkpoint(tmp_path, data_dir):
    logdir = str(tmp_path / 'run')
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(100, 1000),
                    th.overrides(**{'input.train.repeat': False,
                                    'input.train.split': 'train[:48]'}))  # 3 batches of 16
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'StopIteration' not in result.stderr
    assert ('input.train ran out of data after step 3 of 100 (it does not repeat): saving a '
            'checkpoint and stopping; set input.train.repeat=True') in result.stderr
    assert checkpoints.step_of(checkpoints.latest(os.path.join(logdir, 'train'))) == 3


# --- bad input: a full disk during a save -------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (root mounts it): a real disk that fills up."""
    with th.tmpfs(str(tmp_path / 'disk'), 'size=8m') as mount:
        yield mount


def _fill(directory: str) -> None:
    with open(os.path.join(directory, 'filler'), 'wb', buffering=0) as f:
        for size in (1 << 16, 1):
            try:
                while True:
                    f.write(b'\0' * size)
            except OSError as e:
                assert e.errno == 28, e  # ENOSPC


def test_full_disk_during_a_save_is_one_line_and_leaves_no_partial_checkpoint(small_disk,
                                                                              data_dir):
    # In process: the disk fills up between two saves, as when another job eats it.
    import model_registry
    params = model_registry.get_params(th.FAST)
    for _, input_params in params.input.IterParams():
        if input_params is not None:
            input_params.data_dir = data_dir
    train_dir = os.path.join(small_disk, 'train')
    trainer = train_job.Trainer(params, train_dir, runtime_options.RuntimeOptions(
        max_steps=2, save_interval_steps=2))
    assert trainer.run() == 2
    _fill(small_disk)
    with pytest.raises(checkpoints.CheckpointError) as e:
        trainer.save(3)  # asynchronous (the default): its error comes with the wait
        trainer.wait_for_save()
    assert str(e.value) == (
        f'saving checkpoint ckpt-3 in {train_dir} failed (No space left on device); its '
        'partial files were removed: free space there and restart, which resumes from ckpt-2')
    assert not [n for n in os.listdir(train_dir) if n.startswith('ckpt-3')]
    assert checkpoints.latest(train_dir) == os.path.join(train_dir, 'ckpt-2')
    checkpoints.check_readable(checkpoints.latest(train_dir))


@pytest.mark.parametrize('spare_bytes,failing', [(0, 'job.lock'), (4096, 'model.txt')])
def test_full_disk_at_start_is_one_line_and_leaves_no_temporary_file(small_disk, data_dir,
                                                                     spare_bytes, failing):
    """The trainer's first writes hit a full disk: the lock file, or with one page left
    for the lock, the model and params files. Exit 2 naming the file and the fix,
    nothing half-written left behind."""
    logdir = os.path.join(small_disk, 'run')
    os.makedirs(logdir)  # directory entries fit on a full tmpfs; file contents do not
    spare = os.path.join(small_disk, 'spare')
    with open(spare, 'wb') as f:
        f.write(b'\0' * spare_bytes)
    _fill(small_disk)
    os.remove(spare)
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(2, 2))
    assert result.returncode == 2, result.stderr[-3000:]
    line = th.error_line(result)
    if failing == 'job.lock':
        assert line == (f'error: cannot write {logdir}/train/job.lock (No space left on '
                        'device): free space on the --logdir file system')
        return
    assert line.startswith(
        f'error: No space left on device while writing {logdir}/{failing}'), line
    assert line.endswith(': free some space or point --logdir elsewhere; checkpoints '
                         'already written are intact'), line
    left = [os.path.join(root, n) for root, _, names in os.walk(logdir) for n in names]
    assert not [f for f in left if f.endswith('.tmp') or os.path.getsize(f) == 0
                and not f.endswith('job.lock')], left


def test_a_save_that_loses_a_worker_is_not_reported_as_a_full_disk(tmp_path, data_dir,
                                                                    monkeypatch):
    """Checkpoint values come from the workers: a connection reset during the save must
    reach the cluster watchdog (lost worker, exit 1), not become 'free space there'."""
    import model_registry
    params = model_registry.get_params(th.FAST)
    for _, input_params in params.input.IterParams():
        if input_params is not None:
            input_params.data_dir = data_dir
    train_dir = str(tmp_path / 'train')
    trainer = train_job.Trainer(params, train_dir, runtime_options.RuntimeOptions(
        max_steps=1, save_interval_steps=1))
    assert trainer.run() == 1

    def reset(**kwargs):
        raise tf.errors.UnavailableError(None, None, 'recvmsg: Connection reset by peer')

    monkeypatch.setattr(trainer.manager, 'save', reset)
    with pytest.raises(tf.errors.UnavailableError):
        trainer.save(2)  # asynchronous (the default): its error comes with the wait
        trainer.wait_for_save()
    assert checkpoints.latest(train_dir) == os.path.join(train_dir, 'ckpt-1')


def test_a_failed_write_keeps_the_old_file(small_disk):
    from trainer import logdir_access
    path = os.path.join(small_disk, 'score-1.txt')
    logdir_access.write_file(path, 'old\n')
    _fill(small_disk)
    with pytest.raises(OSError) as e:
        logdir_access.write_file(path, 'x' * (1 << 20))
    assert e.value.errno == 28 and e.value.filename == path
    assert open(path).read() == 'old\n' and not os.path.exists(path + '.tmp')


# --- 15: progress without the first step's tracing ------------------------------------------


def test_rate_and_eta_exclude_the_first_step():
    progress = throughput.Progress(max_steps=102, start_time=1000.0)
    progress.step_done(1, 1060.0)  # the first step traces: 60 s
    assert progress.rate_and_eta(1, 1060.0) == (None, None)
    assert progress.first_step_seconds == 60.0
    for step in range(2, 5):
        progress.step_done(step, 1060.0 + 0.5 * (step - 1))
    rate, eta = progress.rate_and_eta(4, 1061.5)
    assert rate == pytest.approx(2.0) and eta == pytest.approx(49.0)  # 98 steps at 2/s
    progress.step_done(5, 1062.5)  # slower now: the next report measures from step 4
    rate, eta = progress.rate_and_eta(5, 1062.5)
    assert rate == pytest.approx(1.0) and eta == pytest.approx(97.0)
