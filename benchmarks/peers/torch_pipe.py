"""torch.distributed.pipelining's side of peers_benchmark.py, run with the torch venv's Python.

As torch's docs run it: one process per stage (K processes, gloo on localhost), each building
its own stage by hand (PipelineStage), the schedule ScheduleGPipe with the loss on the last
stage; recompute by torch.utils.checkpoint around each stage's layers; SGD per stage. A step
is the schedule's step plus the optimizer's, and ends when every stage is done (a barrier), so
it covers the same work as a tfpipe step. `--threads=N` calls torch.set_num_threads(N) in every
stage process (`default` leaves torch's own). Rank 0 reports the median.
"""
from __future__ import annotations

import os
import socket

import steps
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.utils.checkpoint import checkpoint


class Stage(nn.Module):
    """This stage's share of the Dense layers (even balance), recomputed in backward."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.layers = nn.Sequential(*[
            nn.Sequential(nn.Linear(steps.WIDTH, steps.WIDTH), nn.ReLU())
            for _ in range(num_layers)])

    def forward(self, x):
        return checkpoint(self.layers, x, use_reentrant=False)


def loss_fn(outputs, targets):
    del targets  # loss mean(y^2), as the other systems
    return outputs.pow(2).mean()


def dense_stage(rank: int, cells: int):
    """Stage `rank` of the Dense stack: (module, loss, first stage's input, last's target,
    its optimizer)."""
    torch.manual_seed(rank)
    module = Stage(steps.LAYERS // cells)
    optimizer = torch.optim.SGD(module.parameters(), lr=steps.LEARNING_RATE)
    return (module, loss_fn, torch.randn(steps.BATCH, steps.WIDTH),
            torch.zeros(steps.BATCH, 1), optimizer)


def run_stage(rank: int, cells: int, micro: int, port: int, args, queue, build) -> None:
    """One stage's process: builds its stage by `build(rank, cells)` (module-level, as
    spawn pickles it) and times the schedule's step plus the optimizer's; rank 0
    reports."""
    if args.threads != 'default':
        torch.set_num_threads(int(args.threads))
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=cells)
    try:
        module, loss, inputs, target, optimizer = build(rank, cells)
        stage = PipelineStage(module, rank, cells, torch.device('cpu'))
        schedule = ScheduleGPipe(stage, micro, loss_fn=loss)

        def step():
            optimizer.zero_grad()
            if rank == 0:
                schedule.step(inputs)
            elif rank == cells - 1:
                schedule.step(target=target)
            else:
                schedule.step()
            optimizer.step()
            dist.barrier()

        ms = steps.median_step_ms(step, args.warmup, args.steps)
        if rank == 0:
            queue.put((ms, torch.get_num_threads()))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def run_configs(build, description: str) -> None:
    """Every --configs item in K fresh stage processes; one JSON line each on stdout."""
    args = steps.parse_args(description)
    context = mp.get_context('spawn')
    for cells, micro in steps.configs(args.configs):
        queue = context.SimpleQueue()
        mp.start_processes(run_stage, args=(cells, micro, free_port(), args, queue, build),
                           nprocs=cells, join=True, start_method='spawn')
        ms, threads = queue.get()
        steps.report(cells, micro, ms, threads=threads, torch=torch.__version__)


if __name__ == '__main__':
    run_configs(dense_stage, __doc__.split('\n\n')[0])
