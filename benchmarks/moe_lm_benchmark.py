"""The MoE language model against the dense one at equal active FLOPs per token.

Trains lm.pystdlib.TinyTransformerLM and lm.pystdlib.TinyMoETransformerLM (block1's
feed-forward 8 experts of half the dense width, top-2: the same FLOPs per token;
--full: the 4-block TransformerLM pair) for the same steps, one after the other in
one run, each with its evaler on dev, and prints per model the dev perplexity after
those steps, the training seconds (the trainer's own 'trained steps ... in S s'
line, tracing included) and, for the MoE model, its last progress line's aux_loss
and dropped_fraction. Then, at equal wall time, the dense model once more for the
steps its measured rate fits into the MoE model's training seconds (its learning-rate
schedule follows those steps, as a run given that budget would), and its dev
perplexity beside the MoE model's.

--capacity_factors=1.0,1.25,1.5,2.0 trains the MoE model once per training capacity
factor instead (the evaluation factor stays E / top_k: the evaler drops nothing) and prints
for each the tokens dropped in training (the mean of the progress lines' dropped_fraction
over the last 10% of steps: the router is trained by then), the dev perplexity and the
training seconds: what a smaller capacity saves and what its drops cost.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/moe_lm_benchmark.py
        [--max_steps=300] [--full] [--capacity_factors=1.0,1.25,1.5,2.0]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def train(model: str, max_steps: int, repo: str, *flags: str) -> dict:
    env = dict(os.environ, PYTHONPATH=repo, TF_CPP_MIN_LOG_LEVEL='2')
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [sys.executable, '-m', 'trainer', f'--model={model}', f'--logdir={tmp}/run',
             '--job=trainer,evaler_dev', f'--max_steps={max_steps}',
             '--gin_bindings=trainer.eval_poll_max_seconds=1', *flags],
            env=env, cwd=repo, check=True, capture_output=True, text=True)
        with open(f'{tmp}/run/eval_dev/score-{max_steps}.txt') as f:
            out = {k: float(v) for k, v in (line.strip().split(': ') for line in f)}
    out['seconds'] = float(re.findall(r'trained steps \d+\.\.\d+ in ([\d.]+)s',
                                      result.stderr)[-1])
    last = [line for line in result.stderr.splitlines() if f'step {max_steps}/' in line][-1]
    out.update((k, float(v)) for k, v in re.findall(r'(aux_loss|dropped_fraction) ([\d.]+)',
                                                     last))
    tail = [(int(step), float(v)) for step, v in re.findall(
        r'step (\d+)/\d+.*?dropped_fraction ([\d.]+)', result.stderr)]
    tail = [v for step, v in tail if step > 0.9 * max_steps]
    if tail:
        out['dropped_tail'] = sum(tail) / len(tail)
    return out


def capacity_sweep(model: str, factors: list[float], max_steps: int, repo: str) -> None:
    """One training run per capacity factor of every MoE layer of `model`."""
    import model_registry
    body = model_registry.get_params(model).task.pipeline.body
    where = [i for i, p in enumerate(body) if 'capacity_factor' in p]
    print(f'{model}: MoE layers at body{where}; {max_steps} steps each')
    for factor in factors:
        override = ','.join(f'task.pipeline.body[{i}].capacity_factor={factor}' for i in where)
        run = train(model, max_steps, repo, f'--params_override={override}',
                    '--gin_bindings=trainer.summary_interval_steps=1')
        print(f'capacity_factor {factor:.2f}: tokens dropped in training '
              f'{run.get("dropped_tail", float("nan")):.3f} (last steps), dev perplexity '
              f'{run["perplexity"]:.2f}, {run["seconds"]:.0f} s of training')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--max_steps', type=int, default=300)
    parser.add_argument('--full', action='store_true')
    parser.add_argument('--capacity_factors', default='',
                        help='comma-separated training capacity factors to sweep instead')
    args = parser.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prefix = '' if args.full else 'Tiny'
    print(f'load average {os.getloadavg()[0]:.1f}; {args.max_steps} steps each')
    if args.capacity_factors:
        capacity_sweep(f'lm.pystdlib.{prefix}MoETransformerLM',
                       [float(f) for f in args.capacity_factors.split(',')], args.max_steps,
                       repo)
        return
    runs = {}
    for kind in ('', 'MoE'):
        model = f'lm.pystdlib.{prefix}{kind}TransformerLM'
        runs[model] = run = train(model, args.max_steps, repo)
        extra = ''.join(f'  train {k} {run[k]:.4f}' for k in ('aux_loss', 'dropped_fraction')
                        if k in run)
        print(f'{model}: dev perplexity {run["perplexity"]:.2f} (log {run["log_pplx"]:.3f}), '
              f'accuracy {run["accuracy"]:.3f}; {run["seconds"]:.0f} s of training{extra}')
    dense, moe = runs.values()
    print(f'MoE / dense: log-perplexity {moe["log_pplx"] / dense["log_pplx"]:.3f}x, '
          f'training time {moe["seconds"] / dense["seconds"]:.2f}x')
    steps = round(args.max_steps * moe['seconds'] / dense['seconds'])
    longer = train(f'lm.pystdlib.{prefix}TransformerLM', steps, repo)
    print(f'equal wall time: dense for {steps} steps ({longer["seconds"]:.0f} s): dev '
          f'perplexity {longer["perplexity"]:.2f} (log {longer["log_pplx"]:.3f}); MoE for '
          f'{args.max_steps} steps ({moe["seconds"]:.0f} s): {moe["perplexity"]:.2f} '
          f'(log {moe["log_pplx"]:.3f}); MoE / dense log-perplexity '
          f'{moe["log_pplx"] / longer["log_pplx"]:.3f}x')


if __name__ == '__main__':
    main()
