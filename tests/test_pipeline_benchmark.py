"""The benchmark runs the trainer's step and prints only what it measured (tiny sizes)."""
import os
import subprocess
import sys

from tests import trainer_helpers as th

TINY = ['--quick', '--act_batch=64', '--act_width=32', '--act_layers=4', '--acc_batch=16',
        '--acc_width=64', '--acc_layers=4', '--skip_batch=32', '--skip_width=16',
        '--emb_batch=4', '--emb_length=8', '--emb_dim=16', '--mem_repeats=1',
        '--num_logical_cpus=4']


def run_benchmark(*flags):
    env = th.env()
    env.pop('TF_CPU_ALLOCATOR_USE_BFC', None)  # the benchmark must switch it on itself
    return subprocess.run([sys.executable, os.path.join('benchmarks', 'pipeline_benchmark.py'),
                           *TINY, *flags], env=env, cwd=th.REPO, capture_output=True,
                          text=True, timeout=600)


def table_rows(stdout, row):
    return [line for line in stdout.splitlines() if line.split()[:1] == [str(row)]]


def test_memory_rows_run_the_trainers_step_and_check_the_accumulation_bound():
    result = run_benchmark('--rows=3,4,5,6')
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert 'shared notes measured' not in out  # a figure this run did not measure
    assert "every variant runs the trainer's step" in out
    accum = table_rows(out, 4)
    assert [line.split()[4] for line in accum] == ['M=1', 'M=4', 'M=8'], accum
    assert 'bound: M=1 peak + one gradient set' in accum[1]
    assert 'flat from M=4' in accum[2]
    for line in accum[1:]:
        assert ' PASS ' in line or ' MISS ' in line
    skip, = table_rows(out, 5)
    assert 'from the traced graph' in skip
    assert float(skip.split('MiB')[1].split()[0]) < 1.0  # fewer bytes than carrying the skip
    sparse = table_rows(out, 6)
    assert ['V=258', 'V=32768'] == [line.split()[4] for line in sparse], sparse
