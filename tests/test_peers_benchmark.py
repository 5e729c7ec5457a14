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


LM_SCRIPT = os.path.join(th.REPO, 'benchmarks', 'peers_lm_benchmark.py')


def test_the_lm_comparison_refuses_bad_configs_in_one_line(tmp_path):
    for flags, problem in ((['--configs=1x4'], '1x4 needs 2 <= K <= 8'),
                           (['--configs=4x3'], 'M dividing the batch 8'),
                           (['--configs=4-4'], "--configs='4-4': write KxM items"),
                           (['--rounds=0'], '--rounds and --steps must be >= 1')):
        done = subprocess.run([sys.executable, LM_SCRIPT, f'--venvs={tmp_path}', *flags],
                              cwd=th.REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, (flags, done.stderr)
        assert problem in done.stderr.strip().splitlines()[-1], (flags, done.stderr)
    assert os.listdir(tmp_path) == []


def test_the_lm_workers_cut_the_registered_models_cells_alike():
    """torch's stages (lm_shape.blocks_per_cell) hold the blocks of the registered K=4
    balance, whose first cell adds embedding and positions, its last unpack, final
    LayerNorm and logits: the two systems pipeline the same cut."""
    sys.path.insert(0, os.path.join(th.REPO, 'benchmarks', 'peers'))
    try:
        import lm_shape
    finally:
        sys.path.pop(0)
    import model_registry
    params = model_registry.get_params('lm.pystdlib.GPT2SmallShapedLM')
    is_block = [layer.name.startswith('block') for layer in params.task.pipeline.body]
    balance = params.task.pipeline.balance
    starts = [sum(balance[:k]) for k in range(len(balance))]
    per_cell = [sum(is_block[s:s + n]) for s, n in zip(starts, balance)]
    assert per_cell == lm_shape.blocks_per_cell(len(balance))
    width, hidden, heads, num_blocks = model_registry.get_class(
        'lm.pystdlib.GPT2SmallShapedLM').SIZES
    assert (width, hidden, heads, num_blocks) == (lm_shape.WIDTH, lm_shape.HIDDEN,
                                                 lm_shape.HEADS, lm_shape.BLOCKS)
