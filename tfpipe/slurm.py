"""Trainer clients from a Slurm job step: one client per task of `srun`.

    srun --ntasks=R python -m trainer --model=M --logdir=DIR --cluster_resolver=slurm

TensorFlow's `SlurmClusterResolver` turns the step's variables (SLURM_PROCID,
SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NUM_TASKS) into one address
per task, `node:port_base + i` for the i-th task of a node; task SLURM_PROCID is client
SLURM_PROCID and task 0 is the chief. The resolver trusts its input more than a user
can: it zips node and task lists of different lengths, numbers tasks node by node
whatever distribution srun used, and raises a bare RuntimeError outside a step. So
the variables are checked first and every refusal is one line naming the fix (exit 2
in the trainer), before anything is written to the logdir.

GPUs: the resolver's own GPU assignment (CUDA_VISIBLE_DEVICES = 0..n-1 by local
rank) ignores the GPUs Slurm actually granted, so it is off (`auto_set_gpu=False`)
and Slurm's word is taken: CUDA_VISIBLE_DEVICES as srun set it (--gpus-per-task),
else this task's even share of SLURM_STEP_GPUS. Without GPUs the trainer's cells go
to logical CPUs as in any run.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from tfpipe import clients
from tfpipe.cluster import ClusterError

DEFAULT_PORT_BASE = 2222
HELP = ('start the clients as srun --ntasks=R python -m trainer --model=M --logdir=DIR '
        '--cluster_resolver=slurm')
_STEP_VARIABLES = ('SLURM_STEP_NUM_TASKS', 'SLURM_STEP_NODELIST', 'SLURM_STEP_TASKS_PER_NODE')


def client_cluster(port_base: int = DEFAULT_PORT_BASE) -> clients.ClientCluster:
    """This Slurm task's place among the step's trainer clients (reads os.environ).

    Also points CUDA_VISIBLE_DEVICES at this task's GPUs (see `visible_gpus`), so it
    must run before TensorFlow lists its devices.
    """
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as scr
    environ = os.environ
    rank, num_tasks = _step_integers(environ)
    nodes = _expanded(scr.expand_hostlist, 'SLURM_STEP_NODELIST', environ)
    tasks_per_node = _expanded(scr.expand_tasks_per_node, 'SLURM_STEP_TASKS_PER_NODE', environ)
    _check_step(nodes, tasks_per_node, rank, num_tasks, environ)
    if not 0 < port_base <= 65536 - max(tasks_per_node):
        raise ClusterError(f'--port_base={port_base}: the {max(tasks_per_node)} task(s) on a '
                           f'node take ports --port_base..--port_base+'
                           f'{max(tasks_per_node) - 1}, which must lie in 1..65535')
    # gpus_per_node=0 makes the resolver divide by zero (TF 2.21), and fewer "GPUs" than
    # tasks on a node drops tasks from its list: one per task, never assigned (auto_set_gpu).
    resolver = scr.SlurmClusterResolver(port_base=port_base, gpus_per_node=max(tasks_per_node),
                                        gpus_per_task=1, auto_set_gpu=False)
    addresses = tuple(resolver.cluster_spec().job_tasks('worker'))
    task_type, task_id = resolver.get_task_info()
    if task_type != 'worker' or task_id != rank or len(addresses) != num_tasks:
        raise ClusterError(f'Slurm: SlurmClusterResolver placed SLURM_PROCID={rank} as '
                           f'{task_type} {task_id} of {len(addresses)}: the step variables '
                           f'disagree; {HELP}')
    _check_placement(addresses[rank], port_base, environ)
    host = addresses[rank].rsplit(':', 1)[0]
    gpus = visible_gpus(environ, dict(zip(nodes, tasks_per_node))[host])
    if gpus is not None:
        os.environ['CUDA_VISIBLE_DEVICES'] = gpus
    return clients.ClientCluster(addresses, rank)


def visible_gpus(environ: Mapping[str, str], local_tasks: int) -> Optional[str]:
    """This task's GPUs as a CUDA_VISIBLE_DEVICES value; None: leave it as it is.

    srun sets CUDA_VISIBLE_DEVICES per task when asked for --gpus-per-task; a step
    given GPUs only for the node (--gres=gpu:N) lists them in SLURM_STEP_GPUS, which
    the node's tasks share out by SLURM_LOCALID, so no two clients drive one GPU.
    """
    if 'CUDA_VISIBLE_DEVICES' in environ or not environ.get('SLURM_STEP_GPUS'):
        return None
    gpus = environ['SLURM_STEP_GPUS'].split(',')
    local_id = _integer(environ, 'SLURM_LOCALID')
    if len(gpus) % local_tasks or not 0 <= local_id < local_tasks:
        raise ClusterError(f'Slurm: SLURM_STEP_GPUS={environ["SLURM_STEP_GPUS"]} cannot be '
                           f'shared evenly by the {local_tasks} task(s) on this node '
                           f'(SLURM_LOCALID={local_id}): ask srun for '
                           '--gpus-per-task=N instead')
    share = len(gpus) // local_tasks
    return ','.join(gpus[local_id * share:(local_id + 1) * share])


def _step_integers(environ: Mapping[str, str]) -> tuple[int, int]:
    if 'SLURM_PROCID' not in environ:
        raise ClusterError(f'--cluster_resolver=slurm but SLURM_PROCID is not set: this is not '
                           f'a task of a Slurm job step; {HELP}')
    for name in _STEP_VARIABLES:
        if name not in environ:
            raise ClusterError(f'--cluster_resolver=slurm but {name} is not set: this is not a '
                               'task of an srun step (the shell of an sbatch script is not); '
                               f'{HELP}')
    return _integer(environ, 'SLURM_PROCID'), _integer(environ, 'SLURM_STEP_NUM_TASKS')


def _integer(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        raise ClusterError(f'Slurm: {name}={environ.get(name)!r} is not an integer: the Slurm '
                           f'variables were changed or are missing; {HELP}') from None


def _expanded(expand, name: str, environ: Mapping[str, str]) -> list:
    try:
        return expand(environ[name])
    except ValueError as e:
        raise ClusterError(f'Slurm: {name}={environ[name]!r} cannot be read ({e}); '
                           f'{HELP}') from None


def _check_step(nodes: list, tasks_per_node: list, rank: int, num_tasks: int,
                environ: Mapping[str, str]) -> None:
    where = (f'SLURM_STEP_NODELIST={environ["SLURM_STEP_NODELIST"]!r}, SLURM_STEP_TASKS_PER_'
             f'NODE={environ["SLURM_STEP_TASKS_PER_NODE"]!r}, SLURM_STEP_NUM_TASKS={num_tasks}')
    if len(nodes) != len(tasks_per_node) or len(set(nodes)) != len(nodes):
        raise ClusterError(f'Slurm: {where} disagree: {len(set(nodes))} distinct node(s) but '
                           f'task counts for {len(tasks_per_node)}; the variables must come '
                           f'from one srun step; {HELP}')
    if sum(tasks_per_node) != num_tasks or min(tasks_per_node) < 1:
        raise ClusterError(f'Slurm: {where} disagree: the nodes\' task counts add up to '
                           f'{sum(tasks_per_node)}; the variables must come from one srun '
                           f'step; {HELP}')
    if not 0 <= rank < num_tasks:
        raise ClusterError(f'Slurm: SLURM_PROCID={rank} is out of range for a step of '
                           f'{num_tasks} task(s) (0..{num_tasks - 1}); {HELP}')


def _check_placement(address: str, port_base: int, environ: Mapping[str, str]) -> None:
    """The resolver numbers tasks node by node in sorted name order: srun's block
    distribution, as long as Python sorts the names as Slurm does (n9 < n10 does not).

    Otherwise task r runs elsewhere than the address every client was told, and the
    clients would wait for each other in vain.
    """
    host, port = address.rsplit(':', 1)
    node = environ.get('SLURMD_NODENAME', host)
    local = environ.get('SLURM_LOCALID', str(int(port) - port_base))
    if node != host or local != str(int(port) - port_base):
        raise ClusterError(f'Slurm: task {environ["SLURM_PROCID"]} runs on node {node} as '
                           f'local task {local}, but SlurmClusterResolver, which numbers tasks '
                           f'node by node in sorted name order, puts it at {address}: run srun '
                           'with --distribution=block (its default)')

