"""Cutting a sequence of layers into K contiguous cells.

A *balance* is a list with one entry per cell giving how many consecutive
layers that cell owns (torchgpipe's convention). Everything here is pure
Python so balances can be checked and solved before any model is built.
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence


def even_balance(num_layers: int, num_cells: int) -> list[int]:
    """Split ``num_layers`` into ``num_cells`` sizes differing by at most 1, larger first.

    The default when layers have similar cost; also the concrete suggestion
    used in error messages. Example: ``even_balance(10, 4) == [3, 3, 2, 2]``.
    """
    if num_cells < 1:
        raise ValueError(
            f'num_cells is {num_cells}: a pipeline needs at least one cell; '
            'pass num_cells >= 1.')
    if num_cells > num_layers:
        raise ValueError(
            f'{num_cells} cells but only {num_layers} layers: every cell needs at least '
            f'one layer; use at most {num_layers} cells or more layers.')
    base, extra = divmod(num_layers, num_cells)
    return [base + 1] * extra + [base] * (num_cells - extra)


def _as_int_list(balance: Sequence[int] | None) -> list[int]:
    """Type-check a balance and normalise it to a list of Python ints."""
    if balance is None:
        raise ValueError(
            'balance is None: give one layer count per cell, e.g. '
            'partition.even_balance(num_layers, num_cells).')
    if not isinstance(balance, (list, tuple)) or not all(
            isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in balance):
        raise ValueError(
            f'balance {balance!r} is not a list or tuple of ints: pass one integer layer '
            'count per cell, e.g. [3, 2].')
    if not balance:
        raise ValueError(
            'balance is empty: a pipeline needs at least one cell; pass one layer count '
            'per cell, e.g. [3, 2].')
    return [int(b) for b in balance]


def _check_entries(balance: list[int]) -> None:
    for i, b in enumerate(balance):
        if b < 1:
            raise ValueError(
                f'balance[{i}] is {b}: every cell needs at least one layer; make every '
                'entry >= 1.')


def validate_balance(balance: Sequence[int] | None, num_layers: int) -> list[int]:
    """Check a user-given balance against the body's layer count; return it as a list.

    Catching a bad balance here, with the fix in the message, beats a shape
    error deep inside the partitioned graph.
    """
    entries = _as_int_list(balance)
    if num_layers < 1:
        raise ValueError(
            f'the body has {num_layers} layers: there is nothing to partition; give the '
            'body at least one layer.')
    if len(entries) > num_layers:
        raise ValueError(
            f'balance {entries} has {len(entries)} cells but the body has only '
            f'{num_layers} layers: every cell needs at least one layer; use at most '
            f'{num_layers} cells.')
    _check_entries(entries)
    total = sum(entries)
    if total != num_layers:
        raise ValueError(
            f'balance {entries} covers {total} layers but the body has {num_layers}: '
            f'make the entries sum to {num_layers}, e.g. '
            f'{even_balance(num_layers, len(entries))}.')
    return entries


def _check_costs(costs: Sequence[float], num_cells: int) -> list[float]:
    if num_cells < 1:
        raise ValueError(
            f'num_cells is {num_cells}: a pipeline needs at least one cell; '
            'pass num_cells >= 1.')
    values = []
    for i, c in enumerate(costs):
        if (not isinstance(c, numbers.Real) or isinstance(c, bool)
                or not math.isfinite(c) or c < 0):
            raise ValueError(
                f'costs[{i}] is {c!r}: layer costs must be finite numbers >= 0; '
                'fix the cost estimate for that layer.')
        values.append(float(c))
    if num_cells > len(values):
        raise ValueError(
            f'{num_cells} cells but only {len(values)} layers: every cell needs at least '
            'one layer; use fewer cells or more layers.')
    return values


def solve_balance(costs: Sequence[float], num_cells: int) -> list[int]:
    """Balance minimising the largest per-cell cost (exact block partition).

    The pipeline's throughput is set by its slowest cell, so the objective is
    the maximum block sum. Many balances usually share that maximum, so ties
    are broken in two deterministic steps:

    1. among optimal balances, minimise the sum of squared block costs, so the
       cells that are not the bottleneck are evened out too (uniform costs
       give ``even_balance``: ``[3, 3, 2, 2]``, not ``[3, 3, 3, 1]``);
    2. among those, take the lexicographically largest balance, i.e. earlier
       cells take more layers (``[0, 0, 4, 0, 0, 4, 0, 0]`` -> ``[5, 3]``).

    Both are suffix dynamic programmes, O(K * n^2) in the worst case with
    early exits, which is ample for layer counts in the hundreds. Block sums
    are always differences of the same prefix sums, so comparisons against
    the optimum are exact in floating point; step 2 is exact for integer
    costs and otherwise subject to rounding of the squared sums.

    Example: ``solve_balance([1, 2, 3, 4, 5, 6], 2) == [4, 2]`` (10 | 11).
    """
    values = _check_costs(costs, num_cells)
    n = len(values)
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)
    inf = math.inf

    # best[c][i]: optimal max block sum for layers i..n-1 in exactly c cells.
    best = [[inf] * (n + 1) for _ in range(num_cells + 1)]
    best[0][n] = 0.0
    for c in range(1, num_cells + 1):
        for i in range(n - c, -1, -1):  # at least c layers must remain
            value = inf
            # First block is layers i..j-1; leave at least c-1 layers after it.
            for j in range(i + 1, n - c + 2):
                block = prefix[j] - prefix[i]
                if block >= value:
                    break  # blocks only grow with j (costs >= 0)
                value = min(value, max(block, best[c - 1][j]))
            best[c][i] = value
    optimum = best[num_cells][0]

    # squares[c][i]: least sum of squared block sums for layers i..n-1 in c
    # cells with every block <= optimum; first[c][i]: the first block's end.
    squares = [[inf] * (n + 1) for _ in range(num_cells + 1)]
    first = [[0] * (n + 1) for _ in range(num_cells + 1)]
    squares[0][n] = 0.0
    for c in range(1, num_cells + 1):
        for i in range(n - c, -1, -1):
            for j in range(i + 1, n - c + 2):
                block = prefix[j] - prefix[i]
                if block > optimum:
                    break
                value = block * block + squares[c - 1][j]
                if value <= squares[c][i]:  # '<=': later (larger) j wins ties
                    squares[c][i] = value
                    first[c][i] = j

    balance = []
    start = 0
    for c in range(num_cells, 0, -1):
        stop = first[c][start]
        balance.append(stop - start)
        start = stop
    return balance


def cell_ranges(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: the half-open layer index range of each cell."""
    entries = _as_int_list(balance)
    _check_entries(entries)
    ranges = []
    start = 0
    for b in entries:
        ranges.append((start, start + b))
        start += b
    return ranges


def cell_of_layer(balance: Sequence[int]) -> list[int]:
    """The cell index owning each layer, e.g. ``[2, 1] -> [0, 0, 1]``."""
    return [k for k, (start, stop) in enumerate(cell_ranges(balance))
            for _ in range(start, stop)]
