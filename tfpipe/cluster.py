"""The cluster: TensorFlow servers in worker processes, and the trainer connected to them.

tfpipe goes across processes and hosts on TensorFlow's own distributed runtime:
each worker process runs a `tf.distribute.Server` (gRPC), the trainer process
connects to all of them with `tf.config.experimental_connect_to_cluster`, and a
cell placed on `/job:worker/replica:0/task:T/device:...` runs there, TensorFlow
inserting the sends and receives. This module owns what the runtime does not do
for us:

- reading the cluster from `--cluster_spec=worker=HOST:PORT,HOST:PORT[@chief=HOST:PORT]`
  (Lingvo's syntax: jobs separated by '@') or, for a `--job=worker` server, the
  standard TF_CONFIG JSON, with one-line errors that name the fix (a ClusterError is
  a ValueError: exit 2);
- refusing a port that is in use: gRPC binds with SO_REUSEPORT, so without this
  check a second server on the same port starts silently and steals requests;
- waiting, for a bounded time, until every worker accepts connections: the first
  op on a cluster with a worker down blocks with no deadline (measured: > 100 s);
- telling a lost worker apart from other failures, and a watchdog that ends the
  trainer when a step blocks on a peer that went away without closing its socket.

This is the single-client form, chosen explicitly: `--job=worker` for each
server, `--cluster_spec=worker=...` for the one trainer that drives them. The
form cluster managers start (TF_CONFIG in every task, the same command) is
many trainer clients: tfpipe/clients.py.

The optional `chief` job is the trainer's own address. Workers receive tensors
from the trainer (the input batch) by calling it back, so with workers on other
hosts the trainer must listen on an address they can reach; without a `chief`
job TensorFlow picks a `localhost` port, which only works on one machine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys
import threading
import time
from typing import Callable, Mapping, Optional, Sequence, Union

WORKER = 'worker'
CHIEF = 'chief'
JOBS = (WORKER, CHIEF)
SPEC_HELP = ('write --cluster_spec=worker=HOST:PORT,HOST:PORT (optionally '
             '@chief=HOST:PORT for the trainer\'s own address)')
TF_CONFIG_HELP = ('write TF_CONFIG=\'{"cluster": {"worker": ["HOST:PORT", ...]}, '
                  '"task": {"type": "worker", "index": 0}}\' with --job=worker (the trainer '
                  'that drives the workers takes --cluster_spec=worker=...)')


class ClusterError(ValueError):
    """Bad cluster input: malformed spec or TF_CONFIG, task out of range, port in use."""


class WorkerUnavailableError(RuntimeError):
    """A worker did not come up in time, or was lost while training."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The jobs' addresses and which task this process is (None: the trainer client)."""
    jobs: Mapping[str, tuple[str, ...]]
    task_type: Optional[str] = None
    task_index: Optional[int] = None

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self.jobs[WORKER])

    @property
    def client_job(self) -> str:
        """The job name the trainer connects as: `chief` when listed, else TF's default."""
        return CHIEF if CHIEF in self.jobs else 'localhost'

    def describe(self, task: int) -> str:
        return f'worker task {task} ({self.workers[task]})'

    @property
    def restart_hint(self) -> str:
        return 'restart the worker and rerun the trainer, which resumes from the last checkpoint'

    def cluster_spec(self):
        import tensorflow as tf
        return tf.train.ClusterSpec({job: list(addrs) for job, addrs in self.jobs.items()})


def split_address(address: str, where: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(':')
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f'{where}: bad address {address!r}: write HOST:PORT with a port '
                           'in 1..65535, e.g. 127.0.0.1:2222')
    return host.strip('[]'), int(port)


def _checked_jobs(jobs: Mapping[str, Sequence[str]], where: str, help_text: str
                  ) -> dict[str, tuple[str, ...]]:
    out = {}
    seen = {}
    for job, addresses in jobs.items():
        if job not in JOBS:
            raise ClusterError(f'{where}: unknown job {job!r}: tfpipe uses the jobs '
                               f'{list(JOBS)}; {help_text}')
        if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
            raise ClusterError(f'{where}: job {job!r} must list addresses, got '
                               f'{addresses!r}; {help_text}')
        if not addresses:
            raise ClusterError(f'{where}: job {job!r} lists no address; {help_text}')
        for address in addresses:
            if not isinstance(address, str):
                raise ClusterError(f'{where}: address {address!r} of job {job!r} is not a '
                                   f'string; {help_text}')
            split_address(address, where)
            if address in seen:
                raise ClusterError(f'{where}: address {address} is listed twice ({seen[address]} '
                                   f'and {job}): give every task its own HOST:PORT')
            seen[address] = job
        out[job] = tuple(addresses)
    if WORKER not in out:
        raise ClusterError(f'{where}: no {WORKER!r} job; {help_text}')
    if len(out.get(CHIEF, ())) > 1:
        raise ClusterError(f'{where}: job {CHIEF!r} lists {len(out[CHIEF])} addresses but there '
                           'is one trainer: list one HOST:PORT')
    return out


def parse_spec(text: str) -> dict[str, tuple[str, ...]]:
    """'worker=h:1,h:2@chief=h:3' -> {'worker': ('h:1', 'h:2'), 'chief': ('h:3',)}."""
    where = f'--cluster_spec={text}'
    jobs: dict[str, list[str]] = {}
    for part in text.split('@'):
        job, sep, addresses = part.partition('=')
        job = job.strip()
        if not sep or not job:
            raise ClusterError(f'{where}: {part!r} is not JOB=HOST:PORT,...; {SPEC_HELP}')
        if job in jobs:
            raise ClusterError(f'{where}: job {job!r} is given twice: list all its addresses '
                               'once, separated by commas')
        jobs[job] = [a.strip() for a in addresses.split(',') if a.strip()]
    return _checked_jobs(jobs, where, SPEC_HELP)


def from_tf_config(text: str) -> Cluster:
    """TF_CONFIG for a --job=worker server of the single-client form (type 'worker')."""
    where = 'TF_CONFIG'
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterError(f'{where} is not valid JSON ({e.msg} at char {e.pos}); '
                           f'{TF_CONFIG_HELP}') from None
    if not isinstance(config, dict) or not isinstance(config.get('cluster'), dict):
        raise ClusterError(f'{where} has no "cluster" object; {TF_CONFIG_HELP}')
    jobs = _checked_jobs(config['cluster'], where, TF_CONFIG_HELP)
    task = config.get('task', {})
    if not isinstance(task, dict) or task.get('type') not in JOBS:
        raise ClusterError(f'{where}: "task" must be {{"type": "worker" or "chief", '
                           f'"index": N}}, got {task!r}')
    index = task.get('index', 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise ClusterError(f'{where}: task index {index!r} must be an int')
    return checked_task(Cluster(jobs, task['type'], index), where)


def checked_task(cluster: Cluster, where: str) -> Cluster:
    """Checks that the task index names a task of its job."""
    if cluster.task_type is None:
        return cluster
    count = len(cluster.jobs.get(cluster.task_type, ()))
    if cluster.task_type == CHIEF and count == 0:
        if cluster.task_index != 0:
            raise ClusterError(f'{where}: chief task index {cluster.task_index} must be 0')
        return cluster
    if not 0 <= (cluster.task_index if cluster.task_index is not None else -1) < count:
        raise ClusterError(f'{where}: task index {cluster.task_index} is out of range: job '
                           f'{cluster.task_type!r} has {count} task(s), so use 0..{count - 1}')
    return cluster


def from_flags(cluster_spec: Optional[str], job: Optional[str], task: Optional[int],
               environ: Mapping[str, str]) -> Optional[Cluster]:
    """The single-client cluster: --cluster_spec=worker=... (with --job/--task), or TF_CONFIG
    for a --job=worker server; None otherwise.

    The trainer that drives the workers takes the explicit --cluster_spec only:
    a TF_CONFIG without --job=worker makes trainer clients (tfpipe/clients.py),
    since that is what the cluster managers that write it expect.
    """
    if cluster_spec:
        if job == WORKER:
            if task is None:
                raise ClusterError('--job=worker needs --task=N: the index of this worker '
                                   'in --cluster_spec')
            return checked_task(Cluster(parse_spec(cluster_spec), WORKER, task),
                                f'--task={task}')
        if task is not None:
            raise ClusterError(f'--task={task} is only for --job=worker: drop it for the '
                               'trainer, which connects to every worker')
        return Cluster(parse_spec(cluster_spec))
    if job == WORKER and not environ.get('TF_CONFIG'):
        raise ClusterError('--job=worker needs the cluster: pass --cluster_spec=worker=HOST:PORT,'
                           'HOST:PORT and --task=N, or set TF_CONFIG')
    if job == WORKER:
        cluster = from_tf_config(environ['TF_CONFIG'])
        if cluster.task_type != WORKER:
            raise ClusterError('--job=worker but TF_CONFIG says task type '
                               f'{cluster.task_type!r}: set "type": "worker"')
        return cluster
    return None  # TF_CONFIG without --job=worker: trainer clients (tfpipe/clients.py)


def check_port_free(address: str, where: str) -> None:
    """Refuses a port another process listens on (gRPC itself would share it silently)."""
    _, port = split_address(address, where)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(('0.0.0.0', port))
        except OSError as e:
            raise ClusterError(f'{where}: port {port} of {address} is in use ({e.strerror}): '
                               'stop the process that holds it, or give this task another '
                               'port in the cluster spec') from None


def exposure_notice(address: str, what: str) -> str:
    """The one line every process that starts a TensorFlow server prints about its port.

    TensorFlow 2.21's gRPC server listens on 0.0.0.0:PORT whatever host the
    cluster spec names (hard-coded in GrpcServer::Init; `ss -ltnp` shows *:PORT)
    and authenticates nobody, so the port is open to whoever can reach it.
    """
    _, port = split_address(address, what)
    return (f'{what} listens on port {port} of every network interface (not only the host of '
            f'{address}) with no authentication: anyone who can reach it can run TensorFlow '
            'ops, i.e. code as this user; run on a trusted private network or firewall the '
            'port (docs/clients.md, "Security")')


def server_config(num_cpus: Optional[int] = None, intra_op_threads: Optional[int] = None,
                  inter_op_threads: Optional[int] = None):
    """The worker server's ConfigProto: `num_cpus` logical CPUs (and no GPU), or else its GPUs.

    Thread pools by the rule the trainer sizes its own by (`devices.thread_pools`):
    None takes tfpipe's default on logical CPUs (`devices.default_threads`) unless
    TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS are set, and TensorFlow's on
    GPUs; 0 keeps TensorFlow's default. A worker hosts cells like the trainer's
    own logical CPUs do, so it needs the same pools to run them at the same speed.
    """
    import tensorflow as tf
    from tfpipe import devices
    config = tf.compat.v1.ConfigProto()
    if num_cpus is not None:
        config.device_count['CPU'] = num_cpus
        config.device_count['GPU'] = 0
    fields = ('intra_op_parallelism_threads', 'inter_op_parallelism_threads')
    for name, value in zip(fields, (intra_op_threads, inter_op_threads)):
        if value is not None:
            devices.check_thread_count(name, value)
    for name, value in zip(fields, devices.thread_pools(num_cpus, intra_op_threads,
                                                         inter_op_threads)):
        if value:
            setattr(config, name, value)
    return config


def start_server(cluster: Cluster, num_cpus: Optional[int] = None,
                 intra_op_threads: Optional[int] = None,
                 inter_op_threads: Optional[int] = None):
    """Starts this worker's server with `server_config`."""
    import tensorflow as tf
    address = cluster.jobs[cluster.task_type][cluster.task_index]
    check_port_free(address, f'{cluster.task_type} task {cluster.task_index}')
    config = server_config(num_cpus, intra_op_threads, inter_op_threads)
    return tf.distribute.Server(cluster.cluster_spec(), job_name=cluster.task_type,
                                task_index=cluster.task_index, config=config, start=True)


def accepts_connections(address: str, timeout: float = 2.0) -> bool:
    host, port = split_address(address, address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# An HTTP/2 client preface and an empty SETTINGS frame: a gRPC server's process answers
# with its own SETTINGS frame; a stopped process's kernel only completes the handshake.
_HTTP2_PREFACE = b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n' + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def answers_grpc(address: str, timeout: float = 2.0) -> bool:
    """Whether the gRPC server at `address` answers, not only its kernel.

    Unlike `accepts_connections`, this tells a frozen process (SIGSTOP, swapping)
    from a live one within `timeout`, with no step deadline to tune.
    """
    host, port = split_address(address, address)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_HTTP2_PREFACE)
            return bool(sock.recv(9))
    except OSError:
        return False


def unreachable_workers(cluster: Cluster, timeout: float = 2.0,
                        probe: Callable[[str, float], bool] = accepts_connections) -> list[int]:
    """The workers that fail `probe` twice in a row.

    Once is not enough on a loaded host: a live worker missed one 2 s probe at a load of
    8 on 2 cores, and a lost worker's error then named a live one beside it.
    """
    once = [t for t, address in enumerate(cluster.workers) if not probe(address, timeout)]
    return [t for t in once if not probe(cluster.workers[t], timeout)]


def wait_for_workers(cluster: Cluster, timeout_seconds: float) -> None:
    """Returns once every worker accepts TCP connections; raises at the deadline."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        down = unreachable_workers(cluster, timeout=1.0)
        if not down:
            return
        if time.monotonic() >= deadline:
            names = ', '.join(cluster.describe(t) for t in down)
            raise WorkerUnavailableError(
                f'{names} did not accept connections within {timeout_seconds:g} s: start it '
                f'(python -m trainer --job=worker --task={down[0]} --cluster_spec=...) or '
                'raise --cluster_wait_seconds')
        time.sleep(0.2)


def connect(cluster: Cluster, timeout_seconds: float) -> None:
    """Connects this process (the trainer) to every worker, waiting for them first."""
    import tensorflow as tf
    jobs = {job: list(addresses) for job, addresses in cluster.jobs.items()}
    if CHIEF in cluster.jobs:
        check_port_free(cluster.jobs[CHIEF][0], 'chief (this trainer)')
    else:
        # What TensorFlow would do (a free port of job 'localhost'), done here so the
        # notice below can name the port.
        with socket.socket() as s:
            s.bind(('0.0.0.0', 0))
            jobs[cluster.client_job] = [f'localhost:{s.getsockname()[1]}']
    wait_for_workers(cluster, timeout_seconds)
    print(exposure_notice(jobs[cluster.client_job][0], 'this trainer'), file=sys.stderr,
          flush=True)
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(jobs),
                                              job_name=cluster.client_job)


def lost_worker_error(cluster: Cluster, error: BaseException
                      ) -> Optional[WorkerUnavailableError]:
    """A one-line error naming the lost worker(s) when `error` came from losing one.

    The workers that no longer accept connections are named; if all of them do
    (a worker restarted, or its port was taken meanwhile), an UnavailableError still
    means a lost peer: the tasks named in TensorFlow's message, else "a worker".
    """
    import tensorflow as tf
    if not isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError,
                              tf.errors.CancelledError, tf.errors.InternalError,
                              tf.errors.UnknownError)):
        return None
    down = unreachable_workers(cluster)
    if down:
        return _lost(cluster, down)
    if not isinstance(error, tf.errors.UnavailableError):
        return None
    named = sorted({int(t) for t in re.findall(rf'/job:{WORKER}/replica:0/task:(\d+)',
                                               str(error)) if int(t) < len(cluster.workers)})
    return _lost(cluster, named, f'a worker ({_one_line(error)})')


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f'{type(error).__name__}: {lines[-1] if lines else ""}'[:200]


def _lost(cluster: Cluster, tasks: Sequence[int], unnamed: str = '') -> WorkerUnavailableError:
    names = ', '.join(cluster.describe(t) for t in tasks) or unnamed
    return WorkerUnavailableError(
        f'lost {names}: training stopped without saving; {cluster.restart_hint}')


class Watchdog:
    """Ends the process when a worker stays unreachable and the trainer does not fail by itself.

    A killed worker resets its connections and the step usually fails at once
    with UnavailableError (measured on loopback: 0.03 s), but a kill while the
    trainer is registering functions or saving has left it blocked (measured: the
    watchdog ended it 22 s after the kill), and a host that vanishes without
    closing its sockets can leave a step waiting on gRPC for minutes. The watchdog
    probes every worker's port and, `grace_seconds` after one stops accepting
    connections, prints the one-line error and exits 1. Exiting at any point keeps
    the previous checkpoint: CheckpointManager lists a checkpoint only after its
    files are complete.

    A worker that is frozen but still accepts connections (SIGSTOP, a hung device;
    its kernel completes TCP handshakes) passes the probe, and gRPC waits on it
    forever. So, given `heartbeat` (the trainer's (last step, when it finished)),
    the watchdog also ends a step that has not finished `step_timeout` seconds
    after the previous one (a number, or a function giving the current one: the
    trainer derives it from its measured steps). It is armed after the first
    step, whose tracing may take minutes. Trainer clients pass `probe=answers_grpc`,
    which also fails for a frozen peer, so they end `grace_seconds` after a peer freezes.
    """

    def __init__(self, cluster: Cluster, interval_seconds: float = 2.0,
                 grace_seconds: float = 20.0,
                 heartbeat: Optional[Callable[[], Optional[tuple[int, float]]]] = None,
                 step_timeout: Union[float, Callable[[], float]] = 600.0,
                 probe: Callable[[str, float], bool] = accepts_connections):
        self.cluster = cluster
        self.probe = probe
        self.interval = interval_seconds
        self.grace = grace_seconds
        self.heartbeat = heartbeat
        self.step_timeout = step_timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name='worker-watchdog', daemon=True)

    def __enter__(self) -> 'Watchdog':
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join()
        if exc is not None:
            lost = lost_worker_error(self.cluster, exc)
            if lost is not None:
                raise lost from exc

    def _watch(self) -> None:
        down_since: Optional[float] = None
        while not self._stop.wait(self.interval):
            stalled = self._stalled_step()
            if stalled is not None and not self._stop.is_set():
                print(f'error: {stalled}', file=sys.stderr, flush=True)
                os._exit(1)
            down = unreachable_workers(self.cluster, self.interval, self.probe)
            if not down:
                down_since = None
                continue
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since >= self.grace and not self._stop.is_set():
                print(f'error: {_lost(self.cluster, down)}', file=sys.stderr, flush=True)
                os._exit(1)  # the main thread is blocked inside TensorFlow; nothing to save

    def _stalled_step(self) -> Optional[str]:
        """The error for a step past its deadline, or None."""
        beat = self.heartbeat() if self.heartbeat is not None else None
        timeout = self.step_timeout() if callable(self.step_timeout) else self.step_timeout
        if beat is None or time.monotonic() - beat[1] < timeout:
            return None
        workers = ', '.join(f'task {i} ({a})' for i, a in enumerate(self.cluster.workers))
        return (f'step {beat[0] + 1} has not finished {timeout:.0f} s after step '
                f'{beat[0]}, though every worker accepts connections: one may be frozen '
                f'(stopped, swapping or a hung device) among {workers}; restart the workers '
                'and this trainer (it resumes from the last checkpoint), or raise '
                'trainer.step_timeout_seconds if a step really takes this long')
