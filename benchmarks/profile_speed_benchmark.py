"""tfpipe profile-speed benchmark: the planner's per-layer profile, with identical layers
timed once and long calls timed fewer times, against timing every layer 7 times.

`--mode=inspect_pipeline` starts by profiling every body layer (tfpipe/tuning/profile.py):
three tf.functions per layer, each called 2 + 5 times at two batch sizes, then the whole
body the same way. On GPT2SmallShapedLM (12 identical blocks, a block's forward and
backward about a second each here) that alone took many minutes. Now a layer defined like
an earlier one (but for its name) and fed the same shapes copies the earlier one's times,
and the timed calls of one function stop once they took TIMING_BUDGET_SECONDS together.

Both ways run on the model's real first batch, alternating, in one process; printed: the
seconds of each (median over rounds), their ratio, how many layers each timed, and how far
apart their step predictions are (the sum over layers of forward + backward at the whole
batch, which the planner's search adds up per cell).

Run (from the repository root):
    PYTHONPATH=. python benchmarks/profile_speed_benchmark.py                 # ~1 minute
    PYTHONPATH=. python benchmarks/profile_speed_benchmark.py \\
        --model=lm.pystdlib.GPT2SmallShapedLM --rounds=1                       # ~30 minutes
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Iterator


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--model', default='lm.pystdlib.TransformerLM')
    ap.add_argument('--rounds', type=int, default=2)
    return ap.parse_args(argv)


@contextlib.contextmanager
def _budget(seconds: float) -> Iterator[None]:
    from tfpipe.tuning import profile
    saved, profile.TIMING_BUDGET_SECONDS = profile.TIMING_BUDGET_SECONDS, seconds
    try:
        yield
    finally:
        profile.TIMING_BUDGET_SECONDS = saved


def main(argv=None) -> None:
    args = parse_args(argv)
    import tfpipe
    tfpipe.configure_logical_cpus(8)  # the trainer's --num_logical_cpus default
    import model_registry
    from tfpipe.tuning import profile
    from trainer.inspect_modes import sample_inputs

    params = model_registry.get_params(args.model)
    task = params.task.Instantiate()
    sample, batch = sample_inputs(params, task)
    sizes = profile.profiling_batch_sizes(batch, params.task.pipeline.num_micro_batches)
    body = params.task.pipeline.body
    ways = {'every layer, 7 calls': (False, float('inf')),
            'identical once, budget': (True, profile.TIMING_BUDGET_SECONDS)}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    steps: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, (share, budget) in ways.items():
            with _budget(budget):
                start = time.perf_counter()
                profiles = profile.profile_body(body, sample, task.pipe.devices[0], sizes,
                                                share_identical=share)
                seconds[name].append(time.perf_counter() - start)
            steps[name] = sum(p.forward(batch) + p.backward(batch) for p in profiles)
    print(f'{args.model}: {len(body)} body layers, batch {batch}, sizes {sizes}, '
          f'{args.rounds} round(s)')
    for name in ways:
        print(f'  {name:24s} {statistics.median(seconds[name]):8.1f} s   predicted body '
              f'forward+backward {steps[name]:.4g} s')
    old, new = (statistics.median(seconds[name]) for name in ways)
    print(f'  profile time: {new / old:.2f}x (new / old); predictions '
          f'{steps["identical once, budget"] / steps["every layer, 7 calls"]:.3f}x')


if __name__ == '__main__':
    main()
