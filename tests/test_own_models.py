"""Bring your own model and data: a package outside the repository, through the trainer.

The package (tests/own_package.py) lives in a temporary directory on the
subprocess's PYTHONPATH only, like a user's installed package.
"""
import json
import os
import re
import sys

import pytest

import model_registry
from tfpipe import params_text

from tests import own_package
from tests import trainer_helpers as th

MODEL = 'byomodels.models.TinyNet'


@pytest.fixture(scope='module')
def package(tmp_path_factory):
    return own_package.write(tmp_path_factory.mktemp('site'))


def run(package, model, logdir, *flags, data_dir='unused'):
    return th.run_command(th.command(model, logdir, data_dir, *flags),
                          own_package.env_with(package, th.env()))


@pytest.fixture(scope='module')
def trained(package, tmp_path_factory):
    """Trainer, evaler on dev and decoder on test in one process (the default jobs)."""
    logdir = str(tmp_path_factory.mktemp('own') / 'run')
    result = run(package, MODEL, logdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir


def _scores(path):
    with open(path) as f:
        return {k: float(v) for k, v in (line.split(': ') for line in f.read().splitlines())}


def test_trains_evaluates_and_decodes_on_its_own_data(trained):
    assert open(os.path.join(trained, 'model.txt')).read().strip() == MODEL
    scores = _scores(os.path.join(trained, 'eval_dev', 'score-60.txt'))
    assert scores['accuracy'] >= 0.9, scores  # learnt, from the examples_fn's data
    with open(os.path.join(trained, 'decoder_test', 'decoder_out-60.jsonl')) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 32 and {r['label'] for r in records} == {0, 1}
    with open(os.path.join(trained, 'train', 'params.txt')) as f:
        text = f.read()
    assert "input.train.examples_fn : 'byomodels.data.make'" in text
    assert 'input.train.cls : tfpipe.inputs.DatasetInput' in text


def test_inspect_model(package):
    result = run(package, MODEL, '', '--mode=inspect_model')
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'balance [2, 2]' in result.stdout and 'cell 1 on' in result.stdout
    assert 'pipe/logits/w [32, 2] float32' in result.stdout, result.stdout
    assert 'predicted memory per device' in result.stdout
    assert re.search(r'CPU:1: weights [\d.]+ MiB  gradient sums .* total [\d.]+ MiB',
                     result.stdout), result.stdout


def test_list_models_includes_entry_points(package):
    result = th.run_command([sys.executable, '-m', 'trainer', '--list_models'],
                            own_package.env_with(package, th.env()), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    models = result.stdout.split()
    assert {MODEL, 'byomodels.models.WiderShapes', 'image.shapes.SmallConvPipe',
            'mt.reverse.TransformerPipe'} <= set(models)
    assert 'byomodels.models.Unregistered' not in models


BAD_MODELS = [
    ('no module', 'byomodels.missing.TinyNet', r"there is no module byomodels.missing"),
    ('no package', 'nopkg.lm.MyLM', r"there is no module nopkg.lm nor params/nopkg/lm.py"),
    ('no class', 'byomodels.models.Huge', r"module byomodels.models has no class 'Huge'"),
    ('not registered', 'byomodels.models.Unregistered',
     r'byomodels.models.Unregistered is not registered: decorate class Unregistered .*'
     r'@model_registry.RegisterSingleTaskModel'),
]
BAD_DATA = [
    ('examples_fn outside the trusted packages', 'nopkg.data.make',
     r"examples_fn 'nopkg.data.make' names module 'nopkg.data', outside the trusted packages"),
    ('unimportable examples_fn', 'byomodels.nothing.make', r"examples_fn "
     r"'byomodels.nothing.make': there is no module 'byomodels.nothing'"),
    ('missing examples_fn', 'byomodels.data.nothing',
     r"module byomodels.data has no function 'nothing'"),
    ('not dotted', 'make', r"examples_fn='make' is not a dotted name"),
    ('returns a list', 'byomodels.data.make_list',
     r"byomodels.data.make_list\('train'\) returned a list: expected a tf.data.Dataset of "
     r"single examples \{'image': float \(or uint8\) \[H, W, C\], 'label': int \[\]\}"),
    ('wrong features', 'byomodels.data.make_wrong_features',
     r"yields features \['label', 'pixels'\], without 'image'"),
    ('non-static shapes', 'byomodels.data.make_dynamic',
     r"feature 'image' has shape \(None, 8, 1\), not static"),
    ('from_generator', 'byomodels.data.make_from_generator',
     r"make_from_generator\('train'\) returned a dataset made with "
     r"tf.data.Dataset.from_generator, whose position a checkpoint cannot hold"),
]


@pytest.fixture
def on_path(package, monkeypatch):
    """The package importable (and trusted, as the trainer trusts its model's package) in
    this process too, for the fast in-process checks."""
    monkeypatch.syspath_prepend(package)
    params_text.trust_package('byomodels')


@pytest.mark.parametrize('what,model,message', BAD_MODELS, ids=[c[0] for c in BAD_MODELS])
def test_bad_model_in_process(on_path, what, model, message):
    with pytest.raises(ValueError, match=message):
        model_registry.get_class(model)


@pytest.mark.parametrize('what,fn,message', BAD_DATA, ids=[c[0] for c in BAD_DATA])
def test_bad_examples_fn_in_process(on_path, what, fn, message):
    p = model_registry.get_params(MODEL).input.train.Set(examples_fn=fn)
    with pytest.raises(ValueError, match=message):
        p.Instantiate()


@pytest.mark.parametrize('model,flags,message', [
    (BAD_MODELS[3][1], [], BAD_MODELS[3][2]),
    (MODEL, ["--params_override=input.train.examples_fn='byomodels.data.make_dynamic'"],
     dict((c[1], c[2]) for c in BAD_DATA)['byomodels.data.make_dynamic'])],
    ids=['unregistered model', 'dynamic shapes'])
def test_bad_input_through_the_trainer(package, tmp_path, model, flags, message):
    import re
    logdir = str(tmp_path / 'run')
    result = run(package, model, logdir, *flags)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(message, th.error_line(result)), th.error_line(result)
    assert not os.path.exists(logdir)


def test_a_label_out_of_range_is_one_line_naming_it(package, tmp_path):
    result = run(package, MODEL, str(tmp_path / 'run'), '--job=trainer',
                 "--params_override=input.train.examples_fn='byomodels.data.make_bad_label'")
    assert result.returncode == 2, result.stderr[-3000:]
    line = th.error_line(result)
    assert ("input.train (examples_fn byomodels.data.make_bad_label('train')) gave label 2 "
            'at step 1, outside [0, 2) for task.num_classes=2') in line, line
    assert 'Traceback' not in result.stderr


def test_module_raising_on_import_shows_its_own_error(package, tmp_path):
    result = run(package, 'byomodels.broken.Model', str(tmp_path / 'run'))
    assert result.returncode == 1
    assert 'RuntimeError: byomodels.broken fails on import on purpose' in result.stderr
    assert 'error: unknown model' not in result.stderr
