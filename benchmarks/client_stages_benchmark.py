"""ZeRO stages across 2 trainer clients: the step time of each stage against unsharded.

SmallConvPipe (K=2, Adam), 2 trainer clients on loopback (one replica each, 2 logical
CPUs each, 16 examples per client): for each `task.train.sharding` stage ('none',
'optimizer_states', 'gradients', 'weights') a fresh pair of clients trains --steps
steps, and the chief's progress lines give its steps/s (the median of the rates it
logs over the second half of the run, past tracing). The stages run in alternating
rounds (--rounds), so that the shared machine's load falls on all of them alike; it
prints per stage the median steps/s over rounds and the step time relative to 'none'.
What each stage exchanges is in docs/optimizer_sharding.md; the exchanges alone, in one
process, are timed by benchmarks/zero_stages_benchmark.py.

Run (from the repository root; every process it starts is stopped at exit):
    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/client_stages_benchmark.py
        [--steps=60] [--rounds=2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clients_benchmark as cb  # noqa: E402  (its Run, ports and process clean-up)

STAGES = ('none', 'optimizer_states', 'gradients', 'weights')
CLIENTS = 2


def run_stage(root: str, data_dir: str, stage: str, steps: int) -> float:
    """The chief's steps/s for one run of `stage` across CLIENTS fresh clients."""
    spec = 'trainer=' + ','.join(f'127.0.0.1:{cb.free_port()}' for _ in range(CLIENTS))
    runs = [cb.Run([sys.executable, '-m', 'trainer', f'--model={cb.MODEL}',
                    f'--logdir={os.path.join(root, f"{stage}_{task}")}',
                    f'--tfds_data_dir={data_dir}', f'--num_logical_cpus={cb.CPUS_PER_CLIENT}',
                    '--job=trainer', f'--max_steps={steps}',
                    '--gin_bindings=trainer.summary_interval_steps=1',
                    f'--gin_bindings=trainer.save_interval_steps={steps}',
                    f'--params_override=input.train.batch_size={cb.PER_REPLICA_BATCH * CLIENTS}'
                    f",task.train.sharding='{stage}'", f'--task={task}', f'--cluster_spec={spec}'])
            for task in range(CLIENTS)]
    chief = [run.wait() for run in runs][0]
    return statistics.median(chief.rates[len(chief.rates) // 2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--rounds', type=int, default=2)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {stage: [] for stage in STAGES}
    with tempfile.TemporaryDirectory() as root:
        from tfpipe import datasets  # the clients would race to generate it
        data_dir = os.path.join(root, 'data')
        datasets.prepare('tfpipe_shapes', data_dir)
        print(f'load average {os.getloadavg()[0]:.1f}; {cb.MODEL}, {CLIENTS} clients, '
              f'{args.steps} steps per run, {args.rounds} rounds')
        for r in range(args.rounds):
            order = STAGES if r % 2 == 0 else STAGES[::-1]
            for stage in order:
                rates[stage].append(run_stage(os.path.join(root, f'round{r}'), data_dir,
                                              stage, args.steps))
    base = statistics.median(rates['none'])
    for stage in STAGES:
        rate = statistics.median(rates[stage])
        print(f'{stage:<17} {rate:6.2f} steps/s  step time {base / rate:.2f}x none  '
              f'(rounds: {", ".join(f"{x:.2f}" for x in rates[stage])})')


if __name__ == '__main__':
    main()
