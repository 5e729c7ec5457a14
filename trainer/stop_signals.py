"""SIGINT/SIGTERM: the trainer stops at a step with a checkpoint or, blocked, within seconds.

The trainer's handler only records the signal; its loop reads it after each step, and
trainer clients first agree on it so that all stop at one step (train_job.Trainer).
Python runs that handler on the main thread between bytecodes, so a client whose main
thread waits inside TensorFlow for a collective its peers never join (a peer stuck in
its input, or running another function) did not see SIGTERM at all: it ran on until the
step deadline, minutes later, and a cluster manager killed it meanwhile without a word.
Python's C-level handler also writes the signal's number to the wakeup fd
(signal.set_wakeup_fd) the moment the signal arrives, whatever the main thread is
doing; with a `Deadline`, a thread here reads that fd and, when the trainer has neither
acted on the signal nor finished a step or save for `grace()` seconds since, prints one
line and exits 1. The last complete checkpoint is kept: CheckpointManager lists one only
after its files are written.
"""
from __future__ import annotations

import dataclasses
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_POLL_SECONDS = 0.5  # how often the thread looks at the trainer once a signal has come


@dataclasses.dataclass
class Deadline:
    """How long a trainer that got a signal may stay blocked, and what it then says."""
    acted: Callable[[], bool]  # the trainer has acted on the signal (e.g. agreed to stop)
    progress: Callable[[], Optional[float]]  # monotonic time of its last step or save
    grace: Callable[[], float]  # seconds without progress that mean it is blocked
    message: Callable[[str, float], str]  # (signal name, seconds blocked) -> the error


class StopSignals:
    """Context manager: SIGINT/SIGTERM call `on_signal(signum)`; with a `deadline`, a
    trainer blocked past it exits 1. Handlers are installed on the main thread only
    (Python takes them nowhere else): a trainer run from another thread (trainer.run in a
    Ray Train worker) leaves signals to the process's owner."""

    def __init__(self, on_signal: Callable[[int], None], deadline: Optional[Deadline] = None):
        self._on_signal = on_signal
        self._deadline = deadline
        self._previous: dict = {}
        self._previous_fd: Optional[int] = None
        self._sockets: tuple[socket.socket, socket.socket] | tuple = ()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> 'StopSignals':
        if threading.current_thread() is not threading.main_thread():
            return self
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        if self._deadline is not None:
            reader, writer = socket.socketpair()
            writer.setblocking(False)  # set_wakeup_fd requires it
            self._sockets = (reader, writer)
            self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._thread = threading.Thread(target=self._watch, name='stop-signal-deadline',
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._thread is not None:
            self._done.set()
            self._sockets[1].send(b'\0')  # wakes the thread; 0 is no signal
            self._thread.join()
            signal.set_wakeup_fd(self._previous_fd)
            for sock in self._sockets:
                sock.close()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        del frame
        self._on_signal(signum)

    def _watch(self) -> None:
        reader = self._sockets[0]
        arrived: Optional[float] = None
        name = ''
        while not self._done.is_set():
            if select.select([reader], [], [], _POLL_SECONDS)[0]:
                got = [sig for sig in reader.recv(64) if sig in SIGNALS]
                if got and arrived is None:
                    arrived, name = time.monotonic(), signal.Signals(got[0]).name
            if arrived is None or self._deadline.acted():
                continue
            blocked = time.monotonic() - max(arrived, self._deadline.progress() or arrived)
            if blocked >= self._deadline.grace() and not self._done.is_set():
                print(f'error: {self._deadline.message(name, blocked)}', file=sys.stderr,
                      flush=True)
                os._exit(1)  # the main thread is blocked inside TensorFlow; nothing to save
