"""benchmarks/peers_benchmark.py's own checks, without installing the peers: bad arguments
stop it with one line before anything runs, and a venv pip cannot fill stops it with one line
naming the venv and leaves no half-made venv behind (the next run would otherwise reuse it)."""
import os
import subprocess
import sys

from tests import trainer_helpers as th

SCRIPT = os.path.join(th.REPO, 'benchmarks', 'peers_benchmark.py')


def run(*flags, env=None):
    return subprocess.run([sys.executable, SCRIPT, *flags], cwd=th.REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bad_configs_and_systems_stop_with_one_line_and_status_2(tmp_path):
    venvs = f'--venvs={tmp_path}'
    for flags, problem in ((['--configs=3x4'], '3x4 needs K >= 2 dividing 8'),
                           (['--configs=2x5'], '2x5 needs K >= 2 dividing 8'),
                           (['--configs=2-4'], "--configs='2-4': write KxM items"),
                           (['--systems=tfpipe,jax'], 'pick from tfpipe,torch,lingvo'),
                           (['--rounds=0'], '--rounds=0: at least 1')):
        done = run(venvs, *flags)
        assert done.returncode == 2, (flags, done.stderr)
        assert problem in done.stderr.strip().splitlines()[-1], (flags, done.stderr)
        assert done.stdout == ''
    assert os.listdir(tmp_path) == []


def test_a_venv_pip_cannot_fill_fails_in_one_line_and_is_removed(tmp_path):
    wheels = tmp_path / 'no-wheels'
    wheels.mkdir()
    env = dict(os.environ, PIP_NO_INDEX='1', PIP_FIND_LINKS=str(wheels))
    done = run(f'--venvs={tmp_path}', '--systems=tfpipe,torch', '--configs=2x4', env=env)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f'peers_benchmark: cannot make the torch venv in {tmp_path}/torch: '
                           'install -q torch==2.13.0+cpu numpy failed: ERROR: '), last
    assert 'torch==2.14.1' in last
    assert sorted(os.listdir(tmp_path)) == ['no-wheels']
