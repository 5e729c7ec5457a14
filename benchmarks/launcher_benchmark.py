"""The launcher (`--local_clients=R`): seconds to the first step, and from a death back to training.

Side by side in one run, on loopback, SmallConvPipe (K=2, 2 logical CPUs per client,
each client pinned to its share of the cores), one launcher per R started together,
each with --max_restarts=1:
  1. seconds from the launcher's start to each client's first step, for R = 1, 2 (and
     4 when this process may use 4 cores; the launcher refuses more clients than cores);
  2. once the chief has saved, the last client is SIGKILLed: seconds from its death to
     the launcher's restart (detected, every client stopped by PID, new ones started)
     and to each new client's first step, i.e. training again from the last checkpoint,
     and that as a ratio of the first start (a restart is a start plus a restore).

Every line is stamped when the benchmark reads it from the launcher's pipe.

Run (from the repository root; every process it starts is stopped by PID at exit):
    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/launcher_benchmark.py   # ~2 min
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 'image.shapes.SmallConvPipe'
CPUS_PER_CLIENT = 2
_LAUNCHERS: list['Launch'] = []


class Launch:
    """One launcher process; its output lines with the moment each was read."""

    def __init__(self, count: int, logdir: str, data_dir: str):
        self.count = count
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, '-m', 'trainer', f'--model={MODEL}', f'--logdir={logdir}',
             f'--tfds_data_dir={data_dir}', '--run_locally=cpu',
             f'--num_logical_cpus={CPUS_PER_CLIENT}', '--max_steps=1000000',
             '--gin_bindings=trainer.save_interval_steps=10',
             '--gin_bindings=trainer.summary_interval_steps=1', f'--local_clients={count}',
             '--max_restarts=1'],
            env={**os.environ, 'PYTHONPATH': REPO, 'TF_CPP_MIN_LOG_LEVEL': '2'}, cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _LAUNCHERS.append(self)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append((time.monotonic(), line.rstrip('\n')))
                self._changed.notify_all()

    def when(self, pattern: str, after: float = 0.0, count: int = 1,
             timeout: float = 900) -> list[float]:
        """The read times of the first `count` lines after `after` that match `pattern`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [t for t, line in self.lines if t >= after and re.search(pattern, line)]
                if len(found) >= count:
                    return found[:count]
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = '\n'.join(line for _, line in self.lines[-30:])
                    raise RuntimeError(f'R={self.count}: no {count} x {pattern!r}:\n{tail}')
                self._changed.wait(0.5)

    def client_pids(self) -> list[int]:
        return [int(m.group(1)) for _, line in self.lines
                for m in [re.match(r'\[launcher\] client \d+: pid (\d+)', line)] if m]

    def stop(self) -> None:
        for pid in [self.proc.pid, *self.client_pids()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


atexit.register(lambda: [launch.stop() for launch in _LAUNCHERS])

FIRST_STEP = r'^\[client \d+\] .* step \d+/\d+ .*first step'
SAVED = r'^\[client 0\] .*saved .*ckpt-\d+$'


def main() -> None:
    from tfpipe import datasets
    root = tempfile.mkdtemp(prefix='launcher_benchmark_')
    data_dir = os.path.join(root, 'tfds')
    datasets.prepare('tfpipe_shapes', data_dir)
    cores = len(os.sched_getaffinity(0))
    counts = [r for r in (1, 2, 4) if r <= cores]
    launches = [Launch(r, os.path.join(root, f'r{r}'), data_dir) for r in counts]
    rows = []
    for launch in launches:
        firsts = launch.when(FIRST_STEP, count=launch.count)
        launch.when(SAVED, count=1)
        victim = launch.client_pids()[launch.count - 1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        restart, = launch.when(r'^\[launcher\] .*restarting all', after=killed)
        again = launch.when(FIRST_STEP, after=killed, count=launch.count)
        rows.append((launch.count, [t - launch.started for t in firsts], restart - killed,
                     [t - killed for t in again]))
    for launch in launches:
        launch.proc.send_signal(signal.SIGTERM)
    codes = [launch.proc.wait(timeout=300) for launch in launches]
    print(f'\nSmallConvPipe, {CPUS_PER_CLIENT} logical CPUs per client, {cores} cores, '
          f'load {os.getloadavg()[0]:.1f}; launchers for R = {counts} side by side')
    print('| R | start -> first step per client (s) | death -> restart (s) | '
          'death -> first step again (s) | again / start |')
    print('|---|---|---|---|---|')
    for count, firsts, restart, again in rows:
        ratio = max(again) / max(firsts)
        print(f'| {count} | {", ".join(f"{t:.1f}" for t in firsts)} | {restart:.2f} | '
              f'{", ".join(f"{t:.1f}" for t in again)} | {ratio:.2f}x |')
    if cores < 4:
        print(f'R=4 not run: the launcher refuses more clients than the {cores} cores this '
              'process may use')
    print(f'launchers exited {codes} after SIGTERM (0: the clients saved and stopped)')


if __name__ == '__main__':
    main()
