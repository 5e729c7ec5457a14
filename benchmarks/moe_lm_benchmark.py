"""The MoE language model against the dense one at equal active FLOPs per token.

Trains lm.pystdlib.TinyTransformerLM and lm.pystdlib.TinyMoETransformerLM (block1's
feed-forward 8 experts of half the dense width, top-2: the same FLOPs per token;
--full: the 4-block TransformerLM pair) for the same steps, one after the other in
one run, each with its evaler on dev, and prints per model the dev perplexity after
those steps, the training seconds (the trainer's own 'trained steps ... in S s'
line, tracing included) and, for the MoE model, its last progress line's aux_loss
and dropped_fraction. Equal steps, not equal wall time: the seconds say what the
MoE model's steps cost here.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/moe_lm_benchmark.py
        [--max_steps=300] [--full]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def train(model: str, max_steps: int, repo: str) -> dict:
    env = dict(os.environ, PYTHONPATH=repo, TF_CPP_MIN_LOG_LEVEL='2')
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [sys.executable, '-m', 'trainer', f'--model={model}', f'--logdir={tmp}/run',
             '--job=trainer,evaler_dev', f'--max_steps={max_steps}',
             '--gin_bindings=trainer.eval_poll_max_seconds=1'],
            env=env, cwd=repo, check=True, capture_output=True, text=True)
        with open(f'{tmp}/run/eval_dev/score-{max_steps}.txt') as f:
            out = {k: float(v) for k, v in (line.strip().split(': ') for line in f)}
    out['seconds'] = float(re.findall(r'trained steps \d+\.\.\d+ in ([\d.]+)s',
                                      result.stderr)[-1])
    last = [line for line in result.stderr.splitlines() if f'step {max_steps}/' in line][-1]
    out.update((k, float(v)) for k, v in re.findall(r'(aux_loss|dropped_fraction) ([\d.]+)',
                                                     last))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--max_steps', type=int, default=300)
    parser.add_argument('--full', action='store_true')
    args = parser.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prefix = '' if args.full else 'Tiny'
    print(f'load average {os.getloadavg()[0]:.1f}; {args.max_steps} steps each')
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


if __name__ == '__main__':
    main()
