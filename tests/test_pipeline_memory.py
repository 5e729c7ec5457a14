"""Peak memory of the schedules, measured with the BFC allocator in a subprocess."""
import json
import subprocess
import sys

from tests import trainer_helpers as th


def test_1f1b_peak_at_m8_is_at_most_fill_drains():
    """1F1B holds at most K-k micro-batches of activations on cell k, fill-drain all M."""
    result = subprocess.run(
        [sys.executable, '-m', 'tests.pipeline_memory_probe', 'fill_drain', '1f1b'],
        env=th.env(), cwd=th.REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    by_policy = json.loads(result.stdout.strip().splitlines()[-1])
    for recompute, peaks in by_policy.items():
        assert peaks['fill_drain'] > 0 and peaks['1f1b'] > 0, recompute
        assert peaks['1f1b'] <= peaks['fill_drain'], (recompute, by_policy)
    # Without recompute every activation is held, so 1F1B's bound shows clearly (a 1F1B
    # that ran in fill-drain order would tie): measured 8.9 vs 20.2 MB on 2 cores.
    never = by_policy['never']
    assert never['1f1b'] < 0.75 * never['fill_drain'], by_policy
