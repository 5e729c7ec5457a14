"""Who may write a job dir, and how: a writable directory, held by one live job, whose
files are replaced whole.

Two trainers on one logdir would save into the same `ckpt-N` names, and two
evalers of one split into the same `score-N.txt`; neither notices the other.
So each job holds an exclusive `flock` on `<job dir>/job.lock` for its
lifetime. The kernel drops the lock when the process ends, however it ends
(also `kill -9`), so a stale lock file never blocks a restart; the file only
records who holds it, for the error message of the job that is turned away.

The checks here only read: the job takes its lock after everything else has
been validated, and the lock file is the first thing it writes.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from typing import IO

LOCK_FILE = 'job.lock'


class JobDirBusyError(ValueError):
    """Another live process holds the job dir."""


def check_directory(path: str, flag: str, writable: bool = True) -> None:
    """Refuses a `path` that is a file, lies under a file, or (if `writable`) cannot be written.

    Only reads: the nearest existing ancestor of `path` must be a directory,
    and a writable one when the job will write there. `os.access` asks the
    kernel, so a read-only mount is refused even for root, whom permission bits
    do not stop.
    """
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = 'is a file' if existing == path else f'lies under the file {existing}'
        raise ValueError(f'{flag} {path} {where}: give a directory path')
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        what = path if existing == path else f'{path} (its nearest existing parent {existing})'
        raise ValueError(f'{flag} {what} is not writable: give a directory this user can '
                         'write, e.g. under /tmp')


class JobDirLock:
    """An exclusive lock on one job dir, held until `release()` or the process ends.

    Keep a reference for as long as the job runs: the lock lives in the open
    file, which garbage collection would close.
    """

    def __init__(self, job_dir: str, job: str):
        self.job_dir = job_dir
        self.job = job
        self._file: IO[str] | None = None

    def acquire(self) -> 'JobDirLock':
        """Creates the job dir if needed and takes the lock, or raises JobDirBusyError."""
        path = os.path.join(self.job_dir, LOCK_FILE)
        try:
            os.makedirs(self.job_dir, exist_ok=True)
            f = open(path, 'a+')  # 'a+': never truncates what the holder wrote
        except OSError as e:  # e.g. a pseudo file system such as /proc, which root can't write
            raise ValueError(f'cannot write {path} ({e.strerror}): give a --logdir on a '
                             'writable file system') from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                f.close()
                raise
            f.seek(0)
            holder = f.read().strip() or 'another process (it has not written its PID yet)'
            f.close()
            raise JobDirBusyError(
                f'{self.job_dir} is in use by a running {self.job}: {holder} holds {path}; '
                f'stop that job first, or give this one another --logdir') from None
        try:
            f.seek(0)
            f.truncate()
            f.write(f'pid {os.getpid()} on host {socket.gethostname()} since '
                    f'{time.strftime("%Y-%m-%d %H:%M:%S")}\n')
            f.flush()
        except OSError as e:  # a full disk
            with contextlib.suppress(OSError):  # closing flushes what did not fit: fails too
                f.close()
            raise ValueError(f'cannot write {path} ({e.strerror}): free space on the '
                             '--logdir file system') from None
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the last descriptor drops the flock
            self._file = None


def write_file(path: str, text: str) -> None:
    """Replaces `path` with `text` atomically: a reader (an evaler, a resumed trainer)
    never sees half a file. When the write fails (disk full) the old file stays, the
    temporary one is removed, and the error names `path`."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'w') as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise OSError(e.errno, e.strerror, path) from None
