"""The registered MoE language model (lm.pystdlib.TinyMoETransformerLM) through one short
trainer run with its evaler on dev and decoder on test: the progress lines show the
auxiliary loss and routing, the evaler reports them apart from its loss and drops no
token, the decoder writes continuations, and KV-cached generation from the checkpoint
equals uncached generation (decoding routes every token: C = S); and --mode=export of that
checkpoint serves the evaler's log-probs and the generator's continuations without tfpipe
(the serving signature takes any batch and length: evaluation sizes the capacity at run
time)."""
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

import model_registry
from tfpipe import checkpoints, layers, lm_inputs
from tests import export_helpers, trainer_helpers as th

MODEL = 'lm.pystdlib.TinyMoETransformerLM'
STEPS = 4


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp('moe_lm') / 'run')
    result = th.run(MODEL, logdir, str(tmp_path_factory.mktemp('unused_tfds')),
                    '--job=trainer,evaler_dev,decoder_test', f'--max_steps={STEPS}',
                    '--gin_bindings=trainer.eval_poll_max_seconds=1',
                    '--gin_bindings=trainer.summary_interval_steps=1',
                    th.overrides(**{'task.eval.samples_per_summary': 32}), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return th.TrainedRun(logdir, result.stderr)


def test_every_other_block_is_a_mixture_of_experts():
    task = model_registry.get_params(MODEL).task
    blocks = [p for p in task.pipeline.body if p.name.startswith('block')]
    assert [p.cls for p in blocks] == [layers.PackedTransformerBlock,
                                       layers.PackedMoETransformerBlock]
    moe, dense = blocks[1], blocks[0]
    assert (moe.num_experts, moe.top_k, 2 * moe.hidden_dim) == (8, 2, dense.hidden_dim)
    assert moe.eval_capacity_factor * moe.top_k == moe.num_experts  # C = S in evaluation


def test_progress_lines_show_the_aux_loss_and_routing(trained):
    line = [l for l in trained.stderr.splitlines() if f'step {STEPS}/{STEPS}' in l][-1]
    match = re.search(r'loss ([\d.]+)  aux_loss ([\d.]+)  load_balancing_loss ([\d.]+)  '
                      r'dropped_fraction ([\d.]+)', line)
    assert match, line
    assert 0 < float(match.group(2)) < 0.1 and float(match.group(3)) > 0


def test_evaler_reports_aux_loss_apart_and_drops_nothing(trained):
    with open(os.path.join(trained.logdir, 'eval_dev', f'score-{STEPS}.txt')) as f:
        scores = {k: float(v) for k, v in (line.split(': ') for line in f)}
    assert scores['dropped_fraction'] == 0.0
    assert 0 < scores['aux_loss'] < 0.1
    np.testing.assert_allclose(scores['aux_loss'], 0.01 * scores['load_balancing_loss'],
                               rtol=1e-4)
    np.testing.assert_allclose(scores['loss'], scores['log_pplx'], rtol=1e-6)  # no aux in it


@pytest.fixture(scope='module')
def restored(trained):
    """The model in this process, restored from the run's last checkpoint."""
    task = model_registry.get_params(MODEL).task.Instantiate()
    checkpoints.restore(checkpoints.make(task.VariablesByPath()),
                        checkpoints.latest(os.path.join(trained.logdir, 'train')),
                        partial=True)
    return task


def test_decoder_and_cached_generation(trained, restored):
    with open(os.path.join(trained.logdir, 'decoder_test', f'decoder_out-{STEPS}.jsonl')) as f:
        records = [json.loads(line) for line in f]
    assert records and all(r['greedy']['ids'] for r in records)
    prompt = tf.constant([[lm_inputs.EOD_ID, 105, 109, 112, 111, 114, 116]], tf.int32)
    cached, _ = restored.generator.generate(restored.theta['pipe'], prompt, 6)
    uncached, _ = restored.generator.generate(restored.theta['pipe'], prompt, 6, cached=False)
    np.testing.assert_array_equal(cached.numpy(), uncached.numpy())


def test_exported_model_serves_the_evalers_log_probs_and_generates(trained, restored,
                                                                   tmp_path):
    """Rows of other lengths and another batch than training's: every token still routed."""
    path = str(tmp_path / 'export')
    result = th.run(MODEL, trained.logdir, str(tmp_path), '--mode=export',
                    f'--export_dir={path}')
    assert result.returncode == 0, result.stderr[-3000:]
    tokens, expected = export_helpers.document_row(MODEL, restored)
    lengths = [len(tokens), len(tokens) // 2, 3]
    got = export_helpers.serve(path, {'ids': export_helpers.prefixes(tokens, lengths)},
                               tmp_path)['log_probs']
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(got[i, :n], expected[:n], rtol=1e-5, atol=1e-5)
    prompt = np.array([[105, 109, 112], [111, 114, 116]], np.int32)
    want, want_lp = restored.generator.generate(
        restored.theta['pipe'], np.concatenate([np.full([2, 1], lm_inputs.EOD_ID), prompt],
                                               1).astype(np.int32), 5)
    got = export_helpers.serve(path, {'prompt': prompt, 'num_new_tokens': np.int32(5)},
                               tmp_path, 'generate')
    np.testing.assert_array_equal(got['ids'], want.numpy())
    np.testing.assert_allclose(got['log_probs'], want_lp.numpy(), rtol=1e-5, atol=1e-5)


def test_a_run_at_expert_parallel_2_decodes_generates_and_exports(trained, tmp_path):
    """Decoding runs replica 0 alone: at P=2 its all-to-all waited forever for a member
    that never joined (the decoder job hung, --mode=generate would too), and export
    refused P=2 with one replica. All three now take every expert on replica 0, from the
    checkpoint (which holds experts whole: this one was written at P=1)."""
    logdir = trained.copy_to(tmp_path / 'run')
    shutil.rmtree(os.path.join(logdir, 'decoder_test'))  # so the step is decoded again
    # The logdir of a P=2 run: its recorded params say P=2, R=2 (every job builds those),
    # and its checkpoint is the same as a P=1 run's (experts whole).
    recorded = os.path.join(logdir, 'train', 'params.txt')
    with open(recorded) as f:
        text = f.read()
    for name in ('num_replicas', 'expert_parallel'):
        assert f'task.pipeline.{name} : 1\n' in text
        text = text.replace(f'task.pipeline.{name} : 1\n', f'task.pipeline.{name} : 2\n')
    with open(recorded, 'w') as f:
        f.write(text)
    p2 = th.overrides(**{'task.pipeline.num_replicas': 2, 'task.pipeline.expert_parallel': 2})
    decoded = th.run(MODEL, logdir, str(tmp_path), '--job=decoder_test', p2,
                     f'--max_steps={STEPS}', timeout=300)
    assert decoded.returncode == 0, decoded.stderr[-3000:]
    with open(os.path.join(logdir, 'decoder_test', f'decoder_out-{STEPS}.jsonl')) as f:
        assert [json.loads(line) for line in f]
    generated = th.run(MODEL, logdir, str(tmp_path), '--mode=generate', '--prompt=def ',
                       '--num_new_tokens=4', p2, timeout=300)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert json.loads(generated.stdout.strip().splitlines()[-1])['step'] == STEPS
    exported = th.run(MODEL, logdir, str(tmp_path), '--mode=export', p2,
                      f'--export_dir={tmp_path}/export', timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
