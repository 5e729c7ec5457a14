"""Entry point of a client the launcher starts: `python -m trainer.launched_client FLAGS`.

The trainer binary (`python -m trainer`), except that the client dies with its launcher.
A launcher killed by SIGKILL (the OOM killer, `kill -9`) cannot stop its clients; they
would train on unsupervised, holding the host's cores and ports, writing to pipes nobody
reads. Linux's parent-death signal (prctl PR_SET_PDEATHSIG) has the kernel SIGKILL this
process when the thread that started it ends: the launcher's main thread, which starts
every client and lives as long as the launcher. The chief's last checkpoint stays (saves
are atomic).

Set here, in the client, rather than in a `preexec_fn`: that runs between fork and exec
of the launcher, which has threads (its output pumps), where Python documents it as
unsafe. A launcher that died before this line ran is caught by comparing the parent's
PID with the one it passed down.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

from trainer.launcher import LAUNCHER_PID

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher(launcher_pid: int) -> None:
    """SIGKILL for this process when the launcher ends; exits 1 if it already has."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), 'prctl', None)
    if prctl is None:  # not Linux: the client outlives a killed launcher (docs/clients.md)
        return
    if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), 'prctl(PR_SET_PDEATHSIG) failed')
    if os.getppid() != launcher_pid:
        print(f'error: the launcher (pid {launcher_pid}) ended before this client started: '
              'rerun the command', file=sys.stderr)
        sys.exit(1)


if __name__ == '__main__':
    if not os.environ.get(LAUNCHER_PID, '').isdigit():
        print(f'error: {LAUNCHER_PID} is not set: trainer.launched_client is how the launcher '
              'starts its clients; run python -m trainer (with --local_clients=R for the '
              'launcher)', file=sys.stderr)
        sys.exit(2)
    die_with_launcher(int(os.environ.pop(LAUNCHER_PID)))
    from trainer.main import run
    run()
