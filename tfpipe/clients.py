"""Many trainer clients: one trainer process per data-parallel replica.

A cluster manager starts them with the standard TF_CONFIG that
MultiWorkerMirroredStrategy reads (Ray Train, Kubeflow's TFJob, Vertex AI,
SageMaker write it):

    TF_CONFIG='{"cluster": {"chief": [C], "worker": [A0, A1], "evaluator": [E]},
                "task": {"type": "worker", "index": 1}}'  python -m trainer --model=M --logdir=DIR

Every chief and worker task is a trainer client: the chief (else worker 0) is
client 0, then the workers in order; an evaluator task is no client (it runs the
evaler on the chief's logdir, see `evaluator_job`). By hand, or from a launcher:

    python -m trainer --model=M --logdir=DIR --task=r --cluster_spec=trainer=HOST:PORT,...

(or TF_CONFIG with job and task type `trainer`). R is the number of clients;
client r builds replica r (its K cells on its own devices). One process would
trace, dispatch and feed all R*K cells; R clients each do K, which is how
TensorFlow itself scales data parallelism. This module reads the cluster and
brings up TensorFlow's collective runtime the way that strategy does
(`configure_collective_ops` + `enable_collective_ops` with a ServerDef): the
step's all-reduces are then plain collective ops across the processes
(tfpipe/pipeline/across_clients.py). No transport of our own.

The old single-client form, one trainer driving cells on remote `--job=worker`
servers (tfpipe/cluster.py), is chosen explicitly: `--cluster_spec=worker=...`
for the trainer and `--job=worker` for each server. TF_CONFIG without
`--job=worker` always means clients, because the cluster managers that write it
start the same command in every task and expect each one to train.

Collectives have no deadline of their own: a peer that never comes up, or dies
mid-step, leaves them waiting (measured here: > 10 min). So the clients wait for
each other for a bounded time before the first step, agree on what they run
(tfpipe/client_agreement.py), and `cluster.Watchdog` (which probes every
client's port) ends a client whose peer is lost.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Mapping, Optional

from tfpipe import cluster as cluster_lib
from tfpipe.cluster import ClusterError, WorkerUnavailableError
from tfpipe.pipeline.across_clients import Peers

TRAINER = 'trainer'
CHIEF, WORKER, EVALUATOR = 'chief', 'worker', 'evaluator'
SPEC_HELP = ('write --job=trainer --task=R --cluster_spec=trainer=HOST:PORT,HOST:PORT '
             '(one address per trainer client; client 0 is the chief)')
TF_CONFIG_HELP = ('write TF_CONFIG=\'{"cluster": {"worker": ["HOST:PORT", ...]}, '
                  '"task": {"type": "worker", "index": I}}\' (optionally a "chief" and an '
                  '"evaluator" job)')


@dataclasses.dataclass(frozen=True)
class ClientCluster:
    """The trainer clients' addresses and which of them this process is.

    `ClientCluster(addresses, task_index)` is the whole of it for launchers and
    cluster managers that know the addresses (client 0 is the chief);
    `task_names` only words the errors the way the user wrote the cluster
    (TF_CONFIG's "chief", "worker task 0", ...).
    """
    addresses: tuple[str, ...]
    task_index: int
    task_names: tuple[str, ...] = ()

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
        if self.task_names:
            return f'trainer client {task} ({self.task_names[task]}, {self.addresses[task]})'
        return f'{TRAINER} task {task} ({self.addresses[task]})'

    @property
    def restart_hint(self) -> str:
        return ('restart every trainer client, which resumes from the chief\'s last '
                'checkpoint')

    def cluster_spec(self):
        import tensorflow as tf
        return tf.train.ClusterSpec({TRAINER: list(self.addresses)})


def _checked(addresses, task, where: str, help_text: str,
             task_names: tuple[str, ...] = ()) -> ClientCluster:
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
    return ClientCluster(tuple(addresses), task, task_names)


def _refuse_other_jobs(jobs, where: str) -> None:
    others = sorted(set(jobs) - {TRAINER})
    if others:
        raise ClusterError(f'{where}: a cluster of trainer clients cannot also list '
                           f'{others}: each client runs its own replica on its own devices; '
                           'drive remote --job=worker tasks from a single trainer instead')


def from_flags(cluster_spec: Optional[str], job: Optional[str], task: Optional[int],
               environ: Mapping[str, str]) -> Optional[ClientCluster]:
    """The trainer clients from --cluster_spec=trainer=... or TF_CONFIG.

    None when there is no cluster, when --cluster_spec has no trainer job or
    --job=worker is given (tfpipe/cluster.py's single-client form), and for
    TF_CONFIG's evaluator task (`evaluator_job`).
    """
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
    config = _tf_config(environ)
    if config is None or job == WORKER:
        return None  # no cluster, or a --job=worker server of tfpipe/cluster.py
    where = 'TF_CONFIG'
    spec_task = config.get('task')
    if TRAINER in config['cluster']:
        _refuse_other_jobs(config['cluster'], where)
        _check_job_flag(job)
        if not isinstance(spec_task, dict) or spec_task.get('type') != TRAINER:
            raise ClusterError(f'{where}: "task" must be {{"type": "trainer", "index": N}}, '
                               f'got {spec_task!r}; {TF_CONFIG_HELP}')
        _check_task_flag(task, spec_task.get('index'))
        return _checked(config['cluster'][TRAINER], spec_task.get('index'), where,
                        TF_CONFIG_HELP)
    task_type, index = _standard_task(config)
    if task_type == EVALUATOR:
        return None  # see evaluator_job
    _check_job_flag(job)
    _check_task_flag(task, index)
    chief = list(config['cluster'].get(CHIEF, []))
    workers = list(config['cluster'].get(WORKER, []))
    names = [CHIEF] * len(chief) + [f'{WORKER} task {i}' for i in range(len(workers))]
    client = index if task_type == CHIEF else len(chief) + index
    return _checked(chief + workers, client, where, TF_CONFIG_HELP, tuple(names))


def _tf_config(environ: Mapping[str, str]) -> Optional[dict]:
    """TF_CONFIG's JSON with a "cluster" object, None when unset; bad JSON is refused."""
    text = environ.get('TF_CONFIG')
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterError(f'TF_CONFIG is not valid JSON ({e.msg} at char {e.pos}); '
                           f'{TF_CONFIG_HELP}') from None
    if not isinstance(config, dict) or not isinstance(config.get('cluster'), dict):
        raise ClusterError(f'TF_CONFIG has no "cluster" object; {TF_CONFIG_HELP}')
    return config


def _standard_task(config: dict) -> tuple[str, int]:
    """The task of a chief/worker/evaluator TF_CONFIG, checked against its cluster."""
    where = 'TF_CONFIG'
    jobs = config['cluster']
    unknown = sorted(set(jobs) - {CHIEF, WORKER, EVALUATOR})
    if unknown:
        raise ClusterError(f'{where}: unknown job(s) {unknown}: tfpipe\'s clients read '
                           f'"{CHIEF}", "{WORKER}" and "{EVALUATOR}" (no parameter servers); '
                           f'{TF_CONFIG_HELP}')
    for job, addresses in jobs.items():
        if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)) \
                or not addresses:
            raise ClusterError(f'{where}: job {job!r} must list addresses, got {addresses!r}; '
                               f'{TF_CONFIG_HELP}')
    if WORKER not in jobs and CHIEF not in jobs:
        raise ClusterError(f'{where}: no "{WORKER}" or "{CHIEF}" job, so no trainer client; '
                           f'{TF_CONFIG_HELP}')
    if len(jobs.get(CHIEF, ())) > 1:
        raise ClusterError(f'{where}: job "{CHIEF}" lists {len(jobs[CHIEF])} addresses: there '
                           'is one chief (client 0); list the others as "worker" tasks')
    task = config.get('task')
    if not isinstance(task, dict) or task.get('type') not in jobs:
        raise ClusterError(f'{where}: "task" must be {{"type": one of {sorted(jobs)}, '
                           f'"index": N}}, got {task!r}')
    index = task.get('index', 0)
    count = len(jobs[task['type']])
    if isinstance(index, bool) or not isinstance(index, int):
        raise ClusterError(f'{where}: task index {index!r} must be an int')
    if not 0 <= index < count:
        raise ClusterError(f'{where}: task index {index} is out of range: job '
                           f'{task["type"]!r} has {count} task(s), so use 0..{count - 1}')
    return task['type'], index


def evaluator_job(cluster_spec: Optional[str], job: Optional[str],
                  environ: Mapping[str, str]) -> Optional[str]:
    """The --job an `evaluator` task of TF_CONFIG runs (default evaler_dev), else None.

    The evaluator is no member of the collective cluster: it reads the chief's
    checkpoints from its --logdir (the chief's logdir, on a shared file system)
    like any evaler started by hand.
    """
    config = None if cluster_spec or job == WORKER else _tf_config(environ)
    if config is None or TRAINER in config['cluster']:
        return None
    task_type, _ = _standard_task(config)
    if task_type != EVALUATOR:
        return None
    if job is not None and any(j.strip() in (TRAINER, WORKER) for j in job.split(',')):
        raise ClusterError(f'--job={job} but TF_CONFIG says task type "evaluator": it runs '
                           'evaler_<split> or decoder_<split> jobs on the chief\'s logdir; '
                           'drop --job (evaler_dev) or name those jobs')
    return job or 'evaler_dev'


def _check_task_flag(task: Optional[int], index) -> None:
    if task is not None and task != index:
        raise ClusterError(f'--task={task} disagrees with TF_CONFIG\'s task index '
                           f'{index!r}: drop --task or fix TF_CONFIG')


def _check_job_flag(job: Optional[str]) -> None:
    if job not in (None, TRAINER):
        raise ClusterError(f'--job={job} with a cluster of trainer clients: each client runs '
                           'the trainer job only (--job=trainer); run evalers and decoders as '
                           'their own processes on the chief\'s logdir (TF_CONFIG: an '
                           '"evaluator" task)')


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
    print(cluster_lib.exposure_notice(address, clients.describe(clients.task_index)),
          file=sys.stderr, flush=True)
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
