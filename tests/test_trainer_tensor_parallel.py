"""The trainer with tensor parallelism: image.shapes.TensorParallelMLP, the LM, the MT model.

Bad input (a width T does not divide, more devices than there are) is one line
naming the layer or the count, exit 2, before the logdir exists. A run trained
at T=2 resumes at T=1 from its checkpoint (one whole copy per weight and slot).
The LM trained at T=2 exports, and gets from its evaler and decoder jobs (which build the
recorded T=2) the scores and greedy decodes of the same jobs at T=1 on the same
checkpoint; the MT model trained with Adafactor at T=2 has the T=1 run's losses.
"""
import concurrent.futures
import json
import os
import re
import shutil

import numpy as np
import pytest

from tests import trainer_helpers as th

MODEL = 'image.shapes.TensorParallelMLP'

CASES = [
    ('width', ['--num_logical_cpus=8', th.overrides(**{'task.pipeline.tensor_parallel': 3})],
     r'^error: task/pipe/embed: output_dim=64 is not divisible by tensor_parallel=3: '
     r'make output_dim a multiple of 3'),
    ('devices', [th.overrides(**{'task.pipeline.tensor_parallel': 4})],
     r'num_replicas x cells x tensor_parallel = 1 x 2 x 4 = 8 devices but 4 are available'),
]


@pytest.mark.parametrize('what,flags,message', CASES, ids=[c[0] for c in CASES])
def test_bad_tensor_parallel_exits_2_before_the_logdir(what, flags, message, tmp_path,
                                                       data_dir):
    logdir = str(tmp_path / 'fresh')
    result = th.run(MODEL, logdir, data_dir, '--max_steps=2', *flags)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(message, th.error_line(result)), th.error_line(result)
    assert not os.path.exists(logdir)


def test_trained_at_t2_resumes_at_t1(tmp_path, data_dir):
    logdir = str(tmp_path / 'run')
    t2 = th.run(MODEL, logdir, data_dir, *th.fast_flags(2, 2),
                th.overrides(**{'task.pipeline.tensor_parallel': 2}))
    assert t2.returncode == 0, t2.stderr[-3000:]
    with open(os.path.join(logdir, 'train', 'params.txt')) as f:
        assert re.search(r'tensor_parallel\s*[:=]\s*2', f.read())
    t1 = th.run(MODEL, logdir, data_dir, *th.fast_flags(3, 1))
    assert t1.returncode == 0, t1.stderr[-3000:]
    assert re.search(r'restored .*ckpt-2 at step 2', t1.stderr), t1.stderr[-3000:]
    assert sorted(th.losses_by_step(os.path.join(logdir, 'train'))) == [1, 2, 3]


# --- The LM's evaler and decoder jobs, and the MT model, at T=2 against T=1 ---------------

LM = 'lm.pystdlib.TinyTransformerLM'  # 2 heads: T=2 on its K=2 cells fills the 4 CPUs
LM_JOB_SIZES = {'task.eval.samples_per_summary': 32,
                'task.eval.decoder_samples_per_summary': 2, 'task.decoder.num_new_tokens': 4}


def side_by_side(*runs):
    """th.run(*args) of each run at the same time; every one must succeed."""
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        results = list(pool.map(lambda args: th.run(*args), runs))
    for result in results:
        assert result.returncode == 0, th.failure(result)
    return results


@pytest.fixture(scope='module')
def lm_jobs(tmp_path_factory, data_dir):
    """TinyTransformerLM trained 2 steps at T=2 ('trained'); then, side by side, its export
    and its evaler on dev and decoder on test on two copies of the logdir: as recorded
    (T=2) and with tensor_parallel=1."""
    root = tmp_path_factory.mktemp('lm_t2')
    trained = str(root / 'run')
    side_by_side((LM, trained, data_dir, *th.fast_flags(2, 2),
                  th.overrides(**{'task.pipeline.tensor_parallel': 2}, **LM_JOB_SIZES)))
    copies = {t: str(root / f't{t}') for t in (2, 1)}
    for copy in copies.values():
        shutil.copytree(trained, copy)
    side_by_side((LM, trained, data_dir, '--mode=export'),
                 (LM, copies[2], data_dir, '--job=evaler_dev,decoder_test'),
                 (LM, copies[1], data_dir, '--job=evaler_dev,decoder_test',
                  th.overrides(**{'task.pipeline.tensor_parallel': 1})))
    return {'trained': trained, **copies}


def test_lm_trains_and_exports_at_t2(lm_jobs):
    losses = th.losses_by_step(os.path.join(lm_jobs['trained'], 'train'))
    assert sorted(losses) == [1, 2] and all(np.isfinite(list(losses.values())))
    assert os.path.exists(os.path.join(lm_jobs['trained'], 'export', '2', 'saved_model.pb'))


def scores(path):
    with open(path) as f:
        return {k: float(v) for k, v in (line.split(': ') for line in f)}


def test_lm_evaler_and_decoder_at_t2_equal_t1_on_the_same_checkpoint(lm_jobs):
    with open(os.path.join(lm_jobs[2], 'train', 'params.txt')) as f:
        assert re.search(r'tensor_parallel\s*[:=]\s*2', f.read())  # the jobs built T=2
    t2, t1 = (scores(os.path.join(lm_jobs[t], 'eval_dev', 'score-2.txt')) for t in (2, 1))
    assert t2['num_examples'] == t1['num_examples'] == 32
    for key in ('log_pplx', 'perplexity', 'accuracy'):
        np.testing.assert_allclose(t2[key], t1[key], rtol=1e-5, err_msg=key)
    decodes = {}
    for t in (2, 1):
        with open(os.path.join(lm_jobs[t], 'decoder_test', 'decoder_out-2.jsonl')) as f:
            decodes[t] = [json.loads(line) for line in f]
    assert len(decodes[2]) == len(decodes[1]) == 2
    for got, expected in zip(decodes[2], decodes[1]):
        assert got['prompt'] == expected['prompt']
        assert got['greedy']['ids'] == expected['greedy']['ids']
        np.testing.assert_allclose(got['greedy']['log_probs'], expected['greedy']['log_probs'],
                                   rtol=1e-4)


def test_mt_trained_at_t2_with_adafactor_has_the_t1_losses(tmp_path, data_dir):
    """Adafactor, whose update reads statistics of the whole weight (reduced over the shards
    at T=2: tfpipe/split_statistics.py): step 2's loss follows step 1's update."""
    model = 'mt.reverse.TransformerPipe'  # 4 heads, K=2: T=2 fills the 4 CPUs
    override = tmp_path / 'adafactor.txt'
    override.write_text('task.train.optimizer : Params(cls=tfpipe.optimizers.Adafactor)\n')
    logdirs = {t: str(tmp_path / f't{t}') for t in (2, 1)}
    side_by_side(*[(model, logdirs[t], data_dir, *th.fast_flags(2, 2),
                    f'--params_file_override={override}',
                    th.overrides(**{'task.pipeline.tensor_parallel': t})) for t in (2, 1)])
    t2, t1 = (th.losses_by_step(os.path.join(logdirs[t], 'train')) for t in (2, 1))
    assert sorted(t2) == sorted(t1) == [1, 2]
    for step in t1:
        np.testing.assert_allclose(t2[step], t1[step], rtol=1e-5, err_msg=f'step {step}')
