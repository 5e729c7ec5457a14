"""The Transformer LM with tensor_parallel=T: every T gives the T=1 step (issue 27).

The LM of tests/tensor_parallel_lm_task.py (tests/test_lm.py's, widened to 4
heads, with residual and attention dropout, in float64): loss, whole gradients
(shards concatenated) and whole weights after an SGD step are compared with the
same LM at T=1, K=1 for T in {1, 2, 4} x K in {1, 2} (R*K*T <= 8 logical CPUs,
one R=2 case; T=4, K=2, R=2 on 16 in tests/test_tensor_parallel_16.py), every
recompute policy and both schedules. The byte vocabulary (258)
splits unevenly over T=4 (65, 65, 64, 64): no padding, so nothing to mask and
a checkpoint holds the 258 rows. Generation (cache split by heads) gives the
T=1 tokens; evaluation the T=1 metrics; a checkpoint moves between any T.
"""
import os

import numpy as np
import pytest
import tensorflow as tf

from tests import test_lm as lm
from tests import trainer_helpers as th
from tests.tensor_parallel_lm_task import (assert_same_step, lm_task, reference, sgd_step,
                                           whole)
from tfpipe import checkpoints, fprop_context, generation


_stepped, _evaluated = {}, {}


def stepped(t, k=1, r=1, m=1):
    """(task, its `sgd_step` on the reference batch) at one grid point, once per process:
    the step test and the checkpoint test read the same traced step."""
    if (t, k, r, m) not in _stepped:
        task = lm_task(t, k, r, m)
        _stepped[t, k, r, m] = task, sgd_step(task, reference()[0])
    return _stepped[t, k, r, m]


def evaluated(t):
    """(task, its evaluation logits and metrics on the generated batch) at T=t, K=1, once
    per process: the placement and the metrics tests read the same evaluation."""
    if t not in _evaluated:
        task, batch = lm_task(t), lm.generated_batch()
        with fprop_context.evaluation():
            logits = task.ComputePredictions(task.theta, batch)
        metrics = {k: v[0].numpy() for k, v in task.ComputeLoss(task.theta, logits,
                                                                  batch).items()}
        _evaluated[t] = task, logits, metrics
    return _evaluated[t]


# (T, K, R, M): M=2 where micro-batches add something (dropout offsets, 1F1B's order).
@pytest.mark.parametrize('t, k, r, m', [(2, 1, 1, 1), (2, 2, 1, 2), (4, 1, 1, 1), (4, 2, 1, 1),
                                        (2, 2, 2, 1)])
def test_step_equals_the_t1_step(t, k, r, m):
    assert_same_step(stepped(t, k, r, m)[1], reference()[1])


@pytest.mark.parametrize('t, k, recompute, schedule', [
    (2, 2, 'never', 'fill_drain'), (2, 2, 'except_last', '1f1b'), (4, 1, 'never', '1f1b')])
def test_recompute_policies_and_schedules_equal_the_t1_step(t, k, recompute, schedule):
    batch, ref = reference()
    task = lm_task(t, k, m=2, recompute=recompute, schedule=schedule)
    assert_same_step(sgd_step(task, batch), ref)


def test_layers_are_split_over_the_cells_devices():
    task, logits, _ = evaluated(4)
    devices = [tf.DeviceSpec.from_string(d) for d in task.pipe.cells[0].shard_devices]
    assert len(set(devices)) == 4

    def placed(layer):
        return [(v.shape.as_list(), tf.DeviceSpec.from_string(v.device))
                for v in layer.VariablesByPath().values()]
    # The 258 ids over 4 devices: 65, 65, 64, 64 rows, no padding row.
    assert placed(task.pipe.embedding) == [([n, 16], d) for n, d in zip([65, 65, 64, 64],
                                                                         devices)]
    # Heads [4t, 4t + 4) of query on device t: w[:, 4] and b[4] each.
    assert placed(task.pipe.block0.atten.query) == (
        [([16, 4], d) for d in devices] + [([4], d) for d in devices])
    # Row-parallel post: w[4, :] per device, its bias whole on the home device; LayerNorm too.
    assert placed(task.pipe.block0.atten.post) == (
        [([4, 16], d) for d in devices] + [([16], devices[0])])
    assert {d for _, d in placed(task.pipe.block0.atten_ln)} == {devices[0]}
    assert [s.shape[-1] for s in logits] == [65, 65, 64, 64]


def test_eval_metrics_equal_the_t1_metrics():
    metrics = [evaluated(t)[2] for t in (1, 4)]
    for name in metrics[0]:
        np.testing.assert_allclose(metrics[1][name], metrics[0][name], rtol=1e-9)


def test_generation_with_t2_gives_the_t1_tokens():
    prompt = tf.constant([[lm.lm_inputs.EOD_ID, 97, 98, 99], [lm.lm_inputs.EOD_ID, 120, 121,
                                                                122]], tf.int32)
    sampling = generation.Sampling(temperature=0.9, top_k=20, seed=5)
    out = {}
    for t in (1, 2):
        task = lm_task(t, k=2)
        theta = task.theta['pipe']
        out[t] = [task.generator.generate(theta, prompt, 3),
                  task.generator.generate(theta, prompt, 3, sampling)]
        if t == 2:
            caches = task.generator.init_caches(2)
            block_cache = caches[0]['block0']
            assert len(block_cache) == 2  # one cache per device, of its 2 heads
            assert block_cache[0]['key'].shape == [2, 2, lm.CONTEXT, 4]
    for (tokens, log_probs), (ref_tokens, ref_log_probs) in zip(out[2], out[1]):
        np.testing.assert_array_equal(tokens, ref_tokens)
        np.testing.assert_allclose(log_probs, ref_log_probs, atol=1e-9)


def test_checkpoint_moves_between_t4_t1_and_t2(tmp_path):
    trained = stepped(4)[0]  # after the step test_step_equals_the_t1_step checks
    path = checkpoints.make(trained.VariablesByPath()).write(str(tmp_path / 'ckpt'))
    saved = tf.train.list_variables(path)
    assert not [key for key, _ in saved if 'shard' in key]  # whole weights only
    # The tied table (the only [V, 16] weight): its 258 rows, no padding row.
    assert [key for key, shape in saved if shape == [lm.VOCAB, 16]] == [
        key for key, _ in saved if 'embedding' in key]
    assert [shape for _, shape in saved if shape and shape[0] in (65, 64, 260)] == []
    expected = whole(trained, trained.VariablesByPath())
    for t in (1, 2):
        task = lm_task(t)
        checkpoints.make(task.VariablesByPath()).read(path).assert_consumed()
        got = whole(task, task.VariablesByPath())
        assert sorted(got) == sorted(expected)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_heads_not_divisible_by_t_name_the_layer_and_the_fix():
    with pytest.raises(ValueError, match=r'pipe/block0/atten: num_heads=2 is not divisible by '
                                         r'tensor_parallel=4: use a multiple of 4 heads, or '
                                         r'set task.pipeline.tensor_parallel to a divisor of 2'):
        lm_task(4, heads=2)


LM_MODEL = 'lm.pystdlib.TinyTransformerLM'  # 2 heads, K=2 (trained and exported at T=2 by
# tests/test_trainer_tensor_parallel.py)


def test_trainer_refuses_heads_not_divisible_by_t_before_the_logdir(tmp_path):
    logdir = str(tmp_path / 'fresh')
    result = th.run(LM_MODEL, logdir, 'unused', '--max_steps=2', '--num_logical_cpus=8',
                    th.overrides(**{'task.pipeline.tensor_parallel': 4}))
    assert result.returncode == 2, result.stderr[-3000:]
    assert th.error_line(result) == (
        'error: task/pipe/block0/atten: num_heads=2 is not divisible by tensor_parallel=4: '
        'use a multiple of 4 heads, or set task.pipeline.tensor_parallel to a divisor of 2')
    assert not os.path.exists(logdir)
