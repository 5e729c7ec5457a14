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

Other layouts by flags: --stages picks the stages (e.g. none,weights), --overrides adds
params overrides to every run, --model and --cpus_per_client set the model and each
client's logical CPUs (its K x T devices). Stage 3 at T=2 (TensorParallelMLP, K=2 x T=2)
and at P=2 (the MoE LM, the 2 clients one expert group):
    ... --model=image.shapes.TensorParallelMLP --cpus_per_client=4 --stages=none,weights
        --overrides=task.pipeline.tensor_parallel=2
    ... --model=lm.pystdlib.TinyMoETransformerLM --stages=none,weights
        --overrides=task.pipeline.expert_parallel=2

Run (from the repository root; every process it starts is stopped at exit):
    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/client_stages_benchmark.py
        [--steps=60] [--rounds=2] [--model=...] [--stages=...] [--overrides=...]
        [--cpus_per_client=2]
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


def run_stage(root: str, data_dir: str, stage: str, args: argparse.Namespace) -> float:
    """The chief's steps/s for one run of `stage` across CLIENTS fresh clients."""
    spec = 'trainer=' + ','.join(f'127.0.0.1:{cb.free_port()}' for _ in range(CLIENTS))
    overrides = ''.join(f',{o}' for o in args.overrides)
    runs = [cb.Run([sys.executable, '-m', 'trainer', f'--model={args.model}',
                    f'--logdir={os.path.join(root, f"{stage}_{task}")}',
                    f'--tfds_data_dir={data_dir}', f'--num_logical_cpus={args.cpus_per_client}',
                    '--job=trainer', f'--max_steps={args.steps}',
                    '--gin_bindings=trainer.summary_interval_steps=1',
                    f'--gin_bindings=trainer.save_interval_steps={args.steps}',
                    f'--params_override=input.train.batch_size={cb.PER_REPLICA_BATCH * CLIENTS}'
                    f",task.train.sharding='{stage}'{overrides}", f'--task={task}',
                    f'--cluster_spec={spec}'])
            for task in range(CLIENTS)]
    chief = [run.wait() for run in runs][0]
    return statistics.median(chief.rates[len(chief.rates) // 2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--model', default=cb.MODEL)
    parser.add_argument('--stages', type=lambda s: s.split(','), default=list(STAGES),
                        help="comma-separated, 'none' first: the others' step time is "
                        "relative to it")
    parser.add_argument('--overrides', type=lambda s: s.split(','), default=[],
                        help='comma-separated params overrides added to every run, e.g. '
                        'task.pipeline.tensor_parallel=2')
    parser.add_argument('--cpus_per_client', type=int, default=cb.CPUS_PER_CLIENT)
    args = parser.parse_args()
    if args.stages[0] != 'none' or not set(args.stages) <= set(STAGES):
        parser.error(f"--stages={','.join(args.stages)}: give 'none' first, then any of "
                     f"{', '.join(STAGES[1:])}")
    rates: dict[str, list[float]] = {stage: [] for stage in args.stages}
    with tempfile.TemporaryDirectory() as root:
        from tfpipe import datasets  # the clients would race to generate it
        data_dir = os.path.join(root, 'data')
        datasets.prepare('tfpipe_shapes', data_dir)
        print(f'load average {os.getloadavg()[0]:.1f}; '
              f"{' '.join([args.model, *args.overrides])}, {CLIENTS} clients, "
              f'{args.steps} steps per run, {args.rounds} rounds')
        for r in range(args.rounds):
            order = args.stages if r % 2 == 0 else args.stages[::-1]
            for stage in order:
                rates[stage].append(run_stage(os.path.join(root, f'round{r}'), data_dir,
                                              stage, args))
    base = statistics.median(rates['none'])
    for stage in args.stages:
        rate = statistics.median(rates[stage])
        print(f'{stage:<17} {rate:6.2f} steps/s  step time {base / rate:.2f}x none  '
              f'(rounds: {", ".join(f"{x:.2f}" for x in rates[stage])})')


if __name__ == '__main__':
    main()
