"""The params text format: which modules reading it may import, and its place in the imports.

Reading a class path imports its module, so a params file (`params.txt`,
`--params_file_override`) must only name trusted packages: each test here builds
a module on disk whose import leaves a marker file, and checks that the marker
never appears unless the module's package was trusted.
"""
import ast
import sys
import uuid
from pathlib import Path

import pytest

from tests import trainer_helpers as th
from tfpipe import params_text
from tfpipe.hyperparams import InstantiableParams, Params, ParamsTextError
from trainer import experiment

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def side_effect_module(tmp_path):
    """(module name, marker path): a fresh importable module that touches marker on import."""
    name = f'untrusted_{uuid.uuid4().hex[:12]}'
    marker = tmp_path / 'imported'
    (tmp_path / f'{name}.py').write_text(
        f'import pathlib\npathlib.Path({str(marker)!r}).touch()\n\n'
        'class Layer:\n    pass\n')
    sys.path.insert(0, str(tmp_path))
    try:
        yield name, marker
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def _params():
    p = Params()
    p.Define('layer', None, '')
    return p


@pytest.mark.parametrize('form', ['{m}.Layer', 'Params(cls={m}.Layer)', '[1, {m}.Layer]'])
def test_an_untrusted_module_is_refused_by_name_and_never_imported(side_effect_module, form):
    name, marker = side_effect_module
    with pytest.raises(ParamsTextError) as e:
        _params().FromText(f'layer : {form.format(m=name)}')
    message = str(e.value)
    assert message.startswith('line 1 ') and f"names module '{name}'" in message
    assert f"trust_package('{name}')" in message  # says how to allow it
    assert not marker.exists() and name not in sys.modules


def test_a_trusted_package_is_read(side_effect_module):
    name, marker = side_effect_module
    params_text.trust_package(name)
    p = _params().FromText(f'layer : Params(cls={name}.Layer)')
    assert marker.exists() and isinstance(p.layer, InstantiableParams)
    assert p.layer.cls is sys.modules[name].Layer
    assert name in params_text.trusted_packages()
    with pytest.raises(ValueError, match='module name'):
        params_text.trust_package('not a module')


def test_stdlib_modules_are_not_trusted_either():
    for path in ('os.path.join', 'subprocess.Popen', 'collections.OrderedDict'):
        with pytest.raises(ParamsTextError, match=f"names module '{path.rsplit('.', 1)[0]}'"):
            _params().FromText(f'layer : {path}')
    assert _params().FromText('layer : builtins.int').layer is int  # builtins: nothing is imported


def test_params_file_override_names_the_file_and_the_module(side_effect_module, tmp_path):
    name, marker = side_effect_module
    path = tmp_path / 'override.txt'
    path.write_text(f'task.train.optimizer : Params(cls={name}.Layer)\n')
    with pytest.raises(ValueError) as e:
        experiment.load_params(th.FAST, params_file_override=str(path))
    assert str(e.value).startswith(f'{path}: line 1 ') and f"'{name}'" in str(e.value)
    assert not marker.exists()


def test_the_trainer_trusts_the_registry_and_the_models_own_package():
    experiment.load_params(th.FAST)
    assert {'tfpipe', 'params'} <= set(params_text.trusted_packages())
    text = experiment.load_params(th.FAST).ToText()
    assert experiment.load_params(th.FAST).Copy().FromText(text).ToText() == text


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or '')
    return names


def test_the_dependency_runs_one_way_hyperparams_to_params_text():
    """params_text imports nothing of tfpipe, at its top or inside a function."""
    text_imports = _imports(REPO / 'tfpipe' / 'params_text.py')
    assert not {n for n in text_imports if n == 'tfpipe' or n.startswith('tfpipe.')}, \
        text_imports
    assert 'tfpipe.params_text' in _imports(REPO / 'tfpipe' / 'hyperparams.py')
