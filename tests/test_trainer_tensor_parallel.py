"""The trainer with tensor parallelism: image.shapes.TensorParallelMLP.

Bad input (a width T does not divide, more devices than there are) is one line
naming the layer or the count, exit 2, before the logdir exists. A run trained
at T=2 resumes at T=1 from its checkpoint (one whole copy per weight and slot).
"""
import os
import re

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
