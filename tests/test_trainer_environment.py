"""The TensorFlow environment the trainer sets before TensorFlow loads (trainer/main.py
`run`): the BFC allocator (peak statistics) and oneDNN's CPU kernels (a convolution's
backward without them allocates an L3-sized scratch buffer per call), each unless the
user chose otherwise."""
import pytest

from trainer import main

DEFAULTS = {'TF_CPU_ALLOCATOR_USE_BFC': 'true', 'TF_ENABLE_ONEDNN_OPTS': '1'}


@pytest.fixture
def no_app(monkeypatch):
    """run() without starting the trainer: only what it sets before app.run. Both
    variables are put back afterwards, so later trainer processes inherit nothing."""
    monkeypatch.setattr(main.app, 'run', lambda _: None)
    saved = {name: main.os.environ.get(name) for name in DEFAULTS}
    yield
    for name, value in saved.items():
        if value is None:
            main.os.environ.pop(name, None)
        else:
            main.os.environ[name] = value


@pytest.mark.parametrize('name', sorted(DEFAULTS))
def test_the_trainer_sets_its_default_when_the_variable_is_unset(monkeypatch, no_app, name):
    monkeypatch.delenv(name, raising=False)
    main.run()
    assert main.os.environ[name] == DEFAULTS[name]


@pytest.mark.parametrize('name, users', [('TF_CPU_ALLOCATOR_USE_BFC', 'false'),
                                         ('TF_ENABLE_ONEDNN_OPTS', '0')])
def test_the_users_setting_wins(monkeypatch, no_app, name, users):
    monkeypatch.setenv(name, users)
    main.run()
    assert main.os.environ[name] == users
