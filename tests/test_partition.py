"""Tests for tfpipe.pipeline.partition: balances, checked and solved exactly."""
import itertools

import numpy as np
import pytest

from tfpipe.pipeline import partition


def test_even_balance():
    assert partition.even_balance(10, 4) == [3, 3, 2, 2]
    assert partition.even_balance(8, 4) == [2, 2, 2, 2]
    assert partition.even_balance(5, 1) == [5]
    assert partition.even_balance(3, 3) == [1, 1, 1]
    assert partition.even_balance(7, 2) == [4, 3]


def test_even_balance_errors():
    with pytest.raises(ValueError, match=r'num_cells is 0.*num_cells >= 1'):
        partition.even_balance(4, 0)
    with pytest.raises(ValueError, match=r'5 cells but only 4 layers.*at most 4 cells'):
        partition.even_balance(4, 5)


def test_validate_balance_ok():
    assert partition.validate_balance([3, 2], 5) == [3, 2]
    assert partition.validate_balance((1, 1, 1), 3) == [1, 1, 1]
    assert partition.validate_balance([np.int64(2), 3], 5) == [2, 3]
    assert all(type(b) is int for b in partition.validate_balance([np.int32(5)], 5))


@pytest.mark.parametrize('balance', ['32', [2.0, 3], [True, 4], 5, {2, 3}, [[2], [3]]])
def test_validate_balance_not_ints(balance):
    with pytest.raises(ValueError, match=r'is not a list or tuple of ints.*one integer'):
        partition.validate_balance(balance, 5)


def test_validate_balance_none():
    with pytest.raises(ValueError, match=r'balance is None.*even_balance'):
        partition.validate_balance(None, 5)


def test_validate_balance_empty():
    with pytest.raises(ValueError, match=r'balance is empty.*at least one cell'):
        partition.validate_balance([], 5)


def test_validate_balance_entry_below_one():
    with pytest.raises(ValueError, match=r'balance\[2\] is 0: every cell needs at least '
                                         r'one layer; make every entry >= 1'):
        partition.validate_balance([2, 3, 0, 1], 6)
    with pytest.raises(ValueError, match=r'balance\[0\] is -1'):
        partition.validate_balance([-1, 6], 5)


def test_validate_balance_wrong_sum():
    with pytest.raises(ValueError, match=r'balance \[2, 2\] covers 4 layers but the body '
                                         r'has 5: make the entries sum to 5, e\.g\. '
                                         r'\[3, 2\]'):
        partition.validate_balance([2, 2], 5)
    with pytest.raises(ValueError, match=r'covers 12 layers but the body has 10.*'
                                         r'\[3, 3, 2, 2\]'):
        partition.validate_balance([3, 3, 3, 3], 10)


def test_validate_balance_more_cells_than_layers():
    with pytest.raises(ValueError, match=r'has 4 cells but the body has only 3 layers.*'
                                         r'use at most 3 cells'):
        partition.validate_balance([1, 1, 1, 1], 3)


def test_validate_balance_empty_body():
    with pytest.raises(ValueError, match=r'the body has 0 layers.*at least one layer'):
        partition.validate_balance([1], 0)


def test_solve_balance_example():
    assert partition.solve_balance([1, 2, 3, 4, 5, 6], 2) == [4, 2]


def test_solve_balance_simple_cases():
    assert partition.solve_balance([5.0], 1) == [1]
    assert partition.solve_balance([1, 1, 1, 1], 4) == [1, 1, 1, 1]
    assert partition.solve_balance([1, 1, 1, 1], 1) == [4]
    assert partition.solve_balance([10, 1, 1, 1, 1, 1], 2) == [1, 5]


def test_solve_balance_ties_prefer_earlier_cells_larger():
    # Uniform costs: the bottleneck is 3 either way, but [3, 3, 2, 2] evens out
    # the other cells (fewer squared costs) and puts the larger blocks first.
    assert partition.solve_balance([1.0] * 10, 4) == [3, 3, 2, 2]
    assert partition.solve_balance([2] * 7, 3) == [3, 2, 2]
    # Zero-cost layers join the earliest cell that can take them.
    assert partition.solve_balance([0, 0, 4, 0, 0, 4, 0, 0], 2) == [5, 3]
    assert partition.solve_balance([0, 0, 0], 3) == [1, 1, 1]


def _compositions(n, k):
    """All ways to write n as k positive parts, in order."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        yield [bounds[i + 1] - bounds[i] for i in range(k)]


def _block_sums(costs, balance):
    out, start = [], 0
    for b in balance:
        out.append(sum(costs[start:start + b]))
        start += b
    return out


@pytest.mark.parametrize('integer_costs', [True, False])
def test_solve_balance_matches_brute_force(integer_costs):
    rng = np.random.default_rng(0 if integer_costs else 1)
    checked = 0
    for _ in range(40):
        n = int(rng.integers(1, 9))
        if integer_costs:  # small integers: many exact ties to break
            costs = [float(c) for c in rng.integers(0, 4, size=n)]
        else:
            costs = [float(c) for c in rng.uniform(0.0, 10.0, size=n)]
        for k in range(1, n + 1):
            balance = partition.solve_balance(costs, k)
            assert len(balance) == k and all(b >= 1 for b in balance)
            assert sum(balance) == n
            sums = {tuple(c): _block_sums(costs, c) for c in _compositions(n, k)}
            best = min(max(v) for v in sums.values())
            got = _block_sums(costs, balance)
            assert max(got) == pytest.approx(best, rel=1e-12, abs=0)
            if integer_costs:  # exact arithmetic: check the documented tie-breaks
                optimal = {c: v for c, v in sums.items() if max(v) == best}
                least = min(sum(x * x for x in v) for v in optimal.values())
                assert sum(x * x for x in got) == least
                assert tuple(balance) == max(
                    c for c, v in optimal.items() if sum(x * x for x in v) == least)
            checked += 1
    assert checked > 80


def test_solve_balance_errors():
    with pytest.raises(ValueError, match=r'num_cells is 0.*num_cells >= 1'):
        partition.solve_balance([1, 2], 0)
    with pytest.raises(ValueError, match=r'3 cells but only 2 layers.*use fewer cells or '
                                         r'more layers'):
        partition.solve_balance([1, 2], 3)
    with pytest.raises(ValueError, match=r'1 cells but only 0 layers'):
        partition.solve_balance([], 1)
    with pytest.raises(ValueError, match=r'costs\[1\] is -1.*finite numbers >= 0'):
        partition.solve_balance([1, -1, 2], 2)
    with pytest.raises(ValueError, match=r'costs\[0\] is nan.*finite'):
        partition.solve_balance([float('nan'), 1], 1)
    with pytest.raises(ValueError, match=r'costs\[2\] is inf.*finite'):
        partition.solve_balance([1, 1, float('inf')], 2)
    with pytest.raises(ValueError, match=r"costs\[0\] is 'a'.*finite numbers"):
        partition.solve_balance(['a'], 1)


def test_solve_balance_accepts_numpy_costs():
    assert partition.solve_balance(np.array([1.0, 2, 3, 4, 5, 6], np.float32), 2) == [4, 2]


def test_cell_ranges_and_cell_of_layer():
    assert partition.cell_ranges([3, 1, 2]) == [(0, 3), (3, 4), (4, 6)]
    assert partition.cell_of_layer([3, 1, 2]) == [0, 0, 0, 1, 2, 2]
    assert partition.cell_of_layer((1,)) == [0]


def test_cell_ranges_errors():
    with pytest.raises(ValueError, match=r'balance\[1\] is 0'):
        partition.cell_ranges([2, 0])
    with pytest.raises(ValueError, match=r'balance is empty'):
        partition.cell_of_layer([])
