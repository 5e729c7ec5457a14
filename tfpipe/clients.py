"""Many trainer clients: one trainer process per data-parallel replica.

    python -m trainer --model=M --logdir=DIR --job=trainer --task=r \\
        --cluster_spec=trainer=HOST:PORT,HOST:PORT,...

or TF_CONFIG='{"cluster": {"trainer": [...]}, "task": {"type": "trainer", "index": r}}'.
R is the number of trainer addresses; client r builds replica r (its K cells on
its own devices) and client 0 is the chief. One process would trace, dispatch
and feed all R*K cells; R clients each do K, which is how TensorFlow itself
scales data parallelism (MultiWorkerMirroredStrategy). This module reads the
cluster and brings up TensorFlow's collective runtime the way that strategy
does (`configure_collective_ops` + `enable_collective_ops` with a ServerDef):
the step's all-reduces are then plain collective ops across the processes
(tfpipe/pipeline/across_clients.py). No transport of our own.

Collectives have no deadline of their own: a peer that never comes up, or dies
mid-step, leaves them waiting (measured here: > 10 min). So the clients wait for
each other for a bounded time before the first step, and `cluster.Watchdog`
(which probes every client's port) ends a client whose peer is lost.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Mapping, Optional

from tfpipe import cluster as cluster_lib
from tfpipe.cluster import ClusterError, WorkerUnavailableError
from tfpipe.pipeline.across_clients import Peers

TRAINER = 'trainer'
SPEC_HELP = ('write --job=trainer --task=R --cluster_spec=trainer=HOST:PORT,HOST:PORT '
             '(one address per trainer client; client 0 is the chief)')
TF_CONFIG_HELP = ('write TF_CONFIG=\'{"cluster": {"trainer": ["HOST:PORT", ...]}, '
                  '"task": {"type": "trainer", "index": R}}\'')


@dataclasses.dataclass(frozen=True)
class ClientCluster:
    """The trainer clients' addresses and which of them this process is."""
    addresses: tuple[str, ...]
    task_index: int

    @property
    def count(self) -> int:
        return len(self.addresses)

    @property
    def peers(self) -> Peers:
        return Peers(self.count, self.task_index)

    @property
    def workers(self) -> tuple[str, ...]:
        """Every client's address: what `cluster.Watchdog` probes."""
        return self.addresses

    def describe(self, task: int) -> str:
        return f'{TRAINER} task {task} ({self.addresses[task]})'

    @property
    def restart_hint(self) -> str:
        return ('restart every trainer client, which resumes from the chief\'s last '
                'checkpoint')

    def cluster_spec(self):
        import tensorflow as tf
        return tf.train.ClusterSpec({TRAINER: list(self.addresses)})


def _checked(addresses, task, where: str, help_text: str) -> ClientCluster:
    if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)) or not addresses:
        raise ClusterError(f'{where}: job {TRAINER!r} must list addresses; {help_text}')
    seen = set()
    for address in addresses:
        if not isinstance(address, str):
            raise ClusterError(f'{where}: address {address!r} is not a string; {help_text}')
        cluster_lib.split_address(address, where)
        if address in seen:
            raise ClusterError(f'{where}: address {address} is listed twice: give every '
                               'trainer client its own HOST:PORT')
        seen.add(address)
    if task is None:
        raise ClusterError(f'{where}: a trainer client needs its index: pass --task=N '
                           f'(0..{len(addresses) - 1})')
    if isinstance(task, bool) or not isinstance(task, int) or not 0 <= task < len(addresses):
        raise ClusterError(f'{where}: task index {task!r} is out of range: job {TRAINER!r} has '
                           f'{len(addresses)} task(s), so use 0..{len(addresses) - 1}')
    return ClientCluster(tuple(addresses), task)


def _refuse_other_jobs(jobs, where: str) -> None:
    others = sorted(set(jobs) - {TRAINER})
    if others:
        raise ClusterError(f'{where}: a cluster of trainer clients cannot also list '
                           f'{others}: each client runs its own replica on its own devices; '
                           'drive remote --job=worker tasks from a single trainer instead')


def from_flags(cluster_spec: Optional[str], job: Optional[str], task: Optional[int],
               environ: Mapping[str, str]) -> Optional[ClientCluster]:
    """The trainer clients from --cluster_spec=trainer=... or TF_CONFIG; None when the
    cluster (if any) has no trainer job: then it is tfpipe/cluster.py's."""
    if cluster_spec:
        if not any(part.partition('=')[0].strip() == TRAINER for part in cluster_spec.split('@')):
            return None
        where = f'--cluster_spec={cluster_spec}'
        jobs = {}
        for part in cluster_spec.split('@'):
            name, sep, addresses = part.partition('=')
            if not sep or not name.strip():
                raise ClusterError(f'{where}: {part!r} is not JOB=HOST:PORT,...; {SPEC_HELP}')
            jobs[name.strip()] = [a.strip() for a in addresses.split(',') if a.strip()]
        _refuse_other_jobs(jobs, where)
        _check_job_flag(job)
        return _checked(jobs[TRAINER], task, where, SPEC_HELP)
    text = environ.get('TF_CONFIG')
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        return None  # tfpipe/cluster.py reports it
    if not isinstance(config, dict) or not isinstance(config.get('cluster'), dict) or \
            TRAINER not in config['cluster']:
        return None
    where = 'TF_CONFIG'
    _refuse_other_jobs(config['cluster'], where)
    _check_job_flag(job)
    spec_task = config.get('task')
    if not isinstance(spec_task, dict) or spec_task.get('type') != TRAINER:
        raise ClusterError(f'{where}: "task" must be {{"type": "trainer", "index": N}}, got '
                           f'{spec_task!r}; {TF_CONFIG_HELP}')
    if task is not None and task != spec_task.get('index'):
        raise ClusterError(f'--task={task} disagrees with TF_CONFIG\'s task index '
                           f'{spec_task.get("index")!r}: drop --task or fix TF_CONFIG')
    return _checked(config['cluster'][TRAINER], spec_task.get('index'), where, TF_CONFIG_HELP)


def _check_job_flag(job: Optional[str]) -> None:
    if job not in (None, TRAINER):
        raise ClusterError(f'--job={job} with a cluster of trainer clients: each client runs '
                           'the trainer job only (--job=trainer); run evalers and decoders as '
                           'their own processes on the chief\'s logdir')


def check_num_replicas(num_replicas, count: int) -> None:
    """task.pipeline.num_replicas may be 1 or the number of clients (both mean R)."""
    if num_replicas not in (1, count):
        raise ValueError(f'task.pipeline.num_replicas={num_replicas} but the cluster has '
                         f'{count} trainer client(s), one replica each: set it to 1 or {count}')


def start(clients: ClientCluster, wait_seconds: float) -> Peers:
    """Starts this client's server and the collective runtime, then waits for the peers.

    Must run once the process's devices are configured and before any op: it
    restarts TensorFlow's context with this task's ServerDef, as
    MultiWorkerMirroredStrategy does.
    """
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context
    address = clients.addresses[clients.task_index]
    cluster_lib.check_port_free(address, clients.describe(clients.task_index))
    ctx = context.context()
    # No scoped-allocator rewrite: tfpipe packs each cell's gradients itself, and the
    # rewrite logs an error for every group that mixes dtypes (the start-up broadcast).
    ctx.configure_collective_ops(
        collective_leader=f'/job:{TRAINER}/replica:0/task:0', scoped_allocator_enabled_ops=(),
        device_filters=(f'/job:{TRAINER}/task:{clients.task_index}',))
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=clients.cluster_spec().as_cluster_def(), default_session_config=ctx.config,
        job_name=TRAINER, task_index=clients.task_index, protocol='grpc',
        port=cluster_lib.split_address(address, address)[1])
    ctx.enable_collective_ops(server_def)
    ctx.ensure_initialized()
    wait_for_peers(clients, wait_seconds)
    return clients.peers


def wait_for_peers(clients: ClientCluster, timeout_seconds: float) -> None:
    """Returns once every client accepts TCP connections; raises at the deadline."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        down = cluster_lib.unreachable_workers(clients, timeout=1.0)
        if not down:
            return
        if time.monotonic() >= deadline:
            raise WorkerUnavailableError(
                f'{", ".join(clients.describe(t) for t in down)} did not come up within '
                f'{timeout_seconds:g} s: start it (python -m trainer --job=trainer '
                f'--task={down[0]} --cluster_spec=...) or raise --cluster_wait_seconds')
        time.sleep(0.2)
