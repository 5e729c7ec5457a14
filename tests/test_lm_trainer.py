"""The registered LM through the trainer binary: it learns, decodes, generates; bad input.

One trainer run (lm.pystdlib.TinyTransformerLM, 150 steps on the standard library,
with its evaler on dev and decoder on test in the same process: the session fixture
lm_trained) is shared by every test here and by tests/test_export_lm.py.
"""
import glob
import json
import math
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import model_registry
from tfpipe import checkpoints, generation, inputs, lm_inputs
from tests import own_vocabulary_lm
from tests import trainer_helpers as th

MODEL = 'lm.pystdlib.TinyTransformerLM'
STEPS = th.LM_STEPS


@pytest.fixture(scope='module')
def trained(lm_trained):
    """The run (tests/conftest.py), not changed by these tests."""
    return lm_trained.logdir


def scores(path):
    with open(path) as f:
        return {k: float(v) for k, v in (line.split(': ') for line in f)}


def _generated_in_process(model, logdir, prompt_ids, num_new_tokens, sampling):
    """The ids this process generates from the logdir's latest checkpoint after
    end-of-document and `prompt_ids`: what --mode=generate must print."""
    task = model_registry.get_params(model).task.Instantiate()
    checkpoints.restore(checkpoints.make(task.VariablesByPath()),
                        checkpoints.latest(os.path.join(logdir, 'train')), partial=True)
    prompt = tf.concat([[lm_inputs.EOD_ID], prompt_ids], 0)
    ids, _ = task.generator.generate(task.theta['pipe'], prompt[None, :], num_new_tokens,
                                     sampling)
    return ids[0].numpy().tolist()


def test_dev_perplexity_falls_below_the_unigram_perplexity(trained):
    params = model_registry.get_params(MODEL)
    got = scores(os.path.join(trained, 'eval_dev', f'score-{STEPS}.txt'))
    num_rows = params.task.eval.samples_per_summary
    assert got['num_examples'] == num_rows
    unigram = lm_inputs.unigram_log_perplexity(
        params.input.dev.Instantiate().EvalDataset(num_rows), inputs.BYTE_VOCAB_SIZE)
    assert got['log_pplx'] < unigram - 0.3, (got, unigram)
    np.testing.assert_allclose(got['perplexity'], math.exp(got['log_pplx']), rtol=1e-5)
    assert 0 < got['accuracy'] < 1


def test_progress_lines_and_summaries_give_tokens_per_second_and_mfu(lm_trained):
    """Tokens are the batch's positions; recompute 'always' runs 4 forwards' worth for
    MFU's 3, so HFU is 4/3 of MFU whatever the machine's peak."""
    params = model_registry.get_params(MODEL)
    tokens = params.input.train.batch_size * params.input.train.max_length
    line = next(l for l in lm_trained.stderr.splitlines() if f'step {STEPS}/{STEPS}' in l)
    found = re.search(r'([0-9.]+) steps/s  ([0-9.]+) tokens/s  MFU ([0-9.]+)%  HFU ([0-9.]+)%',
                      line)
    assert found, line
    steps_per_sec, tokens_per_sec, mfu, hfu = map(float, found.groups())
    np.testing.assert_allclose(tokens_per_sec, steps_per_sec * tokens, rtol=0.01)
    np.testing.assert_allclose(hfu, mfu * 4 / 3, rtol=0.01, atol=0.1)
    scalars = {}
    for path in glob.glob(os.path.join(lm_trained.logdir, 'train', 'events.out.tfevents.*')):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    assert {'tokens_per_sec', 'mfu', 'hfu'} <= set(scalars)
    np.testing.assert_allclose(np.array(scalars['hfu']) / np.array(scalars['mfu']), 4 / 3,
                               rtol=1e-5)
    assert all(0 < m < 1 for m in scalars['mfu'])


def test_decoder_continues_test_prompts_greedy_and_sampled(trained):
    params = model_registry.get_params(MODEL)
    with open(os.path.join(trained, 'decoder_test', f'decoder_out-{STEPS}.jsonl')) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == params.task.eval.decoder_samples_per_summary
    for record in records:
        assert record['prompt'] and record['reference']
        for kind in ('greedy', 'sampled'):
            out = record[kind]
            assert 1 <= len(out['ids']) <= params.task.decoder.num_new_tokens
            assert len(out['log_probs']) == len(out['ids'])
            assert all(v <= 0 for v in out['log_probs'])
            assert out['continuation'] == inputs.byte_detokenize(out['ids'])


def test_generate_mode_repeats_in_process_sampling(trained):
    flags = ['--mode=generate', '--prompt=import os\ndef ', '--num_new_tokens=12',
             '--temperature=0.9', '--top_k=20', '--seed=4']
    result = th.run(MODEL, trained, 'unused', *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record['step'] == STEPS and record['prompt'] == 'import os\ndef '
    # The same checkpoint, prompt and seed in this process give the same tokens.
    ids = _generated_in_process(MODEL, trained, inputs.byte_tokenize('import os\ndef '), 12,
                                generation.Sampling(0.9, 20, 4))
    assert record['ids'] == ids[:len(record['ids'])]


# An empty corpus and text that is not a string are ValueErrors of DatasetInput
# (tests/test_lm_inputs.py), which the trainer reports like these.
@pytest.mark.parametrize('what, flags, message', [
    ('row longer than the model', [th.overrides(**{'input.train.max_length': 1000})],
     'max_length=1000'),
    ('prompt longer than the context', ['--mode=generate', '--prompt=' + 'x' * 100],
     'exceeds the context'),
    ('non-finite temperature', ['--mode=generate', '--temperature=nan'],
     'temperature=nan and top_k=0 must be finite and >= 0'),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(trained, tmp_path, what, flags,
                                                         message):
    logdir = trained if flags[0] == '--mode=generate' else str(tmp_path / 'new')
    before = th.snapshot(trained)
    result = th.run(MODEL, logdir, 'unused', '--job=trainer', *flags)
    assert result.returncode == 2, result.stderr[-3000:]
    line = th.error_line(result)
    assert message in line, line
    assert th.snapshot(trained) == before
    assert os.path.exists(logdir) == (logdir == trained)


def test_generate_encodes_and_decodes_with_the_models_own_vocabulary(tmp_path, data_dir):
    """A model trained with its own tokenizer gets its prompt in that vocabulary, not as
    bytes, and its continuation decoded by its detokenizer."""
    model = 'tests.own_vocabulary_lm.FlippedBytesLM'
    logdir = str(tmp_path / 'run')
    result = th.run(model, logdir, data_dir, *th.fast_flags(2, 2))
    assert result.returncode == 0, result.stderr[-3000:]
    result = th.run(model, logdir, data_dir, '--mode=generate', '--prompt=def f(x):',
                    '--num_new_tokens=8')
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    text_ids = [i for i in record['ids'] if i != lm_inputs.EOD_ID]
    assert record['continuation'] == own_vocabulary_lm.unflipped(text_ids)
    ids = _generated_in_process(model, logdir, own_vocabulary_lm.flipped('def f(x):'), 8,
                                generation.Sampling(0.0, 0, 0))
    assert record['ids'] == ids[:len(record['ids'])]
