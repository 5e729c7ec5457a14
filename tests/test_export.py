"""--mode=export: SavedModels that TensorFlow loads without tfpipe and that give the evaler's
outputs; bad input refused with one line, exit 2 and nothing written.

Each exported model runs in a subprocess that cannot import tfpipe
(tests/serve_without_tfpipe.py); the reference is the evaler's (and decoder's) own
computation on the same dev batch, in this process, from the same checkpoint.
"""
from __future__ import annotations

import errno
import os
import re
import subprocess
import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from tests import export_helpers, trainer_helpers as th
from tests.export_helpers import SAVED_MODEL_CLI
from tfpipe import checkpoints, export, fprop_context
from tfpipe.tasks.base_task import BaseTask
from tfpipe.tasks.classifier import ImageClassifier
from trainer import eval_jobs, experiment, export_mode

AMOEBA = 'image.shapes.AmoebaNetPipe'
K2_M2 = {'task.pipeline.num_micro_batches': 2}  # SmallConvPipe is K=2, M=2 already
TOL = 1e-5


# -- Helpers --------------------------------------------------------------------------------

def _params(model: str, data_dir: str, overrides: dict):
    params = experiment.load_params(model, th.overrides(**overrides).split('=', 1)[1]
                                    if overrides else '')
    for _, input_params in params.input.IterParams():
        if input_params is not None:
            input_params.data_dir = data_dir
    return params


def _export(model, logdir, data_dir, export_dir, overrides=None, checkpoint=None,
            placement=export.ONE_DEVICE) -> str:
    """--mode=export in this process (the trainer binary's own step)."""
    return export_mode.run(_params(model, data_dir, overrides or {}), logdir, model, checkpoint,
                           str(export_dir), placement, overwrite=False)


def _train(directory, model, data_dir, overrides) -> th.TrainedRun:
    logdir = os.path.join(str(directory), 'run')
    result = th.run(model, logdir, data_dir, *th.fast_flags(2, 2), th.overrides(**overrides))
    assert result.returncode == 0, result.stderr[-3000:]
    return th.TrainedRun(logdir, result.stderr)


def _eval_batch(job) -> dict:
    return next(iter(job._batches(job.task.params.eval.samples_per_summary)))


def _real(batch: dict, key: str) -> np.ndarray:
    return batch[key].numpy()[batch['weight'].numpy() > 0]


def _check_classifier(saved_model, model, logdir, data_dir, step, tmp_path, overrides=None):
    """Exported probabilities == the evaler's predictions (and its loss) within 1e-5."""
    params = _params(model, data_dir, overrides or {})
    evaler = eval_jobs.Evaler(params, 'dev', logdir, max_steps=step)
    checkpoints.restore(evaler.checkpoint, os.path.join(logdir, 'train', f'ckpt-{step}'),
                        partial=True)
    batch = _eval_batch(evaler)
    task = evaler.task

    @tf.function
    def evaler_probabilities(b):
        with fprop_context.evaluation():
            return tf.nn.softmax(task.ComputePredictions(task.theta, b))
    expected = evaler_probabilities(batch).numpy()[batch['weight'].numpy() > 0]
    got = export_helpers.serve(saved_model, {'image': _real(batch, 'image')}, tmp_path)
    np.testing.assert_allclose(got['probabilities'], expected, rtol=TOL, atol=TOL)
    np.testing.assert_array_equal(got['classes'], expected.argmax(-1))
    labels = _real(batch, 'label')
    loss = -np.mean(np.log(got['probabilities'][np.arange(len(labels)), labels]))
    assert abs(loss - float(evaler._metrics(batch)['loss'][0])) <= TOL * max(1.0, loss)


def _devices_in(saved_model: str) -> set[str]:
    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(saved_model, 'saved_model.pb'), 'rb') as f:
        proto.ParseFromString(f.read())
    graph = proto.meta_graphs[0].graph_def
    return {n.device for n in graph.node} | {n.device for fn in graph.library.function
                                             for n in fn.node_def}


# -- The default image family ----------------------------------------------------------------

@pytest.fixture(scope='module')
def cli_export(tmp_path_factory, trained_4_steps, data_dir):
    """SmallConvPipe (K=2, M=2, 4 steps) exported by the trainer binary to its default dir."""
    logdir = trained_4_steps.copy_to(tmp_path_factory.mktemp('cli_export') / 'run')
    result = th.run(th.FAST, logdir, data_dir, '--mode=export')
    assert result.returncode == 0, result.stderr[-3000:]
    saved_model = os.path.join(logdir, 'export', '4')
    assert f'exported SavedModel to {saved_model}' in result.stdout
    return logdir, saved_model


def test_cli_export_matches_the_evaler_and_loads_without_tfpipe(cli_export, data_dir, tmp_path):
    logdir, saved_model = cli_export
    assert _devices_in(saved_model) == {''}  # one_device: the loader places every op
    _check_classifier(saved_model, th.FAST, logdir, data_dir, 4, tmp_path)


def test_the_export_dir_gets_the_users_umask(cli_export):
    _, saved_model = cli_export
    umask = os.umask(0o022)
    os.umask(umask)  # the binary ran with this process's umask
    assert os.stat(saved_model).st_mode & 0o777 == 0o777 & ~umask


def test_a_signature_refuses_inputs_of_another_shape(cli_export):
    _, saved_model = cli_export
    serve = tf.saved_model.load(saved_model).signatures['serving_default']
    assert serve(image=tf.zeros([2, 16, 16, 3]))['classes'].shape == [2]
    # [2, 16, 16, 3, 1]: of a higher rank, whose declared sizes all match (grappler once
    # folded the rank check away and the convolution's kernel failed instead).
    for shape in ([2, 32, 32, 3], [2, 16, 16], [2, 16, 16, 1], [2, 16, 16, 3, 1]):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r'signature serving_default: input image must have shape '
                                 r'\[batch, 16, 16, 3\]'):
            serve(image=tf.zeros(shape))


@pytest.mark.parametrize('as_path', [False, True], ids=['name', 'path'])
def test_named_checkpoint_exports_that_step(trained_4_steps, data_dir, tmp_path, as_path):
    name = 'ckpt-2'
    if as_path:
        name = os.path.join(trained_4_steps.logdir, 'train', name)
    path = _export(th.FAST, trained_4_steps.logdir, data_dir, tmp_path / 'at_2',
                   checkpoint=name)
    _check_classifier(path, th.FAST, trained_4_steps.logdir, data_dir, 2, tmp_path)


def test_a_checkpoint_rotated_out_during_the_export_still_exports(trained_4_steps, data_dir,
                                                                   tmp_path):
    """The trainer deletes a checkpoint (save_max_to_keep) while the export builds the model:
    here the task itself deletes its files, for real, between the pin and the restore."""
    logdir = trained_4_steps.copy_to(tmp_path / 'run')
    prefix = os.path.join(logdir, 'train', 'ckpt-4')

    class RotatedWhileBuilding(ImageClassifier):
        def ServingSignatures(self, features):
            for name in os.listdir(os.path.dirname(prefix)):
                if name.startswith('ckpt-4.'):
                    os.remove(os.path.join(os.path.dirname(prefix), name))
            return super().ServingSignatures(features)

    params = _params(th.FAST, data_dir, {})
    params.task.cls = RotatedWhileBuilding
    target = tmp_path / 'out'
    export.export(params.task, export.feature_specs(params.input.train), prefix, str(target))
    assert not os.path.exists(prefix + '.index')
    assert sorted(os.listdir(tmp_path)) == ['out', 'run']  # the pinned copy is gone too
    reference = _export(th.FAST, trained_4_steps.logdir, data_dir, tmp_path / 'reference')
    image = tf.random.stateless_uniform([3, 16, 16, 3], [1, 2])
    np.testing.assert_array_equal(
        tf.saved_model.load(str(target)).signatures['serving_default'](image=image)[
            'probabilities'],
        tf.saved_model.load(reference).signatures['serving_default'](image=image)[
            'probabilities'])


def test_a_state_file_naming_a_rotated_checkpoint_for_an_instant_is_read_again(
        trained_4_steps, data_dir, tmp_path):
    """A trainer deletes the rotated checkpoint just before it rewrites train/checkpoint:
    for that instant the file names no checkpoint with files. Here it names ckpt-6 until
    a thread writes the real state 0.3 s later, as the trainer would."""
    logdir = trained_4_steps.copy_to(tmp_path / 'run')
    state = os.path.join(logdir, 'train', 'checkpoint')
    with open(state) as f:
        real = f.read()
    with open(state, 'w') as f:
        f.write('model_checkpoint_path: "ckpt-6"\nall_model_checkpoint_paths: "ckpt-6"\n')
    writer = threading.Timer(0.3, lambda: open(state, 'w').write(real))
    writer.start()
    try:
        path = _export(th.FAST, logdir, data_dir, tmp_path / 'out')
    finally:
        writer.join()
    assert tf.saved_model.load(path).signatures['serving_default'](
        image=tf.zeros([1, 16, 16, 3]))['classes'].shape == [1]


def test_the_newest_rotated_out_twice_before_the_pin_is_taken_again(
        trained_4_steps, data_dir, tmp_path, monkeypatch):
    """A trainer saving every step can rotate out the newest checkpoint between the export's
    choice and its pin more than once. Here, after each of the first two choices, the
    checkpoint is really rotated as a trainer with save_max_to_keep=1 does: the next step's
    files written (hard links), train/checkpoint naming only them, the chosen files deleted."""
    logdir = trained_4_steps.copy_to(tmp_path / 'run')
    train_dir = os.path.join(logdir, 'train')
    choose = export_mode._resolve
    chosen = []

    def choose_then_rotate(directory, name):
        path = choose(directory, name)
        chosen.append(os.path.basename(path))
        if len(chosen) <= 2:
            step = checkpoints.step_of(path)
            newer = os.path.join(train_dir, f'ckpt-{step + 1}')
            for file in os.listdir(train_dir):
                if file.startswith(f'ckpt-{step}.'):
                    os.link(os.path.join(train_dir, file), newer + file[len(f'ckpt-{step}'):])
            with open(os.path.join(train_dir, 'checkpoint'), 'w') as f:
                f.write(f'model_checkpoint_path: "ckpt-{step + 1}"\n'
                        f'all_model_checkpoint_paths: "ckpt-{step + 1}"\n')
            for file in os.listdir(train_dir):
                if file.startswith(f'ckpt-{step}.'):
                    os.remove(os.path.join(train_dir, file))
        return path
    monkeypatch.setattr(export_mode, '_resolve', choose_then_rotate)
    path = _export(th.FAST, logdir, data_dir, tmp_path / 'out')
    assert chosen == ['ckpt-4', 'ckpt-5', 'ckpt-6']
    assert tf.saved_model.load(path).signatures['serving_default'](
        image=tf.zeros([1, 16, 16, 3]))['classes'].shape == [1]


def test_a_checkpoint_gone_before_the_pin_is_refused_and_leaves_nothing(trained_4_steps,
                                                                          data_dir, tmp_path):
    params = _params(th.FAST, data_dir, {})
    with pytest.raises(export.CheckpointGoneError, match=r'ckpt-9 was removed .* before the '
                                                         r'export could read it'):
        export.export(params.task, export.feature_specs(params.input.train),
                      os.path.join(trained_4_steps.logdir, 'train', 'ckpt-9'),
                      str(tmp_path / 'new' / 'model'))
    assert os.listdir(tmp_path) == []


def test_export_of_a_two_replica_run(trained_4_steps_two_replicas, data_dir, tmp_path):
    overrides = {'task.pipeline.num_replicas': 2}
    path = _export(th.FAST, trained_4_steps_two_replicas.logdir, data_dir, tmp_path / 'r2',
                   overrides)
    _check_classifier(path, th.FAST, trained_4_steps_two_replicas.logdir, data_dir, 4,
                      tmp_path, overrides)


def test_export_of_a_bfloat16_run(tmp_path_factory, data_dir, tmp_path):
    overrides = {**K2_M2, 'task.fprop_dtype': tf.bfloat16}
    run = _train(tmp_path_factory.mktemp('bf16'), th.FAST, data_dir, overrides)
    # The export reads train/params.txt: bfloat16 without repeating the override.
    path = _export(th.FAST, run.logdir, data_dir, tmp_path / 'bf16')
    _check_classifier(path, th.FAST, run.logdir, data_dir, 2, tmp_path, overrides)


def test_export_of_the_default_image_model(tmp_path_factory, data_dir, tmp_path):
    overrides = {'task.pipeline.num_cells': 2, **K2_M2}
    run = _train(tmp_path_factory.mktemp('amoeba'), AMOEBA, data_dir, overrides)
    path = _export(AMOEBA, run.logdir, data_dir, tmp_path / 'amoeba')
    _check_classifier(path, AMOEBA, run.logdir, data_dir, 2, tmp_path, overrides)


def test_saved_model_cli_shows_and_runs_the_signature(cli_export, tmp_path):
    _, saved_model = cli_export
    shown = subprocess.run([SAVED_MODEL_CLI, 'show', '--dir', saved_model, '--all'],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "signature_def['serving_default']" in shown.stdout
    for name in ("inputs['image']", "outputs['probabilities']", "outputs['classes']",
                 'shape: (-1, 16, 16, 3)'):
        assert name in shown.stdout
    image = np.random.default_rng(0).uniform(size=(1, 16, 16, 3)).astype(np.float32)
    np.save(tmp_path / 'image.npy', image)
    ran = subprocess.run([SAVED_MODEL_CLI, 'run', '--dir', saved_model, '--tag_set', 'serve',
                          '--signature_def', 'serving_default',
                          '--inputs', f'image={tmp_path / "image.npy"}'],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    expected = tf.saved_model.load(saved_model).signatures['serving_default'](
        image=tf.constant(image))
    assert 'probabilities' in ran.stdout and 'classes' in ran.stdout
    assert f"[{int(expected['classes'][0])}]" in ran.stdout


# -- Translation -------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def reverse_decoded(reverse_trained, data_dir):
    """mt.reverse trained 2 steps with K=2, M=2 (the session's run), and the decoder's
    output on a dev batch."""
    run = reverse_trained
    decoder = eval_jobs.Decoder(_params(th.REVERSE, data_dir, th.REVERSE_OVERRIDES), 'dev',
                                run.logdir, max_steps=2)
    checkpoints.restore(decoder.checkpoint, os.path.join(run.logdir, 'train', 'ckpt-2'),
                        partial=True)
    batch = _eval_batch(decoder)
    hyp = decoder._decode(batch)['hyp'].numpy()[batch['weight'].numpy() > 0]
    return run, _real(batch, 'src'), hyp


@pytest.mark.parametrize('placement', export.PLACEMENTS)
def test_reverse_export_decodes_as_the_decoder(reverse_decoded, data_dir, tmp_path, placement):
    run, src, expected = reverse_decoded
    path = _export(th.REVERSE, run.logdir, data_dir, tmp_path / placement,
                   th.REVERSE_OVERRIDES, placement=placement)
    devices = _devices_in(path)
    if placement == export.PIPELINED:  # the two cells keep their devices
        assert {'/job:localhost/replica:0/task:0/device:CPU:0',
                '/job:localhost/replica:0/task:0/device:CPU:1'} <= devices
    else:
        assert devices == {''}
    got = export_helpers.serve(path, {'src': src}, tmp_path)  # in a process with one CPU device
    np.testing.assert_array_equal(got['ids'], expected)


# -- Bad input ---------------------------------------------------------------------------------

def _refused(model, logdir, data_dir, *flags) -> str:
    result = th.run(model, logdir, data_dir, '--mode=export', *flags)
    assert result.returncode == 2, result.stderr[-3000:]
    return th.error_line(result)


@pytest.mark.parametrize('case, message', [
    ('no_checkpoint', r'no checkpoint in .*/train yet: train the model first'),
    ('other_model', r'holds checkpoints of model image.shapes.SmallConvPipe, not '
                    r'image.shapes.AmoebaNetPipe: use a new --logdir'),
    ('bad_name', r'--checkpoint=ckpt-7 is not a checkpoint of .*: give one of ckpt-2, ckpt-4'),
    ('other_dir', r'--checkpoint=/elsewhere/train/ckpt-2 is not a checkpoint of .*: give one '
                  r'of ckpt-2, ckpt-4 \(a name or its path\)'),
    ('not_empty', r'--export_dir .* exists and is not empty: pass --overwrite'),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(trained_4_steps, data_dir, tmp_path,
                                                         case, message):
    logdir, model, flags = trained_4_steps.logdir, th.FAST, []
    target = tmp_path / 'target'
    if case == 'no_checkpoint':
        logdir = str(tmp_path / 'fresh')
    elif case == 'other_model':
        model = AMOEBA
    elif case == 'bad_name':
        flags = ['--checkpoint=ckpt-7']
    elif case == 'other_dir':
        flags = ['--checkpoint=/elsewhere/train/ckpt-2']
    else:
        target.mkdir()
        (target / 'keep.txt').write_text('mine')
    before = th.snapshot(str(tmp_path)), th.snapshot(trained_4_steps.logdir)
    line = _refused(model, logdir, data_dir, f'--export_dir={target}', *flags)
    assert re.search(message, line), line
    assert (th.snapshot(str(tmp_path)), th.snapshot(trained_4_steps.logdir)) == before


@pytest.fixture
def read_only_dir(tmp_path):
    """An empty tmpfs mounted read-only (root writes through chmod)."""
    with th.tmpfs(str(tmp_path / 'ro'), 'ro,size=1m') as mount:
        yield mount


def test_a_read_only_export_dir_is_named(trained_4_steps, data_dir, read_only_dir):
    before = th.snapshot(trained_4_steps.logdir)
    line = _refused(th.FAST, trained_4_steps.logdir, data_dir,
                    f'--export_dir={read_only_dir}/model')
    assert line == (f'error: --export_dir {read_only_dir}/model (its nearest existing parent '
                    f'{read_only_dir}) is not writable: give a directory this user can write, '
                    'e.g. under /tmp')
    assert th.snapshot(trained_4_steps.logdir) == before


@pytest.mark.parametrize('stage', ['pin', 'save'])
def test_a_full_export_disk_is_named_not_the_logdir(trained_4_steps, data_dir, tmp_path,
                                                     stage):
    """A 1 MiB tmpfs filled up to a few pages: too few for the pinned copy of the checkpoint
    (another file system: copied), or enough for it and too few for the SavedModel."""
    checkpoint = [os.path.join(trained_4_steps.logdir, 'train', name)
                  for name in os.listdir(os.path.join(trained_4_steps.logdir, 'train'))
                  if name.startswith('ckpt-4.')]
    pin_kib = sum(-(-os.path.getsize(f) // 4096) * 4 for f in checkpoint)  # tmpfs pages
    free_kib = 4 if stage == 'pin' else pin_kib + 4
    before = th.snapshot(trained_4_steps.logdir)
    with th.tmpfs(str(tmp_path / 'disk'), 'size=1m') as disk:
        with open(os.path.join(disk, 'filler'), 'wb') as f:
            f.write(b'\0' * (1024 - free_kib) * 1024)
        line = _refused(th.FAST, trained_4_steps.logdir, data_dir,
                        f'--export_dir={disk}/models/small')
        left = os.listdir(disk)
    assert re.fullmatch(
        rf'error: no space left on the disk of the export directory {disk}/models/small \(the '
        rf'file system mounted at {disk}, \d+ KiB free\): free space there or give an '
        r'--export_dir on another disk; the checkpoint was only read', line), line
    assert left == ['filler']  # the pinned copy and the partial SavedModel are removed
    assert th.snapshot(trained_4_steps.logdir) == before


def test_overwrite_replaces_a_non_empty_export_dir(trained_4_steps, data_dir, tmp_path):
    target = tmp_path / 'target'
    target.mkdir()
    (target / 'old.txt').write_text('old')
    result = th.run(th.FAST, trained_4_steps.logdir, data_dir, '--mode=export',
                    f'--export_dir={target}', '--overwrite')
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ['target']  # no temporary dir left beside it
    assert 'saved_model.pb' in os.listdir(target) and 'old.txt' not in os.listdir(target)


def test_a_task_without_signatures_is_refused_before_writing(trained_4_steps, data_dir,
                                                              tmp_path):
    params = _params(th.FAST, data_dir, {})
    params.task.cls = _NoSignatureClassifier
    with pytest.raises(ValueError, match=r'^task _NoSignatureClassifier has no export '
                                         r'signature: define ServingSignatures\(\)'):
        export.export(params.task, export.feature_specs(params.input.train),
                      os.path.join(trained_4_steps.logdir, 'train', 'ckpt-4'),
                      str(tmp_path / 'out' / 'model'))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('code, raised', [(errno.EIO, OSError),
                                           (errno.ENOSPC, export.ExportDiskFullError)])
def test_a_failed_save_leaves_nothing_behind(trained_4_steps, data_dir, tmp_path, monkeypatch,
                                             code, raised):
    def broken(_):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(export, 'clear_devices', broken)
    with pytest.raises(raised):
        _export(th.FAST, trained_4_steps.logdir, data_dir, tmp_path / 'new' / 'model')
    assert os.listdir(tmp_path) == []



class _NoSignatureClassifier(ImageClassifier):
    """A task whose author has not written ServingSignatures (BaseTask's default)."""

    ServingSignatures = BaseTask.ServingSignatures
