"""benchmarks/zero_stages_largest_lm.py: its one-block walk finds the largest size that fits
from either side, its measuring child trains each stage (R=2 x K=1 of a width-16 LM), and
bad flags are refused before any child starts."""
import pytest

from tests.test_table1_benchmark import load_benchmark

load_benchmark('table1_lm_benchmark')  # its siblings, which the benchmark imports
zs = load_benchmark('zero_stages_largest_lm')


def _linear(size: int) -> dict:
    return dict(peak=10 * size, oom=False, params=size, step_s=1.0)


@pytest.mark.parametrize('start', [2, 5, 7, 9])
def test_the_walk_finds_the_largest_fitting_size_from_below_and_from_above(start):
    walked = []
    res = zs.step_search(lambda n: walked.append(n) or _linear(n), start, 73)
    assert res['size'] == 7 and res['first_miss']['size'] == 8
    assert res['probes'] == len(set(walked)) == abs(start - 7) + 1 + (start <= 7)


def test_nothing_fits_is_said_without_a_size():
    assert zs.step_search(_linear, 3, 5) == dict(probes=3)


@pytest.mark.parametrize('stage', ['optimizer_states', 'weights+regather'])
def test_the_measuring_child_trains_the_stage_and_reports_its_peak(stage):
    res = zs.run_child('measure', dict(stage=stage, replicas=2, k=1, blocks=1, width=16, m=2),
                       2, 2 ** 30, timeout=300, script=zs.__file__)
    assert not res['oom'] and res['peak'] > 0 and res['params'] > 0
    assert 0 < res['loss'] < 10  # a byte LM's first steps: about log(258)


@pytest.mark.parametrize('argv, named', [(['--stages=weights,zero'], "unknown ['zero']"),
                                         (['--replicas=1'], '--replicas=1'),
                                         (['--replicas=4', '--micro_batches=8'], 'divide')])
def test_bad_flags_exit_2_before_any_child(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        zs.parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]
