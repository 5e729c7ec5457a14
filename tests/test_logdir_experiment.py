"""One logdir, one experiment (issue 25): every job and mode on a logdir builds the params
its trainer recorded; flags that would change the model exit 2 naming the keys; a
checkpoint of another model or optimizer is refused naming what changed; a learning-rate
schedule's horizon follows max_steps unless set.

One TinyTransformerLM run with 4 heads instead of 2 (the shapes fit either way, so only
the recorded params tell them apart) is shared by the tests that start processes.
"""
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tests import trainer_helpers as th
from tfpipe import checkpoints, lr_schedules, optimizers
from trainer import eval_jobs, experiment

LM = 'lm.pystdlib.TinyTransformerLM'
HEADS = 'task.pipeline.body[2].num_heads'
# Model keys (4 heads, not 2) and job keys (fewer eval and decoder examples) as the trainer
# records them; and a cosine schedule that ends before the run, for the warning line.
LM_OVERRIDES = {HEADS: 4, 'task.pipeline.body[3].num_heads': 4,
                'task.eval.samples_per_summary': 16,
                'task.eval.decoder_samples_per_summary': 2}
LM_SCHEDULE = ('task.train.lr_schedule=Params(cls=tfpipe.lr_schedules.Cosine),'
               'task.train.lr_schedule.warmup_steps=0,task.train.lr_schedule.total_steps=1')


@pytest.fixture(scope='module')
def lm_logdir(tmp_path_factory, data_dir):
    logdir = str(tmp_path_factory.mktemp('lm_4_heads') / 'run')
    result = th.run(LM, logdir, data_dir, *th.fast_flags(2, 2),
                    th.overrides(**LM_OVERRIDES) + ',' + LM_SCHEDULE)
    assert result.returncode == 0, result.stderr[-3000:]
    return th.TrainedRun(logdir, result.stderr)


def _write_record(tmp_path, model: str, overrides: str) -> str:
    """A logdir whose trainer recorded `model` with `overrides` (no checkpoints needed)."""
    logdir = str(tmp_path / 'run')
    os.makedirs(os.path.join(logdir, 'train'))
    experiment.write_job_files(logdir, os.path.join(logdir, 'train'), model,
                               experiment.load_params(model, overrides))
    return logdir


# --- params of a logdir, in this process -------------------------------------------------

def test_a_job_builds_the_recorded_model_with_its_own_job_keys_on_top(tmp_path):
    logdir = _write_record(tmp_path, LM, f'{HEADS}=4,task.eval.samples_per_summary=32,'
                                         'task.decoder.top_k=5')
    mine = experiment.load_params(LM, 'task.eval.samples_per_summary=16,'
                                      'task.pipeline.num_micro_batches=4')
    params = experiment.params_for_logdir(mine, logdir, LM, ['task.eval.samples_per_summary'])
    assert params.task.pipeline.body[2].num_heads == 4  # recorded, not the model's 2
    assert params.task.decoder.top_k == 5  # a recorded job key the command leaves alone
    assert params.task.eval.samples_per_summary == 16  # the command's job keys win
    assert params.task.pipeline.num_micro_batches == 4
    bf16 = experiment.load_params(LM, 'task.fprop_dtype=tf.bfloat16')  # a job's precision
    assert experiment.params_for_logdir(bf16, logdir, LM).task.fprop_dtype == tf.bfloat16
    fresh = str(tmp_path / 'fresh')  # no trainer yet: the command's params as they are
    assert experiment.params_for_logdir(mine, fresh, LM) is mine


@pytest.mark.parametrize('override', [
    f'{HEADS}=2',  # the model's default, different from the record: still refused
    'task.pipeline.body[3].hidden_dim=64',
    'task.dtype=tf.bfloat16',
])
def test_an_override_that_changes_the_recorded_model_is_refused_naming_it(tmp_path, override):
    logdir = _write_record(tmp_path, LM, f'{HEADS}=4')
    key = override.split('=')[0]
    with pytest.raises(ValueError, match=re.escape(key) + r': \S+ -> \S+.*leave these '
                       r'overrides out.*new --logdir'):
        experiment.params_for_logdir(experiment.load_params(LM, override), logdir, LM, [key])


@pytest.mark.parametrize('override', [
    "input.dev.tokenizer='tests.lm_corpus.codepoints'",  # another vocabulary
    "input.train.tokenizer='tests.lm_corpus.codepoints'",
    "input.dev.preprocess='seq2seq_text'",  # another layout of ids
])
def test_a_key_that_decides_what_ids_mean_is_a_model_key(tmp_path, override):
    logdir = _write_record(tmp_path, LM, '')
    key = override.split('=')[0]
    with pytest.raises(ValueError, match=re.escape(key) + r': \S+ -> \S+.*leave these '
                       r'overrides out'):
        experiment.params_for_logdir(experiment.load_params(LM, override), logdir, LM, [key])


def test_a_params_file_that_sets_a_model_key_to_its_default_is_refused(tmp_path):
    logdir = _write_record(tmp_path, LM, f'{HEADS}=4')
    path = tmp_path / 'override.txt'
    path.write_text(f'# the registered default, not the record\n{HEADS} : 2\n'
                    'task.eval.samples_per_summary : 8\n')
    mine = experiment.load_params(LM, params_file_override=str(path))
    named = experiment.override_keys('', str(path))
    assert named == [HEADS, 'task.eval.samples_per_summary']
    with pytest.raises(ValueError, match=re.escape(f'{HEADS}: 4 -> 2')):
        experiment.params_for_logdir(mine, logdir, LM, named)
    path.write_text(f'{HEADS} : 4\ntask.eval.samples_per_summary : 8\n')  # the recorded value
    mine = experiment.load_params(LM, params_file_override=str(path))
    params = experiment.params_for_logdir(mine, logdir, LM, experiment.override_keys('', str(path)))
    assert params.task.eval.samples_per_summary == 8


def test_the_data_dir_is_the_jobs_own(tmp_path):
    logdir = _write_record(tmp_path, th.FAST, 'input.dev.data_dir="/trainer/tfds"')
    params = experiment.params_for_logdir(experiment.load_params(th.FAST), logdir, th.FAST)
    assert params.input.dev.data_dir is None  # filled from --tfds_data_dir by the binary


def test_a_resumed_trainer_refuses_another_model_or_optimizer_naming_the_fix(tmp_path):
    logdir = _write_record(tmp_path, LM, f'{HEADS}=4')
    train_dir = os.path.join(logdir, 'train')
    open(os.path.join(train_dir, 'checkpoint'), 'w').close()
    saved = experiment.saved_train_params(train_dir, experiment.load_params(LM))
    sgd = experiment.load_params(LM, f'{HEADS}=4,task.train.optimizer='
                                     'Params(cls=tfpipe.optimizers.SGD)')
    with pytest.raises(ValueError) as e:
        experiment.check_resumable(saved, sgd, train_dir)
    assert ('task.train.optimizer.cls: tfpipe.optimizers.Adam -> tfpipe.optimizers.SGD'
            in str(e.value))
    assert 'give --params_override=task.train.optimizer=Params(cls=tfpipe.optimizers.Adam)' \
        in str(e.value)
    # The override the message gives resumes: it matches the record.
    fixed = experiment.load_params(LM, f'{HEADS}=4,task.train.optimizer='
                                       'Params(cls=tfpipe.optimizers.Adam)')
    experiment.check_resumable(saved, fixed, train_dir)
    two_heads = experiment.load_params(LM)
    with pytest.raises(ValueError, match=re.escape(f'{HEADS}: 4 -> 2')):
        experiment.check_resumable(saved, two_heads, train_dir)
    # Job keys may change on resume: a longer run, another learning rate or layout.
    experiment.check_resumable(saved, experiment.load_params(
        LM, f'{HEADS}=4,task.train.max_steps=900,task.train.learning_rate=0.1,'
            'task.pipeline.num_micro_batches=4'), train_dir)


# --- checkpoints of another model or optimizer ---------------------------------------------

def _checkpoint(optimizer: type, shape=(2, 3)) -> tf.train.Checkpoint:
    variables = {'pipe/fc3/w': tf.Variable(tf.ones(shape)), 'pipe/fc3/b': tf.Variable(tf.ones([3]))}
    opt = optimizer.Params().Instantiate()
    opt.CreateSlots(variables)
    return checkpoints.make(variables, step=tf.Variable(0, dtype=tf.int64), optimizer=opt)


@pytest.mark.parametrize('optimizer,shape,message', [
    (optimizers.SGD, (2, 3), r'it holds optimizer/_slots/pipe-fc3-b/m, which this optimizer '
                             r'\(SGD\) does not have'),
    (optimizers.Adafactor, (2, 3), r'optimizer/_slots/pipe-fc3-w/vr \[2\] is not in it'),
    (optimizers.Adam, (3, 3), r'model/pipe/fc3/w is float32\[2, 3\] there and '
                              r'float32\[3, 3\] here'),
], ids=['adam_to_sgd', 'adam_to_adafactor', 'reshaped'])
def test_a_checkpoint_of_another_optimizer_or_shape_is_refused_naming_it(
        tmp_path, optimizer, shape, message):
    saved = _checkpoint(optimizers.Adam)
    saved.model['pipe/fc3/b'].assign([7.0, 7.0, 7.0])
    path = saved.save(str(tmp_path / 'ckpt'))
    same = _checkpoint(optimizers.Adam)
    checkpoints.restore(same, path)  # the same model and optimizer restore
    assert float(same.model['pipe/fc3/b'][0]) == 7.0
    target = _checkpoint(optimizer, shape)
    with pytest.raises(checkpoints.CheckpointError) as e:
        checkpoints.restore(target, path)
    assert re.search(message, str(e.value)), str(e.value)
    assert 'another model or optimizer' in str(e.value) and 'new --logdir' in str(e.value)
    assert 'move it out' not in str(e.value)  # the checkpoint is healthy
    assert float(target.model['pipe/fc3/b'][0]) == 1.0  # nothing was restored


def test_an_evaler_restores_a_trainers_checkpoint_without_its_optimizer(tmp_path):
    path = _checkpoint(optimizers.Adam).save(str(tmp_path / 'ckpt'))
    model_only = checkpoints.make({'pipe/fc3/w': tf.Variable(tf.zeros([2, 3])),
                                   'pipe/fc3/b': tf.Variable(tf.zeros([3]))})
    checkpoints.restore(model_only, path, partial=True)
    assert float(model_only.model['pipe/fc3/w'][0, 0]) == 1.0
    fewer = checkpoints.make({'pipe/fc3/w': tf.Variable(tf.zeros([2, 3]))})
    with pytest.raises(checkpoints.CheckpointError, match=r'it holds model/pipe/fc3/b, which '
                       r'this model does not have'):
        checkpoints.restore(fewer, path, partial=True)


# --- the learning-rate schedule's horizon ----------------------------------------------------

def test_small_conv_pipes_cosine_follows_max_steps():
    params = experiment.load_params(th.FAST).task.train.lr_schedule
    assert params.total_steps is None
    horizon = lr_schedules.follow_max_steps(params, 20000)
    assert horizon.params.total_steps == 20000 and not horizon.warn
    assert horizon.message == ('lr_schedule Cosine: total_steps follows max_steps=20000 (set '
                               'task.train.lr_schedule.total_steps to fix it)')
    schedule = horizon.params.Instantiate()
    assert float(schedule.Value(19000)) > 0.005  # the old inherited 1000 gave 0 from 1000 on
    assert float(schedule.Value(20000)) == pytest.approx(0.0, abs=1e-7)
    # AmoebaNetPipe's horizon was its max_steps: the rates at its steps are unchanged.
    amoeba = experiment.load_params('image.shapes.AmoebaNetPipe').task.train
    old = lr_schedules.Cosine.Params().Set(value=1.0, warmup_steps=50, total_steps=1000)
    new = lr_schedules.follow_max_steps(amoeba.lr_schedule, amoeba.max_steps).params
    steps = tf.range(1, 1001)
    np.testing.assert_array_equal(old.Instantiate().Value(steps), new.Instantiate().Value(steps))


def test_an_explicit_horizon_shorter_than_the_run_warns():
    params = lr_schedules.Cosine.Params().Set(warmup_steps=50, total_steps=1000)
    horizon = lr_schedules.follow_max_steps(params, 20000)
    assert horizon.warn and horizon.params.total_steps == 1000
    assert 'total_steps=1000 < max_steps=20000: the last 19000 steps' in horizon.message
    assert not lr_schedules.follow_max_steps(params, 1000).warn
    assert lr_schedules.follow_max_steps(lr_schedules.Constant.Params(), 5).message is None
    with pytest.raises(ValueError, match='total_steps=None follows the run'):
        lr_schedules.Cosine.Params().Instantiate()  # outside the trainer: set it


def test_a_longer_resume_of_a_followed_horizon_names_the_rates_jump():
    """SmallConvPipe's cosine followed max_steps=100 to rate 0; resumed at step 100 with
    max_steps=200 it is a new cosine, 0.0074 at step 101. An explicit horizon, an equal
    max_steps and a step inside the warm-up (both horizons give the ramp) stay quiet."""
    train = experiment.load_params(th.FAST).task.train
    cosine, rate = train.lr_schedule, train.learning_rate
    assert lr_schedules.resumed_horizon_change(cosine, 100, cosine, 200, rate, 100) == (
        'resuming at step 100 with max_steps=200 (the checkpoints were trained with '
        'max_steps=100): lr_schedule Cosine total_steps follows max_steps, so the learning '
        'rate jumps from 0 at step 100 to 0.00741 at step 101 (the old schedule: 0); to keep '
        'the old schedule, set task.train.lr_schedule.total_steps=100')
    fixed = cosine.Copy().Set(total_steps=100)
    for args in ((fixed, 100, fixed, 200, rate, 100), (cosine, 100, cosine, 100, rate, 100),
                 (cosine, 100, cosine, 200, rate, 10), (cosine, 100, cosine, 200, rate, 0)):
        assert lr_schedules.resumed_horizon_change(*args) is None, args
    constant = lr_schedules.Constant.Params()
    assert lr_schedules.resumed_horizon_change(constant, 2, constant, 4, rate, 2) is None


def test_the_trainer_warns_once_when_a_longer_resume_moves_the_cosine(tmp_path, data_dir):
    no_warmup = th.overrides(**{'task.train.lr_schedule.warmup_steps': 0})
    logdir = str(tmp_path / 'run')
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(2, 2), no_warmup)
    assert result.returncode == 0, th.failure(result)
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(4, 2), no_warmup)
    assert result.returncode == 0, th.failure(result)
    lines = [line for line in result.stderr.splitlines() if 'resuming at step 2' in line]
    assert len(lines) == 1 and lines[0].startswith('W'), result.stderr[-3000:]
    # 0.01 * (1 + cos(pi * 3/4)) / 2 at step 3 of the 4-step cosine; 0 at step 2 of 2.
    assert lines[0].endswith(
        'resuming at step 2 with max_steps=4 (the checkpoints were trained with max_steps=2): '
        'lr_schedule Cosine total_steps follows max_steps, so the learning rate jumps from 0 '
        'at step 2 to 0.00146 at step 3 (the old schedule: 0); to keep the old schedule, set '
        'task.train.lr_schedule.total_steps=2'), lines[0]


def test_the_trainer_says_once_that_the_horizon_follows_max_steps(trained_2_steps):
    # Two steps end inside SmallConvPipe's 50 warm-up steps: the schedule stays valid.
    lines = [line for line in trained_2_steps.stderr.splitlines()
             if 'lr_schedule Cosine: total_steps follows max_steps=2' in line]
    assert len(lines) == 1, trained_2_steps.stderr[-3000:]


def test_the_trainer_warns_of_a_horizon_shorter_than_the_run(lm_logdir):
    assert re.search(r'^W.*lr_schedule Cosine: total_steps=1 < max_steps=2: the last 1 steps',
                     lm_logdir.stderr, re.M), lm_logdir.stderr[-3000:]


# --- jobs and modes on a trained logdir (processes) -------------------------------------------

def _scores(path: str) -> dict:
    with open(path) as f:
        return {k: float(v) for k, v in (line.split(': ') for line in f)}


def _score_in_process(params, logdir: str, tmp_path) -> dict:
    """eval_dev's score of ckpt-2 computed here with `params` (on a copy of the logdir)."""
    copy = shutil.copytree(logdir, str(tmp_path / f'copy{len(os.listdir(tmp_path))}'))
    job = eval_jobs.Evaler(params, 'dev', copy, max_steps=2)
    checkpoints.restore(job.checkpoint, os.path.join(copy, 'train', 'ckpt-2'), partial=True)
    os.makedirs(job.job_dir, exist_ok=True)
    job.process(2, tf.summary.create_noop_writer())
    return _scores(os.path.join(job.job_dir, 'score-2.txt'))


def test_evaler_and_decoder_use_the_recorded_params(lm_logdir, data_dir, tmp_path):
    logdir = lm_logdir.copy_to(tmp_path / 'run')
    result = th.run(LM, logdir, data_dir, '--job=evaler_dev,decoder_test')
    assert result.returncode == 0, result.stderr[-3000:]
    scores = _scores(os.path.join(logdir, 'eval_dev', 'score-2.txt'))
    assert scores['num_examples'] == 16  # the recorded samples_per_summary, not 256
    with open(os.path.join(logdir, 'decoder_test', 'decoder_out-2.jsonl')) as f:
        assert len(f.readlines()) == 2
    recorded = experiment.load_params(LM, th.overrides(**LM_OVERRIDES).split('=', 1)[1])
    expected = _score_in_process(recorded, lm_logdir.logdir, tmp_path)
    assert scores == pytest.approx(expected, rel=1e-5)
    two_heads = experiment.load_params(LM, 'task.eval.samples_per_summary=16')
    wrong = _score_in_process(two_heads, lm_logdir.logdir, tmp_path)  # what main computed silently
    assert abs(wrong['log_pplx'] - scores['log_pplx']) > 1e-3, (wrong, scores)


def test_generate_uses_the_recorded_params(lm_logdir, data_dir):
    flags = ['--mode=generate', '--prompt=def ', '--num_new_tokens=4']
    plain = th.run(LM, lm_logdir.logdir, data_dir, *flags)
    repeated = th.run(LM, lm_logdir.logdir, data_dir, *flags, th.overrides(**{HEADS: 4}))
    assert plain.returncode == 0 and repeated.returncode == 0, plain.stderr[-3000:]
    assert json.loads(plain.stdout) == json.loads(repeated.stdout)


@pytest.mark.parametrize('flag, change', [
    (th.overrides(**{HEADS: 2}), f'{HEADS}: 4 -> 2'),
    ("--params_override=input.dev.tokenizer='tests.lm_corpus.codepoints'",
     "input.dev.tokenizer: '' -> 'tests.lm_corpus.codepoints'"),
    ('--params_file_override=FILE', f'{HEADS}: 4 -> 2'),  # the model's default, from a file
])
def test_a_conflicting_override_exits_2_naming_the_key(lm_logdir, data_dir, tmp_path, flag,
                                                       change):
    if flag.endswith('=FILE'):
        path = tmp_path / 'override.txt'
        path.write_text(f'{HEADS} : 2\n')
        flag = flag.replace('FILE', str(path))
    before = th.snapshot(lm_logdir.logdir)
    result = th.run(LM, lm_logdir.logdir, data_dir, '--job=evaler_dev', flag)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(re.escape(change) + '.*leave these overrides out', th.error_line(result))
    inspect = th.run(LM, lm_logdir.logdir, data_dir, '--mode=inspect_params')
    assert f'{HEADS} : 4' in inspect.stdout, inspect.stderr[-3000:]
    assert th.snapshot(lm_logdir.logdir) == before


@pytest.mark.parametrize('line', ["input.dev.tokenizer : 'evilpkg.tok.tokenize'",
                                  "input.dev.examples_fn : 'evilpkg.tok.make'"])
def test_a_recorded_function_outside_the_trusted_packages_is_never_imported(
        tmp_path, data_dir, line):
    """A params.txt that names a function obeys the rule a class path obeys: the evaler
    refuses it before the import runs the module's top level."""
    package = tmp_path / 'path' / 'evilpkg'
    package.mkdir(parents=True)
    (package / '__init__.py').write_text('')
    (package / 'tok.py').write_text("import pathlib\n"
                                    "pathlib.Path(__file__).with_name('ran').write_text('')\n"
                                    'def tokenize(text):\n    return text\n'
                                    'def make(split):\n    return split\n')
    logdir = _write_record(tmp_path, LM, '')
    path = os.path.join(logdir, 'train', experiment.PARAMS_FILE)
    with open(path, 'a') as f:
        f.write('\n' + line + '\n')
    before = th.snapshot(logdir)
    result = th.run(LM, logdir, data_dir, '--job=evaler_dev',
                    environ={'PYTHONPATH': f'{tmp_path / "path"}:{th.env()["PYTHONPATH"]}'})
    assert result.returncode == 2, result.stderr[-3000:]
    key, value = line.split(' : ')
    assert re.search(rf"{key.split('.')[-1]} {value} names module 'evilpkg.tok', outside the "
                     r'trusted packages .*trust_package', th.error_line(result)), result.stderr
    assert not (package / 'ran').exists()
    assert th.snapshot(logdir) == before


def test_a_trainer_resumed_with_another_optimizer_exits_2_naming_it(lm_logdir, data_dir,
                                                                     trained_2_steps, tmp_path):
    before = th.snapshot(lm_logdir.logdir)
    result = th.run(LM, lm_logdir.logdir, data_dir, *th.fast_flags(4, 2),
                    th.overrides(**LM_OVERRIDES) + ',' + LM_SCHEDULE +
                    ',task.train.optimizer=Params(cls=tfpipe.optimizers.SGD)')
    assert result.returncode == 2, result.stderr[-3000:]
    assert 'task.train.optimizer.cls: tfpipe.optimizers.Adam -> tfpipe.optimizers.SGD' in \
        th.error_line(result)
    assert th.snapshot(lm_logdir.logdir) == before
    # Without the record (an older logdir), the checkpoint itself tells the optimizers apart.
    logdir = trained_2_steps.copy_to(tmp_path / 'run')
    os.remove(os.path.join(logdir, 'train', 'params.txt'))
    before = th.snapshot(logdir)
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(4, 2),
                    '--params_override=task.train.optimizer=Params(cls=tfpipe.optimizers.SGD)')
    assert result.returncode == 2, result.stderr[-3000:]
    line = th.error_line(result)
    assert re.search(r'ckpt-2 was written by another model or optimizer: it holds optimizer/'
                     r'_slots/\S+, which this optimizer \(SGD\) does not have', line), line
    assert 'move it out' not in line
    assert th.snapshot(logdir) == before
