"""What a PipeliningLayer's params must satisfy before anything is built: each check one
line that names the param, its value and the fix, raised before a variable exists (the
layer's constructor calls `check` first; the partition and device layout, which compute
values, are checked where they are computed)."""
from __future__ import annotations

from tfpipe.hyperparams import Params
from tfpipe.pipeline import expert_parallel, schedule


def check(p: Params, path: str) -> None:
    """Raises ValueError naming the first param of `p` (the layer at `path`) that is wrong."""
    if not p.body:
        raise ValueError(f'{path}: body is empty; give p.body at least one layer params')
    if not isinstance(p.num_micro_batches, int) or p.num_micro_batches < 1:
        raise ValueError(f'{path}: num_micro_batches={p.num_micro_batches!r} must be an '
                         'int >= 1 (1 means no micro-batching)')
    if p.schedule not in schedule.SCHEDULES:
        raise ValueError(f'{path}: unknown schedule {p.schedule!r}; use one of '
                         f'{sorted(schedule.SCHEDULES)}')
    if p.jit_compile and not p.cell_functions:
        raise ValueError(f'{path}: jit_compile=True compiles the cell functions; set '
                         'cell_functions=True as well, or jit_compile=False')
    if p.jit_compile and p.schedule.startswith('zb_'):
        raise ValueError(f'{path}: jit_compile=True compiles the cell functions, which '
                         f'schedule={p.schedule!r} cannot use (its split backward runs '
                         'unrolled tasks): pick another schedule, or jit_compile=False')
    if isinstance(p.num_replicas, bool) or not isinstance(p.num_replicas, int) or \
            p.num_replicas < 1:
        raise ValueError(f'{path}: num_replicas={p.num_replicas!r} must be an int >= 1 '
                         '(1 means no data parallelism)')
    expert_parallel.check_expert_parallel(p.expert_parallel, p.num_replicas, path)
    v = p.virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f'{path}: virtual_stages={v!r} must be an int >= 1')
    if v > 1 and p.schedule != 'interleaved_1f1b':
        raise ValueError(f'{path}: virtual_stages={v} needs schedule='
                         f"'interleaved_1f1b' (schedule is {p.schedule!r}); or set "
                         'virtual_stages=1')
