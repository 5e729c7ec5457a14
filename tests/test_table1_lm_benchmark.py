"""benchmarks/table1_lm_benchmark.py: its search child finds the most blocks whose predicted
fullest device fits, its table says when a measured host peak is over, and its plot writes
a PNG (or, without matplotlib, says how to install it)."""
import importlib.util

import pytest

from tests.test_table1_benchmark import load_benchmark

lm = load_benchmark('table1_lm_benchmark')  # its siblings are loaded by the import above


def test_search_child_returns_the_most_blocks_whose_prediction_fits():
    # Width 16, one cell: about 2 MiB more working set per block, and a block's prediction
    # moves up to 10% between processes (2 blocks: 6.31-6.93 MiB), as the measured working
    # sets do. So the budget lies midway between 2 and 4 blocks' predictions made in other
    # processes, and the search (in its own) must find 2 or 3 and miss at one more: a
    # fixed 5 MiB fitted 2 blocks in one process and none in another.
    args = dict(k=1, t=1, width=16, m=4)
    two, four = (lm.run_child('predict', dict(args, blocks=b), 1, 2 ** 30, timeout=300)
                 for b in (2, 4))
    budget = (two['peak'] + four['peak']) / 2
    res = lm.run_child('search', dict(args, budget=budget, start=1, resolution=0.0), 1,
                       2 ** 30, timeout=300)
    assert res.get('size') in (2, 3) and res['peak'] <= budget, (res, two, four)
    miss = res['first_miss']
    assert miss['size'] == res['size'] + 1 and miss['peak'] > budget, res
    assert miss['params'] > res['params'] and res['balance'] == [res['size'] + 5]


def results(measured_peak):
    """A two-column table as run_column returns it (K=2's parameters twice K=1's)."""
    column = dict(size=4, params=2_000_000, peak=100 * 2 ** 20, device='CPU:0',
                  first_miss=dict(size=5, peak=130 * 2 ** 20),
                  measured=dict(oom=False, peak=measured_peak))
    return {(1, 1): column, (2, 1): dict(column, size=8, params=4_000_000)}


def test_report_gives_the_ratio_to_k1_and_flags_a_host_peak_over_k_budgets():
    budget = 128 * 2 ** 20
    lines = lm.report(results(measured_peak=200 * 2 ** 20), budget)
    k1, k2 = lines[1], lines[2]
    assert '1.00' in k1 and 'OVER' in k1  # 200 MiB > 1 x 128 MiB
    assert '2.00' in k2 and '200 MiB / 2 = 100 MiB fits' in k2


def test_plot_writes_a_png_or_names_the_extra_to_install(tmp_path):
    path = tmp_path / 'table1_lm.png'
    if importlib.util.find_spec('matplotlib') is None:  # CI's '.[cpu,test]' venv
        with pytest.raises(SystemExit, match=r"pip install -e '\.\[plot\]'"):
            lm.plot(results(1), str(path), 128 * 2 ** 20)
        return
    lm.plot(results(1), str(path), 128 * 2 ** 20)
    data = path.read_bytes()
    assert data.startswith(b'\x89PNG') and len(data) < 100_000


def test_columns_parsing_and_its_error():
    assert lm.parse_columns('1x1,8x1,2x2') == [(1, 1), (8, 1), (2, 2)]
    with pytest.raises(Exception, match='K x T pairs'):
        lm.parse_columns('8')
