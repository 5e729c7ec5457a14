"""The tfpipe trainer binary: train, eval and decode jobs over one logdir."""
from __future__ import annotations

from typing import Sequence


def run(argv: Sequence[str]) -> int:
    """Runs the trainer with command-line flags `argv` in this process; returns its exit status.

    For code that owns the process, such as a Ray Train `train_loop_per_worker`
    (docs/clients.md, "Ray"): `trainer.run(['--model=M', '--logdir=DIR',
    '--cluster_resolver=tf_config'])` is `python -m trainer` with those flags, but
    returns 0, 1 or 2 instead of exiting. Call it once per process.
    """
    from trainer import main
    return main.run_in_process(argv)
