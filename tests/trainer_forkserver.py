"""Test processes forked from one that has already imported TensorFlow.

Most of a test's trainer process is start-up: importing TensorFlow (which imports Keras),
tensorflow_datasets and the trainer costs ~3 of the ~5 CPU seconds of a short run, and
the suite starts ~250 of them. This server does those imports once, with one environment
(a test worker runs one server per environment it asks for, tests/trainer_helpers.py),
*without* starting TensorFlow's runtime (no op, no device, no thread pool), and then forks
one child per `python -m MODULE ...` or `python SCRIPT ...` of the repository a test asks
for: the trainer, the tests' probes, the benchmarks. The child is its own OS process with
its own PID, pipes, working directory, environment, sys.path[0] and argv; it runs the
program's own `__main__` (absl flags, devices, sessions, signals and exit status as from
the shell). What it does not repeat is the import, so it cannot test the import: tests of
start-up (a flag refused before TensorFlow loads, TensorFlow's kernel settings, the
console script) start a real interpreter themselves, and `trainer_helpers.popen` forks a
command only from a server whose environment has the same variables TensorFlow reads
when it loads.

A second kind of server, `--without_tfpipe`, imports TensorFlow alone (no tfpipe, so no
tfpipe defaults in the environment) for the scripts that must show a SavedModel runs where
tfpipe was never installed (tests/serve_without_tfpipe.py, which then removes the repository
from sys.path and checks that `import tfpipe` fails, as in a fresh interpreter).

Fork safety: the server forks from its only Python thread before TensorFlow's runtime
exists; the native threads alive then are numpy's BLAS pool and jemalloc's background
thread, which both re-initialise in a forked child (pthread_atfork).

Protocol (one AF_UNIX SOCK_SEQPACKET connection per child): the test sends a JSON request
{module or script, argv, env, cwd} (`program` gives the first two) with the child's stdin,
stdout and stderr as file descriptors; the server answers {"pid": ...} once forked and
{"returncode": ...} when the child has exited (a negative signal number if a signal ended
it, as subprocess reports it). The server exits when its parent (the test worker) is gone.

Run: python -m tests.trainer_forkserver SOCKET_PATH [--without_tfpipe]
"""
from __future__ import annotations

import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

MAX_REQUEST = 1 << 20
# `python -m` of a module of these packages (the repository's) is forked; so is any script.
OWN_PACKAGES = ('trainer', 'tests', 'benchmarks', 'params', 'tfpipe', 'model_registry')


def program(args: Sequence[str]) -> Optional[dict]:
    """The program the interpreter's arguments name, as the server takes it:
    {'module': ..., 'argv': [...]} for `python -m MODULE ...` of the repository,
    {'script': ..., 'argv': [...]} for `python SCRIPT.py ...`; None for anything else
    (`-c`, a heredoc on `-`, another package's module), which needs a real interpreter."""
    if len(args) > 1 and args[0] == '-m' and args[1].split('.')[0] in OWN_PACKAGES:
        return {'module': args[1], 'argv': list(args[2:])}
    if args and args[0].endswith('.py') and not args[0].startswith('-'):
        return {'script': args[0], 'argv': list(args[1:])}
    return None


def preload(without_tfpipe: bool = False) -> None:
    """Imports what every trainer process imports (TensorFlow alone `without_tfpipe`),
    leaving TensorFlow's runtime unstarted."""
    import importlib
    import pkgutil

    if without_tfpipe:
        import tensorflow  # noqa: F401
        assert 'tfpipe' not in sys.modules, 'the preload imported tfpipe'
    else:
        import tfpipe  # noqa: F401  first: it sets tfpipe's TensorFlow defaults
        import tensorflow  # noqa: F401
        import tensorflow_datasets  # noqa: F401
        import params
        import trainer
        for package in (params, trainer):
            for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):
                if not module.name.endswith('__main__'):
                    importlib.import_module(module.name)
    from tensorflow.python.eager import context
    assert context.context()._context_handle is None, 'the preload started TensorFlow'


def _child(request: dict, fds: list[int], without_tfpipe: bool) -> None:
    """Becomes the requested program: its streams, directory, environment, sys.path[0]
    and argv, then its `__main__` (`python -m MODULE` or `python SCRIPT`); in a session
    of its own, as `trainer_helpers.popen` starts the other processes."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked around the fork
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    if not without_tfpipe:
        from tfpipe import runtime_defaults
        for name, value in runtime_defaults.DEFAULTS.items():  # what `import tfpipe` sets
            os.environ.setdefault(name, value)
    if 'script' in request:
        script = request['script']
        sys.argv = [script, *request['argv']]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name='__main__')
    else:
        sys.argv = [request['module'], *request['argv']]  # run_module sets argv[0] to its file
        sys.path[0] = os.getcwd()
        runpy.run_module(request['module'], run_name='__main__', alter_sys=True)
    sys.exit(0)


def serve(path: str, without_tfpipe: bool = False) -> None:
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + '.tmp')
    os.rename(path + '.tmp', path)  # the socket appears only once it accepts
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    server = os.getpid()  # a forked child leaves through this `finally` too: not its job
    try:
        while os.getppid() == parent:
            readable, _, _ = select.select([listener], [], [], 0.05)
            if readable:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
                request = json.loads(message)
                sys.stdout.flush()
                sys.stderr.flush()
                # A child is on the list before anyone learns its PID, and SIGTERM waits
                # until it is: a server stopped right after answering must still end it.
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    for other in children.values():
                        other.close()
                    _child(request, fds, without_tfpipe)
                children[pid] = conn
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({'pid': pid}).encode())
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid)
                try:
                    code = os.waitstatus_to_exitcode(status)
                    conn.send(json.dumps({'returncode': code}).encode())
                except OSError:  # the test went away first
                    pass
                conn.close()
    finally:  # the parent is gone, or SIGTERM: no trainer outlives its server
        if os.getpid() == server:
            for pid in children:
                os.kill(pid, signal.SIGKILL)


class Server:
    """The server of one test worker: started on first use, stopped by its PID."""

    def __init__(self, directory: str, env: dict, cwd: str, without_tfpipe: bool = False):
        self.path = os.path.join(directory, 'trainer.sock')
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, '-m', 'tests.trainer_forkserver',
                                      self.path, *(['--without_tfpipe'] * without_tfpipe)],
                                     env=self.env, cwd=cwd,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError('the trainer fork server did not start: '
                                   + self.proc.stderr.read().decode()[-3000:])
            time.sleep(0.05)

    def start(self, program: dict, env: dict, cwd: str, stdout=None,
              stderr=None) -> 'ForkedProcess':
        """Forks `program` (see `program`); stdout/stderr: None (inherited), DEVNULL, PIPE
        or, for stderr, STDOUT, as subprocess.Popen takes them (text mode)."""
        return ForkedProcess(self.path, program, env, cwd, stdout, stderr)

    def stop(self) -> None:
        """SIGTERM, so that the server kills the trainers it forked; SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        self.proc.stderr.close()


class ForkedProcess:
    """A forked trainer with subprocess.Popen's interface (text mode): pid, returncode,
    stdout/stderr, poll, wait, communicate, send_signal, terminate, kill."""

    def __init__(self, path: str, program: dict, env: dict, cwd: str, stdout, stderr):
        self.args = [sys.executable, *(['-m', program['module']] if 'module' in program
                                       else [program['script']]), *program['argv']]
        self.returncode: Optional[int] = None
        self.stdout = self.stderr = None
        null = os.open(os.devnull, os.O_RDWR)
        out_fd = err_fd = None
        try:
            out_fd = self._stream(stdout, null, 1, 'stdout')
            err_fd = out_fd if stderr == subprocess.STDOUT else self._stream(stderr, null, 2,
                                                                            'stderr')
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._conn.connect(path)
            request = json.dumps({**program, 'env': env, 'cwd': cwd}).encode()
            socket.send_fds(self._conn, [request], [null, out_fd, err_fd])
            self.pid = json.loads(self._conn.recv(MAX_REQUEST))['pid']
        finally:
            for fd in {null, out_fd, err_fd} - {None, 1, 2}:
                os.close(fd)

    def _stream(self, how, null: int, inherited: int, name: str) -> int:
        """The child's end of one output stream (its reading end set as self.<name>)."""
        if how is None:
            return os.dup(inherited)
        if how == subprocess.DEVNULL:
            return os.dup(null)
        if how != subprocess.PIPE:
            raise ValueError(f'{name}={how!r}: None, DEVNULL or PIPE')
        read_end, write_end = os.pipe()
        setattr(self, name, open(read_end, 'r', errors='replace'))
        return write_end

    def _status(self, timeout: Optional[float]) -> Optional[int]:
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if ready:
                message = self._conn.recv(MAX_REQUEST)
                self.returncode = json.loads(message)['returncode'] if message else -9
                self._conn.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._status(0)

    def wait(self, timeout: Optional[float] = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input=None, timeout: Optional[float] = None) -> tuple:
        """Reads stdout and stderr to their ends, then waits, like Popen.communicate."""
        if not hasattr(self, '_read'):
            self._read = {f: [] for f in (self.stdout, self.stderr) if f is not None}
            self._open = set(self._read)
        deadline = None if timeout is None else time.time() + timeout
        while self._open:
            left = None if deadline is None else max(0.0, deadline - time.time())
            ready, _, _ = select.select(list(self._open), [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for f in ready:
                chunk = os.read(f.fileno(), 1 << 16)
                if chunk:
                    self._read[f].append(chunk)
                else:
                    self._open.discard(f)
        self.wait(None if deadline is None else max(0.0, deadline - time.time()))
        out = [b''.join(self._read[f]).decode(errors='replace').replace('\r\n', '\n')
               if f in self._read else None for f in (self.stdout, self.stderr)]
        for f in self._read:
            f.close()
        return out[0], out[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == '__main__':
    # Ctrl-C reaches the test worker, which stops its processes and then this server; the
    # trainers lead sessions of their own, so they see neither. SIGTERM ends the server
    # through serve's `finally`, which kills the trainers still running.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    without = sys.argv[2:] == ['--without_tfpipe']
    preload(without)
    serve(sys.argv[1], without)
