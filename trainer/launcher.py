"""One command for R trainer clients on one host, in the manner of torchrun.

    python -m trainer --model=M --logdir=DIR --local_clients=R [--max_restarts=N]

starts R processes of `python -m trainer --job=trainer --task=r
--cluster_spec=trainer=127.0.0.1:P0,...` (tfpipe/clients.py) with the user's other
flags, on free loopback ports, and supervises them. This is process supervision
only: the clients' gradients, weights and stop agreement still travel over
TensorFlow's own collective runtime; the launcher never sees a byte of them.

Why a supervisor and not R hand-written commands: a lost client stops the others
(tfpipe/cluster.py's watchdog) and only restarting every client resumes training,
from the chief's last checkpoint. The launcher does that restart (`--max_restarts`),
forwards SIGINT/SIGTERM (the clients' coordinated save) and gives each client its
own share of the host: CPU cores (pinned, so R clients do not each size their
thread pools for the whole host) or GPUs (CUDA_VISIBLE_DEVICES). A NaN is not a
lost client: training again from the last checkpoint would reach it again, so it
stops every client unrestarted. The clients die with the launcher
(trainer/launched_client.py).

The launcher imports no TensorFlow: it starts in a fraction of a second and holds
none of TensorFlow's memory for the whole run.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Mapping, Optional, Sequence

from absl import flags

from trainer import logdir_access
from trainer.exit_codes import EXIT_BAD_INPUT, EXIT_NON_FINITE

# The launcher's PID, passed down so a client can tell whether it was already orphaned
# (trainer/launched_client.py).
LAUNCHER_PID = 'TFPIPE_LAUNCHER_PID'
# The flags the launcher consumes or sets for each client; every other flag given is forwarded.
LAUNCHER_FLAGS = ('local_clients', 'max_restarts')
SET_PER_CLIENT = ('job', 'task', 'cluster_spec')
# A port picked free can be taken before a client binds it; the client then exits 2
# naming it, and the launcher starts every client again on new ports, this many times.
PORT_ATTEMPTS = 3
# Without a restart left, the other clients end by themselves (their watchdog names the
# lost client, tfpipe/cluster.py: ~20 s); the launcher kills any still alive after this.
LOST_PEER_SECONDS = 60.0
POLL_SECONDS = 0.05
HOST = '127.0.0.1'
# What a client that met a NaN or Inf says before its ': training stopped' (trainer/
# train_job.py, Trainer._non_finite): the value and the step, quoted in the launcher's line.
NON_FINITE = re.compile(r'error: (.*?): training stopped')


class LaunchError(ValueError):
    """Bad launcher input: printed as one line, exit 2, before anything is started or written."""


@dataclasses.dataclass(frozen=True)
class Share:
    """What one client gets of the host: CPU cores to run on (None: not pinned) or GPUs."""
    cores: Optional[tuple[int, ...]] = None
    gpus: Optional[tuple[str, ...]] = None

    def describe(self) -> str:
        if self.gpus is not None:
            return f'GPUs {",".join(self.gpus)}'
        return f'CPU cores {",".join(map(str, self.cores))}' if self.cores else 'all CPU cores'


def requested(flag_values: flags.FlagValues) -> bool:
    """Whether the command asks for the launcher (main.py dispatches on this)."""
    return any(flag_values[name].present for name in LAUNCHER_FLAGS)


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this process may hand out, without importing TensorFlow.

    CUDA_VISIBLE_DEVICES when set (CUDA stops at its first negative entry), else
    `nvidia-smi -L`'s list, else none.
    """
    listed = environ.get('CUDA_VISIBLE_DEVICES')
    if listed is not None:
        out = []
        for entry in (e.strip() for e in listed.split(',')):
            if not entry or entry.startswith('-'):
                break
            out.append(entry)
        return out
    try:
        result = subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    count = sum(line.startswith('GPU ') for line in result.stdout.splitlines())
    return [str(i) for i in range(count)] if result.returncode == 0 else []


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: count the cores, pin nothing
        return []


def split_host(num_clients: int, run_locally: Optional[str],
               environ: Mapping[str, str]) -> list[Share]:
    """One share of the host per client; refuses more clients than devices.

    GPUs (with --run_locally=gpu, or by default when any is visible): each client
    gets len(GPUs) // R of them. Else CPU cores: each client is pinned to its own
    cores, at least one; its --num_logical_cpus logical CPUs (K cells) run there.
    """
    gpus = [] if run_locally == 'cpu' else visible_gpus(environ)
    if run_locally == 'gpu' or gpus:
        if num_clients > len(gpus):
            raise LaunchError(
                f'--local_clients={num_clients} but {len(gpus)} GPU(s) are visible '
                '(CUDA_VISIBLE_DEVICES, nvidia-smi): each client needs GPUs of its own; '
                + (f'use --local_clients={len(gpus)} or fewer, or --run_locally=cpu' if gpus
                   else 'use --run_locally=cpu'))
        per = len(gpus) // num_clients
        return [Share(gpus=tuple(gpus[r * per:(r + 1) * per])) for r in range(num_clients)]
    cores = usable_cores()
    count = len(cores) or os.cpu_count() or 1
    if num_clients > count:
        raise LaunchError(
            f'--local_clients={num_clients} but this process may run on {count} CPU '
            f'core(s): each client needs a core of its own (its K cells are logical CPUs '
            f'on its cores); use --local_clients={count} or fewer, or clients on several '
            'hosts (docs/clients.md)')
    if not cores:
        return [Share() for _ in range(num_clients)]
    return [Share(cores=tuple(cores[r * count // num_clients:(r + 1) * count // num_clients]))
            for r in range(num_clients)]


def check_flags(flag_values: flags.FlagValues, environ: Mapping[str, str]) -> None:
    """Everything the launcher can refuse before it starts a client."""
    f = flag_values
    if not f['local_clients'].present:
        raise LaunchError(f'--max_restarts={f.max_restarts} is for the launcher: add '
                          '--local_clients=R to start R trainer clients on this host')
    if f.local_clients < 1:
        raise LaunchError(f'--local_clients={f.local_clients} must be >= 1: the number of '
                          'trainer clients to start on this host')
    if f.max_restarts < 0:
        raise LaunchError(f'--max_restarts={f.max_restarts} must be >= 0: how often to '
                          'restart every client after one dies')
    for name in ('cluster_spec', 'task'):
        if f[name].present:
            raise LaunchError(f'--{name} with --local_clients: the launcher writes each '
                              f'client\'s cluster itself; drop --{name}, or drop '
                              '--local_clients and start every client by hand')
    if environ.get('TF_CONFIG'):
        raise LaunchError('TF_CONFIG is set and --local_clients is given: the launcher '
                          'writes each client\'s cluster itself; unset TF_CONFIG, or drop '
                          '--local_clients and let TF_CONFIG describe the cluster')
    if f.job not in (None, 'trainer'):
        raise LaunchError(f'--job={f.job} with --local_clients: the clients run the trainer '
                          'job only; run evalers and decoders as their own processes on '
                          'the same --logdir')
    if f.mode != 'sync':
        raise LaunchError(f'--mode={f.mode} with --local_clients: inspect or export in one '
                          'process (drop --local_clients)')
    if not f.model:
        raise LaunchError('--model is required: pick one of --list_models')
    if not f.logdir:
        raise LaunchError('--logdir is required: the directory for checkpoints and summaries')
    logdir_access.check_directory(f.logdir, '--logdir')


def forwarded_flags(flag_values: flags.FlagValues) -> list[str]:
    """Every flag the user gave, as `--name=value`, except the launcher's own."""
    out = []
    for name in flag_values:
        flag = flag_values[name]
        if name == flag.name and flag.present and name not in LAUNCHER_FLAGS + SET_PER_CLIENT:
            out += flag.serialize().split('\n')  # a multi-valued flag: one line per value
    return out


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on every interface (where TensorFlow's servers bind)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(('', 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f'was killed by {signal.Signals(-code).name}'
        except ValueError:
            return f'was killed by signal {-code}'
    return f'exited with status {code}'


class Client:
    """One client process, its output pumps and the error lines it printed."""

    def __init__(self, task: int, address: str, command: Sequence[str],
                 environ: Mapping[str, str], share: Share, launcher: 'Launcher'):
        self.task, self.address = task, address
        self.errors: list[str] = []
        self.proc = subprocess.Popen(command, env=dict(environ), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, errors='replace')
        if share.cores:
            # Set before the client imports TensorFlow (seconds away): its thread pools
            # (tfpipe/devices.py) are sized by this mask and every thread inherits it.
            try:
                os.sched_setaffinity(self.proc.pid, share.cores)
            except ProcessLookupError:  # it already ended: the launcher reads its status
                pass
        self.pumps = [threading.Thread(target=launcher.pump, args=(stream, sink, self),
                                       daemon=True)
                      for stream, sink in ((self.proc.stdout, sys.stdout),
                                           (self.proc.stderr, sys.stderr))]
        for pump in self.pumps:
            pump.start()

    @property
    def code(self) -> Optional[int]:
        return self.proc.poll()

    def finish(self) -> None:
        """Waits for the process and its output (the pumps end at the pipes' EOF)."""
        self.proc.wait()
        for pump in self.pumps:
            pump.join()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()

    def describe(self, last_error: bool = True) -> str:
        """Task, PID and address; once ended, how (and the last error line it printed)."""
        text = f'client {self.task} (pid {self.proc.pid}, {self.address})'
        if self.code is None:
            return text
        if not last_error:
            return f'{text} {_exit_text(self.code)}' if self.code < 0 else text
        last = f': {self.errors[-1]}' if self.errors else ''
        return f'{text} {_exit_text(self.code)}{last}'


class Launcher:
    """Starts the R clients, prefixes their output, forwards signals, restarts them."""

    def __init__(self, command: Sequence[str], shares: Sequence[Share], max_restarts: int,
                 environ: Mapping[str, str], logdir: str):
        self.command = list(command)
        self.shares = list(shares)
        self.max_restarts = max_restarts
        self.environ = {**environ, 'PYTHONUNBUFFERED': '1'}
        self.logdir = logdir
        self._signals: list[int] = []
        self._lock = threading.Lock()
        self._printed_errors: set[str] = set()

    def log(self, text: str) -> None:
        with self._lock:
            print(f'[launcher] {text}', file=sys.stderr, flush=True)

    def pump(self, stream: IO[str], sink: IO[str], client: Client) -> None:
        """Copies one client stream line by line, each line prefixed with its task.

        Bad input makes every client print the same one-line error: it is shown once.
        """
        for line in stream:
            with self._lock:
                if line.startswith('error: '):
                    client.errors.append(line.rstrip('\n'))
                    if line in self._printed_errors:
                        continue
                    self._printed_errors.add(line)
                sink.write(f'[client {client.task}] {line}')
                sink.flush()

    def run(self) -> int:
        handlers = {sig: signal.signal(sig, lambda signum, _: self._signals.append(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._supervise()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _supervise(self) -> int:
        restarts = port_retries = 0
        while True:
            if self._signals:  # arrived between two starts: no client runs, nothing to save
                self.log(f'{signal.Signals(self._signals[0]).name}: no client started')
                return 128 + self._signals[0]
            clients = self._start_all()
            lost = self._wait(clients)
            if lost is None:
                return self._status(clients)
            if self._port_taken(lost) and port_retries < PORT_ATTEMPTS:
                port_retries += 1
                self._kill(clients)
                self.log(f'port {lost.address} was taken before client {lost.task} bound '
                         'it: starting every client again on new ports')
                continue
            if lost.code == EXIT_BAD_INPUT:  # bad input: a restart would refuse it again
                self._kill(clients)
                return EXIT_BAD_INPUT
            non_finite = self._non_finite(lost)
            if non_finite:  # deterministic: a restart would reach it again
                self._kill(clients)
                print(f'error: {lost.describe(last_error=False)} stopped training: '
                      f'{non_finite}; not restarted (the same steps from the last checkpoint '
                      'would reach it again), every client stopped: lower '
                      'task.train.learning_rate or set task.train.clip_gradient_norm_to_value, '
                      f'then rerun the command to resume from the last checkpoint in '
                      f'{self.logdir}', file=sys.stderr, flush=True)
                return EXIT_NON_FINITE
            if restarts < self.max_restarts:
                restarts += 1
                self._kill(clients)
                self.log(f'{lost.describe()}: stopped every client; restarting all '
                         f'{len(clients)} from the last checkpoint in {self.logdir} '
                         f'(restart {restarts} of --max_restarts={self.max_restarts})')
                continue
            self._await_others(clients, lost)
            print(f'error: lost {lost.describe()}; no restart left (--max_restarts='
                  f'{self.max_restarts}), so every client stopped: rerun the command to '
                  'resume from the last checkpoint, or raise --max_restarts',
                  file=sys.stderr, flush=True)
            return 1

    def _start_all(self) -> list[Client]:
        ports = free_ports(len(self.shares))
        addresses = [f'{HOST}:{port}' for port in ports]
        spec = 'trainer=' + ','.join(addresses)
        self.log(f'the clients\' gRPC servers listen on ports {", ".join(map(str, ports))} '
                 'of every interface, not only loopback (TensorFlow binds 0.0.0.0), with no '
                 'authentication: whoever reaches them can run code as this user; keep this '
                 'host behind a firewall or on a trusted network (docs/clients.md)')
        clients = []
        for task, share in enumerate(self.shares):
            environ = dict(self.environ)
            if share.gpus is not None:
                environ['CUDA_VISIBLE_DEVICES'] = ','.join(share.gpus)
            environ[LAUNCHER_PID] = str(os.getpid())
            command = [*self.command, '--job=trainer', f'--task={task}',
                       f'--cluster_spec={spec}']
            clients.append(Client(task, addresses[task], command, environ, share, self))
            self.log(f'client {task}: pid {clients[-1].proc.pid}, {addresses[task]}, '
                     f'{share.describe()}{" (the chief)" if task == 0 else ""}')
        return clients

    def _wait(self, clients: list[Client]) -> Optional[Client]:
        """Waits until every client exited (None) or one failed (that client).

        After SIGINT/SIGTERM a failure is not a death to restart from: the
        launcher waits for every client and exits with their status.
        """
        forwarded = 0
        while True:
            for signum in self._signals[forwarded:]:
                forwarded += 1
                self.log(f'{signal.Signals(signum).name}: forwarded to every client (each '
                         'saves a checkpoint at the step they agree on, then exits)')
                for client in clients:
                    if client.code is None:
                        client.proc.send_signal(signum)
            codes = [client.code for client in clients]
            failed = [c for c, code in zip(clients, codes) if code not in (None, 0)]
            if failed and not self._signals:
                # A client killed by a signal is the cause; the others' exit 1 follows it.
                lost = min(failed, key=lambda c: (c.code >= 0, c.task))
                lost.finish()
                return lost
            if all(code is not None for code in codes):
                for client in clients:
                    client.finish()
                return None
            time.sleep(POLL_SECONDS)

    @staticmethod
    def _non_finite(client: Client) -> Optional[str]:
        """The NaN or Inf, and its step, that the client stopped on (by its exit status);
        None: not that."""
        if client.code != EXIT_NON_FINITE:
            return None
        found = [m.group(1) for m in map(NON_FINITE.match, client.errors) if m]
        return found[-1] if found else 'a NaN or Inf (its error line was not read)'

    @staticmethod
    def _port_taken(client: Client) -> bool:
        port = client.address.rpartition(':')[2]
        return client.code == EXIT_BAD_INPUT and any(
            f'port {port} of {client.address} is in use' in e for e in client.errors)

    @staticmethod
    def _kill(clients: list[Client]) -> None:
        """Stops every client by its PID; the last checkpoint stays (saves are atomic)."""
        for client in clients:
            client.kill()

    def _await_others(self, clients: list[Client], lost: Client) -> None:
        """Lets the other clients end by themselves, naming the lost one; kills stragglers."""
        deadline = time.monotonic() + LOST_PEER_SECONDS
        while time.monotonic() < deadline and any(c.code is None for c in clients):
            time.sleep(POLL_SECONDS)
        late = [c for c in clients if c.code is None]
        if late:
            self.log(f'{", ".join(f"client {c.task}" for c in late)} still running '
                     f'{LOST_PEER_SECONDS:g} s after client {lost.task} was lost: killed')
        self._kill(clients)

    def _status(self, clients: list[Client]) -> int:
        """0 when every client exited 0; else the first failure (128 + N for signal N).

        A client ended by the SIGINT/SIGTERM the launcher forwarded had not installed its
        handler, which saves and exits 0: it was still starting (or done), so it stopped
        cleanly with nothing to save.
        """
        stopped = [c for c in clients if c.code is not None and -c.code in self._signals]
        for client in stopped:
            self.log(f'{client.describe(last_error=False)} before it trained: nothing to save')
        for client in clients:
            if client.code != 0 and client not in stopped:
                print(f'error: {client.describe()}', file=sys.stderr, flush=True)
                return 128 - client.code if client.code < 0 else client.code
        return 0


def run(flag_values: flags.FlagValues, environ: Mapping[str, str]) -> int:
    """`python -m trainer ... --local_clients=R`: the launcher's exit status."""
    try:
        check_flags(flag_values, environ)
        shares = split_host(flag_values.local_clients, flag_values.run_locally, environ)
    except ValueError as e:  # LaunchError, or logdir_access's one-line refusals
        print(f'error: {e}', file=sys.stderr)
        return EXIT_BAD_INPUT
    command = [sys.executable, '-m', 'trainer.launched_client', *forwarded_flags(flag_values)]
    return Launcher(command, shares, flag_values.max_restarts, environ,
                    flag_values.logdir).run()
