"""--mode=check_pipeline: one step as configured vs K=1 on the same batch.

image.cifar10.AmoebaNetD and mt.wmt14_ende.TransformerPipe are not run: their data (CIFAR-10,
WMT14) is not on this machine and is never downloaded; their bodies are built from the same
layer classes (AmoebaCell, TransformerBlock) as the generated-data models checked here.
"""
import ast

import pytest

from tests import trainer_helpers
from tfpipe.base_layer import BaseLayer
from trainer import experiment, inspect_modes


class CallCounter(BaseLayer):
    """Deliberately broken: scales by how often it has run, so a recompute differs."""

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        self.calls = self.CreateVariable('calls', [], init='zeros', trainable=False)

    def FProp(self, theta, x):
        count = self.calls.assign_add(1.0)
        return x * (1.0 + 0.1 * count)


def _params(model, data_dir):
    params = experiment.load_params(model)
    for _, split in params.input.IterParams():
        if split is not None:
            split.data_dir = data_dir
    return params


def test_check_pipeline_cli_passes_on_the_fast_model(tmp_path, data_dir):
    out = trainer_helpers.run(trainer_helpers.FAST, str(tmp_path / 'unused'), data_dir,
                              '--mode=check_pipeline')
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert 'PASS' in out.stdout and 'largest gradient difference' in out.stdout


@pytest.mark.parametrize('model', ['image.shapes.AmoebaNetPipe', 'mt.reverse.TransformerPipe'])
def test_check_pipeline_passes_on_registered_models(model, data_dir):
    params = _params(model, data_dir)
    code, report = inspect_modes.check_pipeline(params)
    assert code == 0, report
    assert 'PASS' in report
    # The report names the balance that ran, also the automatic one (AmoebaNetPipe's).
    pipe = params.task.pipeline
    balance = ast.literal_eval(report.split('balance ')[1].split(' vs')[0])
    assert sum(balance) == len(pipe.body) and min(balance) >= 1
    assert balance == list(pipe.balance) if pipe.balance else len(balance) == pipe.num_cells


@pytest.mark.parametrize('overrides', [
    dict(num_replicas=2),
    dict(schedule='zb_h1', num_micro_batches=4),
    dict(schedule='interleaved_1f1b', virtual_stages=2, balance=[2, 1, 1, 1]),
], ids=['replicas', 'zb_h1', 'interleaved'])
def test_check_pipeline_passes_on_replicas_and_newer_schedules(overrides, data_dir):
    params = _params(trainer_helpers.FAST, data_dir)
    params.task.pipeline.Set(**overrides)
    code, report = inspect_modes.check_pipeline(params)
    assert code == 0, report


def test_check_pipeline_fails_on_a_recompute_unsafe_layer_and_names_it(data_dir):
    params = _params(trainer_helpers.FAST, data_dir)
    body = params.task.pipeline.body
    body.insert(3, CallCounter.Params().Set(name='counter'))
    params.task.pipeline.Set(balance=[3, 3], recompute='always')
    code, report = inspect_modes.check_pipeline(params)
    assert code == 1, report
    assert 'FAIL: worst' in report
    worst = report.splitlines()[-1]
    assert 'task/pipe/' in worst, report  # names a variable of the model


def _step(loss=1.0, **grads):
    import numpy as np
    grads = {p: np.asarray(g, np.float32) for p, g in grads.items()}
    # Adam-like: every weight moves by the learning rate in its gradient's direction.
    weights = {p: 1e-3 * np.sign(g) for p, g in grads.items()}
    return loss, grads, weights


def test_a_rounding_noise_gradient_is_judged_against_the_models_gradients():
    import numpy as np
    # A key bias under softmax: zero in exact arithmetic, 1e-10 either way in float32.
    # Relative to itself it differs by 200%, and Adam turns its sign into the update.
    code, report = inspect_modes.compare_steps(
        _step(w=[1.0, -0.5], key_b=[1e-10]), _step(w=[1.0, -0.5], key_b=[-1e-10]))
    assert code == 0, report
    assert '1 weight(s) with a rounding-noise gradient' in report
    # A gradient that is small but real is still checked, and a wrong one fails by name.
    code, report = inspect_modes.compare_steps(
        _step(w=[1.0, -0.5], small=[2e-3]), _step(w=[1.0, -0.5], small=[1e-3]))
    assert code == 1 and report.splitlines()[-1].startswith('FAIL: worst gradient small')
    # A bias one update from zero is compared at the model's weight scale: rounding in
    # Adam's normalisation passes, an update of the wrong size does not.
    big = [1.0, -0.5]
    step = _step(w=big, b=[0.3])
    reference = _step(w=big, b=[0.3])
    step[2].update(w=np.float32(big), b=np.float32([1e-3 + 2e-8]))
    reference[2].update(w=np.float32(big), b=np.float32([1e-3]))
    assert inspect_modes.compare_steps(step, reference)[0] == 0
    step[2]['b'] = np.float32([2e-3])
    code, report = inspect_modes.compare_steps(step, reference)
    assert code == 1 and 'worst weight b' in report
    # A noise-sized reference does not hide a pipeline gradient that is not noise.
    code, report = inspect_modes.compare_steps(
        _step(w=[1.0, -0.5], key_b=[1e-2]), _step(w=[1.0, -0.5], key_b=[1e-10]))
    assert code == 1 and 'worst gradient key_b' in report
