"""The TensorFlow settings tfpipe applies before TensorFlow loads
(tfpipe/runtime_defaults.py): oneDNN's CPU kernels and the BFC allocator, for
library users and the trainer alike, each unless the user chose otherwise.

Each case runs in a fresh interpreter: TensorFlow reads the variables once, when
it loads, and this test process loaded it long ago (tests/conftest.py).
"""
import json
import subprocess
import sys

import pytest

from tests import trainer_helpers as th
from tfpipe import runtime_defaults

PROBE = """
import json, os, sys, warnings
warnings.simplefilter('always')
{imports}
import tensorflow as tf
from tfpipe import memory_stats, runtime_defaults
tf.constant(1.0) + 1.0
print(json.dumps({{'env': {{n: os.environ.get(n) for n in runtime_defaults.DEFAULTS}},
                  'onednn': runtime_defaults.onednn_enabled(),
                  'peak_kept': bool(memory_stats.peak_bytes(['CPU:0']))}}))
"""


def _probe(imports: str, **environ: str):
    env = {k: v for k, v in th.env().items() if k not in runtime_defaults.DEFAULTS}
    env.update(environ, TF_CPP_MIN_LOG_LEVEL='3')
    done = subprocess.run([sys.executable, '-c', PROBE.format(imports=imports)], env=env,
                          cwd=th.REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize('imports', ['import tfpipe', 'import trainer.main'])
def test_importing_tfpipe_or_the_trainer_first_sets_the_kernels_and_allocator(imports):
    seen, stderr = _probe(imports)
    assert seen['env'] == runtime_defaults.DEFAULTS
    assert seen['onednn'] and seen['peak_kept']
    assert 'tfpipe: TensorFlow was imported before' not in stderr


def test_the_users_settings_win():
    seen, stderr = _probe('import tfpipe', TF_ENABLE_ONEDNN_OPTS='0',
                          TF_CPU_ALLOCATOR_USE_BFC='false')
    assert seen['env'] == {'TF_ENABLE_ONEDNN_OPTS': '0', 'TF_CPU_ALLOCATOR_USE_BFC': 'false'}
    assert not seen['onednn'] and not seen['peak_kept']
    assert 'tfpipe: TensorFlow was imported before' not in stderr


def test_tensorflow_imported_first_is_left_alone_and_warned_only_without_onednn():
    seen, stderr = _probe('import tensorflow\nimport tfpipe')
    assert seen['env'] == {name: None for name in runtime_defaults.DEFAULTS}
    # TensorFlow turns oneDNN on by itself on some CPUs: then there is nothing to say.
    warned = 'tfpipe: TensorFlow was imported before tfpipe' in stderr
    assert warned == (not seen['onednn']), stderr[-2000:]


@pytest.mark.parametrize('environ, onednn_on, expected', [
    ({}, False, True),                                # the slow case: say the fix
    ({}, True, False),                                # TensorFlow turned it on itself
    ({'TF_ENABLE_ONEDNN_OPTS': '0'}, False, False),   # the user's choice
])
def test_late_import_warning_only_when_the_kernels_are_off_unchosen(environ, onednn_on,
                                                                    expected):
    assert runtime_defaults.late_import_warning(environ, onednn_on) is expected


def test_importing_tfpipe_or_the_trainer_loads_no_tensorflow():
    """The settings only count before TensorFlow loads, and the launcher of local clients
    (trainer/launcher.py) supervises processes without ever building a model."""
    code = ('import sys, tfpipe, trainer.main\n'
            'print("tensorflow" in sys.modules, tfpipe.PipeliningLayer.__name__, '
            '"tensorflow" in sys.modules)')
    done = subprocess.run([sys.executable, '-c', code], env=th.env(), cwd=th.REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ['False', 'PipeliningLayer', 'True']
