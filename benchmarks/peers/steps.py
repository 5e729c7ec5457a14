"""The model and the timing every peer worker shares, so the three systems are measured alike.

Each worker (tfpipe_pipe.py, torch_pipe.py, lingvo_pipe.py) runs in its own system's Python
(the peers in their own venvs), so this module imports nothing beyond the standard library.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

# 8 x Dense(1024) relu, batch 256, SGD lr 0.01, loss mean(y^2): issue 26's model.
LAYERS, WIDTH, BATCH, LEARNING_RATE = 8, 1024, 256, 0.01


def parse_args(description: str) -> argparse.Namespace:
    """The arguments every worker takes; the parent (peers_benchmark.py) passes them all."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument('--configs', required=True, help='KxM, comma-separated, e.g. 2x1,4x8')
    ap.add_argument('--threads', default='default',
                    help="the system's thread setting: 'default', N (torch) or intra/inter (TF)")
    ap.add_argument('--warmup', type=int, default=3)
    ap.add_argument('--steps', type=int, default=10)
    return ap.parse_args()


def configs(text: str) -> list[tuple[int, int]]:
    """'2x1,4x8' -> [(2, 1), (4, 8)]: (cells K, micro-batches M)."""
    return [tuple(int(v) for v in item.split('x')) for item in text.split(',')]


def median_step_ms(step: Callable[[], None], warmup: int, steps: int) -> float:
    """Median wall time of `steps` calls after `warmup` untimed ones; `step` must return
    only when the step's work is done (the caller synchronises)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def report(cells: int, micro: int, ms: float, **extra) -> None:
    """One JSON line per config on stdout, the only thing the parent reads."""
    print(json.dumps({'config': f'{cells}x{micro}', 'ms': ms, **extra}), flush=True)
