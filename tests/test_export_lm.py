"""--mode=export of a language model: `serving_default` scores given tokens and `generate`
continues prompts, both loaded without tfpipe and equal to the evaler's per-token
log-probs and the decoder's greedy continuation (issue 19).

The K=2, M=2 run of lm.pystdlib.TinyTransformerLM that tests/test_lm_trainer.py reads
(150 steps: the session fixture lm_trained) is exported once per placement
and shared by every test here.
"""
import os
import re
import subprocess

import numpy as np
import pytest

import model_registry
from tests import export_helpers, trainer_helpers as th
from tfpipe import checkpoints, lm_inputs

MODEL = 'lm.pystdlib.TinyTransformerLM'  # K=2 (balance [3, 4]), M=2
STEPS = th.LM_STEPS  # the steps lm_trained runs
TOL = 1e-5


@pytest.fixture(scope='module')
def lm_run(tmp_path_factory, data_dir, lm_trained):
    """(logdir, one-device SavedModel, pipelined SavedModel) of the K=2, M=2 run."""
    logdir = lm_trained.copy_to(tmp_path_factory.mktemp('lm_export') / 'run')
    for flags in (['--mode=export'], ['--mode=export', '--export_placement=pipelined',
                                      f'--export_dir={logdir}/pipelined']):
        result = th.run(MODEL, logdir, data_dir, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
    return logdir, os.path.join(logdir, 'export', str(STEPS)), os.path.join(logdir, 'pipelined')


@pytest.fixture(scope='module')
def task(lm_run):
    """The model in this process, restored from the exported checkpoint."""
    task = model_registry.get_params(MODEL).task.Instantiate()
    checkpoints.restore(checkpoints.make(task.VariablesByPath()),
                        os.path.join(lm_run[0], 'train', f'ckpt-{STEPS}'), partial=True)
    return task


def test_log_probs_equal_the_evalers_and_ignore_padding(lm_run, task, tmp_path):
    tokens, expected = export_helpers.document_row(MODEL, task)
    lengths = [len(tokens), len(tokens) // 2, 3]  # prefixes of one document, 0-padded
    ids = export_helpers.prefixes(tokens, lengths)
    got = export_helpers.serve(lm_run[1], {'ids': ids}, tmp_path)['log_probs']
    assert got.shape == ids.shape and got.dtype == np.float32
    for i, n in enumerate(lengths):  # causal: what follows a row's tokens changes nothing
        np.testing.assert_allclose(got[i, :n], expected[:n], rtol=TOL, atol=TOL)


@pytest.mark.parametrize('placement', [1, 2], ids=['one_device', 'pipelined'])
def test_generate_equals_the_decoders_greedy_continuation(lm_run, task, tmp_path, placement):
    d = task.params.decoder
    params = model_registry.get_params(MODEL)
    rows = next(iter(params.input.dev.Instantiate().EvalDataset(16)))['inputs'].numpy()
    prompt = rows[:4, 1:d.prompt_length]  # any tokens: each becomes a document's start
    expected, expected_lp = task.generator.generate(
        task.theta['pipe'], np.concatenate([np.full([4, 1], lm_inputs.EOD_ID), prompt], 1)
        .astype(np.int32), d.num_new_tokens)
    got = export_helpers.serve(lm_run[placement], {
        'prompt': prompt, 'num_new_tokens': np.int32(d.num_new_tokens)}, tmp_path, 'generate')
    np.testing.assert_array_equal(got['ids'], expected.numpy())
    np.testing.assert_allclose(got['log_probs'], expected_lp.numpy(), rtol=TOL, atol=TOL)


def test_saved_model_cli_lists_both_signatures(lm_run):
    shown = subprocess.run([export_helpers.SAVED_MODEL_CLI, 'show', '--dir', lm_run[1],
                            '--all'], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    for name in ("signature_def['serving_default']", "signature_def['generate']",
                 "inputs['ids']", "inputs['prompt']", "inputs['num_new_tokens']",
                 "outputs['log_probs']", "outputs['ids']", 'shape: (-1, -1)'):
        assert name in shown.stdout, name


@pytest.mark.parametrize('signature, inputs, message', [
    ('generate', {'prompt': np.ones([1, 8], np.int32), 'num_new_tokens': np.int32(64)},
     'num_new_tokens exceeds the context of 64 tokens'),
    # 2 + 2147483645 is int32's largest: the output array of that many slots was allocated
    # before the check ran, and std::bad_alloc aborted the process.
    ('generate', {'prompt': np.ones([1, 2], np.int32), 'num_new_tokens': np.int32(2**31 - 3)},
     'num_new_tokens exceeds the context of 64 tokens'),
    ('generate', {'prompt': np.array([[5, 1000]], np.int32), 'num_new_tokens': np.int32(2)},
     r'prompt holds ids outside the vocabulary \[0, 258\).*\[5\] \[1000\]'),
    ('generate', {'prompt': np.array([[-1, 5]], np.int32), 'num_new_tokens': np.int32(2)},
     r'prompt holds ids outside the vocabulary \[0, 258\).*\[-1\] \[5\]'),
    ('serving_default', {'ids': np.array([[5, 1000]], np.int32)},
     r'ids holds ids outside the vocabulary \[0, 258\)'),
    ('serving_default', {'ids': np.ones([1, 65], np.int32)},
     'ids longer than the context of 64 tokens'),
], ids=['beyond_context', 'int32_limit', 'id_1000', 'id_-1', 'scored_id_1000', 'scored_long'])
def test_a_bad_request_fails_naming_the_bound(lm_run, tmp_path, signature, inputs, message):
    """The request's own error (InvalidArgumentError with the bound), raised in Python in
    the serving process, never an abort or a kernel's error on an unchecked input."""
    params = model_registry.get_params(MODEL)
    assert (params.input.train.max_length, params.task.vocab_size) == (64, 258)
    result, _ = export_helpers.run_signature(lm_run[1], signature, inputs, tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]  # a Python exception, not a signal
    assert 'InvalidArgumentError' in result.stderr
    assert re.search(message, result.stderr), result.stderr[-3000:]
    assert 'GatherV2' not in result.stderr


def test_bfloat16_model_exports_and_generates(lm_run, data_dir, tmp_path):
    """The float32 checkpoint exported as a bfloat16 model: it loads and continues prompts."""
    path = str(tmp_path / 'bf16')
    result = th.run(MODEL, lm_run[0], data_dir, '--mode=export', f'--export_dir={path}',
                    th.overrides(**{'task.fprop_dtype': 'bfloat16'}))
    assert result.returncode == 0, result.stderr[-3000:]
    got = export_helpers.serve(path, {'prompt': np.ones([2, 5], np.int32),
                                      'num_new_tokens': np.int32(6)}, tmp_path, 'generate')
    assert got['ids'].shape == (2, 6) and np.all(got['log_probs'] <= 0)
