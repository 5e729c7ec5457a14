"""benchmarks/zero_stages_largest_lm.py: its one-block walk finds the largest size that fits
from either side, its measuring child trains each stage (R=2 x K=1 of a width-16 LM), and
bad flags are refused before any child starts."""
import pytest

from tests.test_table1_benchmark import load_benchmark

load_benchmark('table1_lm_benchmark')  # its siblings, which the benchmark imports
zs = load_benchmark('zero_stages_largest_lm')


def _linear(size: int) -> dict:
    return dict(peak=10 * size, oom=False, params=size, step_s=1.0)


@pytest.mark.parametrize('start', [2, 5, 7, 9, 14, 40])
@pytest.mark.parametrize('bend', [0.0, 0.8])
def test_the_walk_finds_the_largest_fitting_size_from_below_and_from_above(start, bend):
    """From within a factor of two, a peak linear in the size is found in at most four
    probes (start, the next size, the line's answer and the one beside it); steps are at
    most about half the known size, so a far start halves its way there; a peak that
    bends up is found too."""
    def peak(size):
        return dict(_linear(size), peak=10 * size + bend * size * size)

    walked = []
    res = zs.step_search(lambda n: walked.append(n) or peak(n), start, 73)
    best = max(n for n in range(1, 20) if peak(n)['peak'] <= 73)
    assert res['size'] == best and res['first_miss']['size'] == best + 1
    assert res['probes'] == len(walked) == len(set(walked))
    if not bend and best / 2 <= start <= 2 * best:
        assert len(walked) <= 4
    assert min(walked) >= min(start, best // 2)  # never far below the answer


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
