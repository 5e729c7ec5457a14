"""Model registry keys, lookup errors, lazy import; params overrides and gin."""
import subprocess
import sys

import gin
import pytest

import model_registry
from tests import trainer_helpers as th
from tfpipe.base_model_params import SingleTaskModelParams
from trainer import experiment


def test_registered_models_are_keyed_by_file():
    models = model_registry.list_models()
    for key in ['image.shapes.AmoebaNetPipe', 'image.shapes.SmallConvPipe',
                'image.cifar10.AmoebaNetD', 'mt.reverse.TransformerPipe',
                'mt.wmt14_ende.TransformerPipe']:
        assert key in models
        cls = model_registry.get_class(key)
        task, dataset, name = key.split('.')
        assert cls.__module__ == f'params.{task}.{dataset}' and cls.__name__ == name


def test_unknown_model_suggests_close_names():
    with pytest.raises(ValueError, match=r"did you mean image.shapes.AmoebaNetPipe"):
        model_registry.get_class('image.shapes.AmoebaNetPip')
    with pytest.raises(ValueError, match=r"no module image.mnist nor params/image/mnist.py"):
        model_registry.get_class('image.mnist.AmoebaNetPipe')
    with pytest.raises(ValueError, match=r'<task>.<dataset>.<ClassName> .*<module>.<ClassName>'):
        model_registry.get_class('AmoebaNetPipe')


def test_registration_inside_a_function_is_refused():
    class Stray(SingleTaskModelParams):
        pass
    with pytest.raises(ValueError, match=r'Stray is defined inside a function; a registered '
                                         r'model must be a module-level class'):
        model_registry.RegisterSingleTaskModel(Stray)


def test_duplicate_key_names_both_places(tmp_path):
    source = tmp_path / 'dup.py'
    source.write_text('class Dup(Base):\n    pass\n')
    namespace = {'Base': SingleTaskModelParams, '__name__': 'params.image.dup'}
    exec(compile(source.read_text(), str(source), 'exec'), namespace)
    first = namespace['Dup']
    exec(compile(source.read_text(), str(source), 'exec'), namespace)  # defined again
    second = namespace['Dup']
    model_registry.RegisterSingleTaskModel(first)
    model_registry.RegisterSingleTaskModel(first)  # the same definition again is fine
    try:
        with pytest.raises(ValueError, match=r'image.dup.Dup is registered twice: at .*Dup and '
                                             r'at .*Dup; rename one of the classes'):
            model_registry.RegisterSingleTaskModel(second)
    finally:
        model_registry._registry.pop('image.dup.Dup')


def test_lookup_imports_only_the_module_it_needs():
    code = ('import sys, model_registry; model_registry.get_class("mt.reverse.TransformerPipe");'
            'print(sorted(m for m in sys.modules if m.startswith("params.")))')
    out = subprocess.run([sys.executable, '-c', code], env=th.env(), cwd=th.REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['params.mt', 'params.mt.reverse']"


def test_split_overrides_keeps_brackets_and_quotes_together():
    pairs = experiment.split_overrides("a.b=1, c.d=[1, 2],e='x,y',f=\"q=r\"")
    assert pairs == [('a.b', '1'), ('c.d', '[1, 2]'), ('e', "'x,y'"), ('f', '"q=r"')]
    with pytest.raises(ValueError, match=r'has no "="'):
        experiment.split_overrides('a.b')


def test_overrides_are_typed_and_checked():
    params = experiment.load_params(
        th.FAST, "task.train.max_steps=7,task.pipeline.balance=[2, 3],"
                 "input.train.dataset='tfpipe_shapes'")
    assert params.task.train.max_steps == 7
    assert list(params.task.pipeline.balance) == [2, 3]
    with pytest.raises(ValueError, match=r"did you mean 'learning_rate'"):
        experiment.load_params(th.FAST, 'task.train.learning_rat=0.1')
    with pytest.raises(ValueError, match=r'max_steps'):
        experiment.load_params(th.FAST, "task.train.max_steps='ten'")
    with pytest.raises(ValueError):
        experiment.load_params(th.FAST, "task.train.max_steps=__import__('os')")


def test_a_bare_word_is_a_str_where_the_param_expects_one():
    params = experiment.load_params(
        th.FAST, 'task.pipeline.recompute=never,task.pipeline.schedule=1f1b,task.train.max_steps=7,'
                 'input.train.dataset=tfpipe_shapes')
    assert params.task.pipeline.recompute == 'never'
    assert params.task.pipeline.schedule == '1f1b'
    assert params.task.train.max_steps == 7  # a number stays a number
    # Elsewhere a bare word keeps its meaning: a name is refused, a module path is checked
    # against the trusted packages, and nothing is imported or evaluated.
    with pytest.raises(ValueError, match=r"unknown name 'ten'"):
        experiment.load_params(th.FAST, 'task.train.max_steps=ten')
    with pytest.raises(ValueError, match=r"outside the trusted packages"):
        experiment.load_params(th.FAST, 'task.pipeline.recompute=os.system')
    with pytest.raises(ValueError, match=r'is not allowed'):
        experiment.load_params(th.FAST, "task.pipeline.recompute=__import__('os')")
    with pytest.raises(ValueError, match=r"did you mean 'recompute'"):
        experiment.load_params(th.FAST, 'task.pipeline.recompte=never')


def test_params_file_override_round_trips_a_dumped_tree(tmp_path):
    changed = experiment.load_params(th.FAST, 'task.train.learning_rate=0.5')
    path = tmp_path / 'params.txt'
    path.write_text(changed.ToText())
    loaded = experiment.load_params(th.FAST, params_file_override=str(path))
    assert loaded == changed and loaded.task.train.learning_rate == 0.5


def test_gin_sets_model_params_and_runtime_knobs(tmp_path):
    from trainer import runtime_options
    config = tmp_path / 'my.gin'
    config.write_text("trainer.save_interval_steps = 7\n"
                      "model.overrides = {'task.train.learning_rate': 0.25}\n")
    try:
        params = experiment.load_params(th.FAST, gin_files=[str(config)],
                                        gin_bindings=['trainer.summary_interval_steps = 3'])
        options = runtime_options.RuntimeOptions()
    finally:
        gin.clear_config()
    assert params.task.train.learning_rate == 0.25
    assert options.save_interval_steps == 7 and options.summary_interval_steps == 3


def test_logdir_of_another_model_is_refused(tmp_path):
    (tmp_path / experiment.MODEL_FILE).write_text('mt.reverse.TransformerPipe\n')
    with pytest.raises(ValueError, match=r'holds checkpoints of model mt.reverse.TransformerPipe'):
        experiment.check_logdir(str(tmp_path), th.FAST)
    experiment.check_logdir(str(tmp_path), 'mt.reverse.TransformerPipe')
