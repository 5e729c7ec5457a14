"""The trainer binary end to end, in subprocesses (signals and kill -9 need them)."""
import glob
import json
import os
import re
import signal
import time

import numpy as np
import pytest

from tests import trainer_helpers as th
from tfpipe import checkpoints


def test_train_then_evaler_and_decoder(tmp_path, data_dir, trained_4_steps):
    stderr = trained_4_steps.stderr
    assert 'step 4/4' in stderr and 'steps/s' in stderr and 'ETA' in stderr
    first = next(line for line in stderr.splitlines() if 'step 1/4' in line)
    assert 'first step' in first and 'steps/s' not in first  # tracing is not a step rate
    last = next(line for line in stderr.splitlines() if 'step 4/4' in line)
    assert re.search(r'steps/s  [0-9.]+ examples/s  MFU [0-9.]+%  HFU [0-9.]+%', last), last
    # Before the first step traced, the host memory it adds, predicted: a lower bound of
    # what the allocator then measured (which also holds the weights and slots).
    need = re.search(r'host memory: the first step needs at least ([\d.]+) MiB more',
                     stderr)
    assert need and stderr.index(need.group(0)) < stderr.index('step 1/4'), stderr[-3000:]
    peak = re.search(r'peak CPU:0 ([\d.]+) MiB', last)
    assert peak and 0 < float(need.group(1)) <= float(peak.group(1)), (need, last)
    logdir = trained_4_steps.copy_to(tmp_path / 'run')
    train_dir = os.path.join(logdir, 'train')
    assert checkpoints.step_of(checkpoints.latest(train_dir)) == 4
    with open(os.path.join(train_dir, 'params.txt')) as f:
        assert "task.pipeline.balance : [3, 2]" in f.read()
    assert glob.glob(os.path.join(train_dir, 'events.out.tfevents.*'))
    result = th.run(th.FAST, logdir, data_dir, '--job=evaler_dev,decoder_test', '--max_steps=4',
                    th.overrides(**{'task.eval.samples_per_summary': 64,
                                    'task.eval.decoder_samples_per_summary': 32}))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(logdir, 'eval_dev', 'score-4.txt')) as f:
        scores = dict(line.split(': ') for line in f.read().splitlines())
    assert set(scores) == {'loss', 'accuracy', 'num_examples'}
    assert 0 <= float(scores['accuracy']) <= 1 and scores['num_examples'] == '64'
    with open(os.path.join(logdir, 'decoder_test', 'decoder_out-4.jsonl')) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 32 and set(records[0]) == {'label', 'prediction', 'confidence'}
    assert os.path.exists(os.path.join(logdir, 'eval_dev', 'params.txt'))
    # A restarted evaler does not redo the checkpoint it already processed.
    before = th.snapshot(os.path.join(logdir, 'eval_dev'))
    result = th.run(th.FAST, logdir, data_dir, '--job=evaler_dev', '--max_steps=4')
    assert result.returncode == 0, result.stderr[-3000:]
    after = th.snapshot(os.path.join(logdir, 'eval_dev'))
    assert after['score-4.txt'] == before['score-4.txt']


def test_kill_9_then_resume_equals_uninterrupted_run(tmp_path, data_dir):
    steps = 60
    straight = str(tmp_path / 'straight')
    result = th.run(th.FAST, straight, data_dir, *th.fast_flags(steps, 4))
    assert result.returncode == 0, result.stderr[-3000:]

    killed = str(tmp_path / 'killed')
    proc = th.start(th.FAST, killed, data_dir, *th.fast_flags(steps, 4))
    train_dir = os.path.join(killed, 'train')
    deadline = time.time() + 240
    while time.time() < deadline:
        path = checkpoints.latest(train_dir) if os.path.isdir(train_dir) else None
        if path and checkpoints.step_of(path) >= 4:
            break
        time.sleep(0.01)
    proc.kill()  # SIGKILL, at whatever point the trainer is
    proc.wait()
    interrupted_at = checkpoints.step_of(checkpoints.latest(train_dir))
    assert 4 <= interrupted_at < steps
    result = th.run(th.FAST, killed, data_dir, *th.fast_flags(steps, 4))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'at step {interrupted_at}' in result.stderr  # resumed, not restarted
    final = checkpoints.latest(train_dir)
    assert checkpoints.step_of(final) == steps
    expected = th.model_values(checkpoints.latest(os.path.join(straight, 'train')))
    actual = th.model_values(final)
    assert expected.keys() == actual.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-7,
                                   err_msg=name)


def test_resume_with_another_balance_restores_the_values(tmp_path, data_dir, trained_2_steps):
    logdir = trained_2_steps.copy_to(tmp_path / 'run')
    train_dir = os.path.join(logdir, 'train')
    saved = th.model_values(checkpoints.latest(train_dir))
    # Learning rate 0: the step-3 checkpoint must hold exactly the restored values. A
    # restore that fell back to initial weights (or lost a layer) would differ.
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(3, 3),
                    th.overrides(**{'task.pipeline.balance': [1, 1, 3],
                                    'task.train.learning_rate': 0.0}), '--mode=sync')
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'restored' in result.stderr and 'step 3/3' in result.stderr
    assert checkpoints.step_of(checkpoints.latest(train_dir)) == 3
    resumed = th.model_values(checkpoints.latest(train_dir))
    assert saved.keys() == resumed.keys()
    for name in saved:
        np.testing.assert_array_equal(resumed[name], saved[name], err_msg=name)


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_exits_zero(tmp_path, data_dir, sig):
    logdir = str(tmp_path / 'run')
    proc = th.start(th.FAST, logdir, data_dir, *th.fast_flags(100000, 100000))
    out = ''
    deadline = time.time() + 240
    while time.time() < deadline:
        line = proc.stdout.readline()
        out += line
        if 'step 3/' in line:
            break
    proc.send_signal(sig)
    out += proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert 'saving a checkpoint' in out
    step = checkpoints.step_of(checkpoints.latest(os.path.join(logdir, 'train')))
    assert 3 <= step < 100000


@pytest.mark.parametrize('learning_rate', [1e30, 1e39])  # NaN loss; weights overflowing
def test_non_finite_training_stops_and_keeps_the_last_good_checkpoint(tmp_path, data_dir,
                                                                      trained_2_steps,
                                                                      learning_rate):
    logdir = trained_2_steps.copy_to(tmp_path / 'run')
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(50, 1),
                    th.overrides(**{'task.train.learning_rate': learning_rate}))
    assert result.returncode == 3  # trainer/exit_codes.py: EXIT_NON_FINITE
    assert 'training stopped' in th.error_line(result)
    train_dir = os.path.join(logdir, 'train')
    for path in checkpoints.tf.train.get_checkpoint_state(train_dir).all_model_checkpoint_paths:
        values = th.model_values(path)
        assert all(np.isfinite(v).all() for v in values.values()), path


def test_transformer_trains_and_decodes(reverse_trained):
    # The trainer and its decoder ran in one process (session fixture reverse_trained): the
    # decoder decoded the checkpoint the trainer saved at step 2.
    logdir = reverse_trained.logdir
    with open(os.path.join(logdir, 'decoder_test', 'decoder_out-2.jsonl')) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 32 and set(records[0]) == {'src', 'ref', 'hyp'}
    assert all(r['ref'] == r['src'][::-1] for r in records)
    with open(os.path.join(logdir, 'decoder_test', 'score-2.txt')) as f:
        assert {line.split(':')[0] for line in f} == {'bleu', 'exact_match', 'num_examples'}


def test_inspect_modes_print_and_write_nothing(tmp_path, data_dir):
    logdir = str(tmp_path / 'never')
    result = th.run(th.FAST, logdir, data_dir, '--mode=inspect_model')
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'cell 0 on /job:localhost/replica:0/task:0/device:CPU:0' in result.stdout
    assert 'task/pipe/conv0/w [3, 3, 3, 8]' in result.stdout
    result = th.run(th.FAST, logdir, data_dir, '--mode=inspect_params')
    assert result.returncode == 0 and 'task.train.max_steps : 200' in result.stdout
    assert not os.path.exists(logdir)


def test_list_models():
    result = th.run(th.FAST, '/nonexistent', '/nonexistent', '--list_models')
    assert result.returncode == 0
    assert 'image.shapes.AmoebaNetPipe' in result.stdout.split()


def test_default_jobs_run_trainer_evaler_and_decoder_in_one_process(tmp_path, data_dir):
    import tensorflow as tf
    logdir = str(tmp_path / 'run')
    result = th.run(th.FAST, logdir, data_dir, '--run_locally=cpu', '--max_steps=4',
                    '--gin_bindings=trainer.save_interval_steps=2',
                    '--gin_bindings=trainer.summary_interval_steps=1',
                    th.overrides(**{'task.eval.samples_per_summary': 32,
                                    'task.eval.decoder_samples_per_summary': 16}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(os.path.join(logdir, 'eval_dev', 'score-4.txt'))
    assert os.path.exists(os.path.join(logdir, 'decoder_test', 'decoder_out-4.jsonl'))
    tags = set()
    for path in glob.glob(os.path.join(logdir, 'train', 'events.out.tfevents.*')):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags |= {v.tag for v in event.summary.value}
    assert {'loss', 'learning_rate', 'grad_norm', 'examples_per_sec', 'steps_per_sec'} <= tags


@pytest.fixture(scope='module')
def standalone_evaler(tmp_path_factory, data_dir, trained_2_steps):
    """An evaler alone (no --max_steps) on a copy of the 2-step run, beside a checkpoint
    being written: data files exist, the state file does not list it yet."""
    logdir = trained_2_steps.copy_to(tmp_path_factory.mktemp('standalone_evaler') / 'run')
    train_dir = os.path.join(logdir, 'train')
    for suffix in ('.index', '.data-00000-of-00001'):
        with open(os.path.join(train_dir, f'ckpt-9{suffix}'), 'wb') as f:
            f.write(b'half written')
    result = th.run(th.FAST, logdir, data_dir, '--job=evaler_dev',
                    th.overrides(**{'task.eval.samples_per_summary': 32}))
    return logdir, result


def test_evaler_reads_only_checkpoints_listed_as_complete(standalone_evaler):
    logdir, result = standalone_evaler
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.listdir(os.path.join(logdir, 'eval_dev')).count('score-2.txt') == 1
    assert not os.path.exists(os.path.join(logdir, 'eval_dev', 'score-9.txt'))


def test_a_checkpoint_moved_away_falls_back_to_the_previous_one(tmp_path, data_dir,
                                                                trained_4_steps):
    logdir = trained_4_steps.copy_to(tmp_path / 'run')
    train_dir = os.path.join(logdir, 'train')
    for path in glob.glob(os.path.join(train_dir, 'ckpt-4.*')):
        os.rename(path, str(tmp_path / os.path.basename(path)))
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(6, 2))
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'ckpt-2 at step 2' in result.stderr and 'trained steps 2..6' in result.stderr


def test_standalone_evaler_stops_at_the_trainers_last_step(standalone_evaler):
    logdir, result = standalone_evaler  # it ended by itself (within th.run's time limit)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(os.path.join(logdir, 'eval_dev', 'score-2.txt'))
