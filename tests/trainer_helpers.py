"""Running the trainer binary in a subprocess, on data generated once per session.

`python -m trainer` processes, and the repository's other modules and scripts that tests
start through `popen`, are forked from a fork server (tests/trainer_forkserver.py:
TensorFlow imported once per worker and environment, not per process); any other command
starts a new interpreter.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf

from tests import trainer_forkserver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = 'image.shapes.SmallConvPipe'
# The translation model's shared run (session fixture reverse_trained): K=2 with M=2, and
# 32 decoded examples (of its default 128) are enough for the tests that read them.
REVERSE = 'mt.reverse.TransformerPipe'
LM_STEPS = 150  # the language model's shared run (session fixture lm_trained)
REVERSE_OVERRIDES = {'task.pipeline.num_micro_batches': 2,
                     'task.eval.decoder_samples_per_summary': 32}


def env() -> dict:
    e = dict(os.environ)
    e['PYTHONPATH'] = REPO + os.pathsep + e.get('PYTHONPATH', '')
    e['TF_CPP_MIN_LOG_LEVEL'] = '2'
    return e


def command(model: str, logdir: str, data_dir: str, *flags: str) -> list[str]:
    return [sys.executable, '-m', 'trainer', f'--model={model}', f'--logdir={logdir}',
            f'--tfds_data_dir={data_dir}', '--num_logical_cpus=4', *flags]


# This worker's fork servers (tests/trainer_forkserver.py) by the load-time environment they
# were started with (`forkserver`): a server costs one interpreter's start-up, so a one-off
# environment's command starts its own interpreter instead.
_SERVERS: dict[tuple, trainer_forkserver.Server] = {}
_ASKED: collections.Counter = collections.Counter()
# Variable prefixes TensorFlow, its kernels or Python read while loading (TF_CONFIG is read
# by the trainer at run time).
_LOAD_TIME = ('TF_', 'OMP_', 'KMP_', 'MKL', 'ONEDNN', 'DNNL', 'PYTHON', 'CUDA', 'LD_')


def _load_time_environment(environ: dict) -> tuple:
    from tfpipe import runtime_defaults
    full = {**runtime_defaults.DEFAULTS, **environ}
    return tuple(sorted((k, v) for k, v in full.items()
                        if k.startswith(_LOAD_TIME) and k != 'TF_CONFIG'))


def forkserver(environ: dict) -> Optional[trainer_forkserver.Server]:
    """This worker's fork server for `environ`'s load-time variables, started now if this
    is the common environment's first command or another's second; None: start a real
    interpreter."""
    key = _load_time_environment(environ)
    _ASKED[key] += 1
    if key not in _SERVERS and (key == _load_time_environment(env()) or _ASKED[key] > 1):
        _start_server(key, environ)
    return _SERVERS.get(key)


def _start_server(key: tuple, environ: dict, without_tfpipe: bool = False) -> None:
    _SERVERS[key] = trainer_forkserver.Server(tempfile.mkdtemp(prefix='tfpipe-fork-'),
                                              environ, REPO, without_tfpipe)


def popen(cmd: Sequence[str], environ: dict, stdout=None, stderr=None, cwd: str = REPO):
    """subprocess.Popen(cmd, text=True), forked from `forkserver(environ)` when `cmd` is
    `python -m MODULE ...` of this repository or `python SCRIPT.py ...`
    (trainer_forkserver.program).

    Either way the process leads a session of its own, so that only the test signals it:
    in the suite's own process group, a SIGSTOPped trainer (a frozen client) is continued
    by the kernel when that group is orphaned, as when the shell that started pytest exits
    (POSIX: SIGHUP then SIGCONT to an orphaned group with a stopped member)."""
    cmd = list(cmd)
    program = trainer_forkserver.program(cmd[1:]) if cmd[:1] == [sys.executable] else None
    server = forkserver(environ) if program is not None else None
    if server is not None:
        return server.start(program, environ, cwd, stdout=stdout, stderr=stderr)
    return subprocess.Popen(cmd, env=environ, cwd=cwd, stdout=stdout, stderr=stderr,
                            text=True, start_new_session=True)


def stop_forkserver() -> None:
    """Stops this worker's fork servers by their PIDs (the session's end, tests/conftest.py)."""
    for server in _SERVERS.values():
        server.stop()
        shutil.rmtree(os.path.dirname(server.path), ignore_errors=True)
    _SERVERS.clear()


def run_command(cmd: Sequence[str], environ: Optional[dict] = None, timeout: float = 300,
                cwd: str = REPO) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) through `popen`, with env()
    updated by `environ`."""
    proc = popen(cmd, {**env(), **(environ or {})}, subprocess.PIPE, subprocess.PIPE, cwd)
    return _finished(proc, timeout)


def run_script_without_tfpipe(script: str, args: Sequence[str], environ: dict, cwd: str,
                              timeout: float = 300) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS...` with exactly `environ`, forked from this worker's server that
    imported TensorFlow but never tfpipe (trainer_forkserver, --without_tfpipe), for the
    scripts that check that what they run needs no tfpipe."""
    key = ('without_tfpipe',) + tuple(sorted((k, v) for k, v in environ.items()
                                             if k.startswith(_LOAD_TIME)))
    if key not in _SERVERS:
        _start_server(key, environ, without_tfpipe=True)
    proc = _SERVERS[key].start({'script': script, 'argv': list(args)}, environ, cwd,
                               subprocess.PIPE, subprocess.PIPE)
    return _finished(proc, timeout)


def _finished(proc, timeout: float) -> subprocess.CompletedProcess:
    """`proc`'s outputs and exit status, killed if it outlives `timeout` seconds."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(model: str, logdir: str, data_dir: str, *flags: str, timeout: int = 300,
        environ: dict = None) -> subprocess.CompletedProcess:
    return run_command(command(model, logdir, data_dir, *flags), environ, timeout)


def start(model: str, logdir: str, data_dir: str, *flags: str):
    return popen(command(model, logdir, data_dir, *flags), env(), subprocess.PIPE,
                 subprocess.STDOUT)


class Processes:
    """Every process a test starts, stopped by its PID at the end (the `processes`
    fixture, tests/conftest.py)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], environ: dict = None) -> subprocess.Popen:
        proc = popen(cmd, {**env(), **(environ or {})}, subprocess.DEVNULL, subprocess.PIPE)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@dataclasses.dataclass(frozen=True)
class TrainedRun:
    """A finished trainer run that several tests start from (a session fixture).

    Each trainer process costs seconds of TensorFlow import and tracing, so tests that
    begin with the same run share it. They must not change `logdir`: a test that writes
    to it (resumes, evaluates, corrupts a file) works on `copy_to(...)` instead.
    """
    logdir: str
    stderr: str

    def copy_to(self, directory) -> str:
        shutil.copytree(self.logdir, str(directory))
        return str(directory)


def train_once(directory, data_dir: str, *flags: str) -> TrainedRun:
    """Runs the FAST model's trainer in `directory`/run with `flags`; it must succeed."""
    logdir = os.path.join(str(directory), 'run')
    result = run(FAST, logdir, data_dir, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return TrainedRun(logdir, result.stderr)


def rewind(logdir: str, step: int, keep_events: bool = True) -> None:
    """Makes ckpt-`step` the newest checkpoint of a copied run, as if the run had stopped
    there: later checkpoints removed, the state file rewritten, and the events logged
    after `step` removed (all events with `keep_events=False`)."""
    import glob
    train_dir = os.path.join(logdir, 'train')
    for path in glob.glob(os.path.join(train_dir, 'ckpt-*')):
        if int(os.path.basename(path).split('.')[0].split('-')[1]) > step:
            os.remove(path)
    tf.compat.v1.train.update_checkpoint_state(train_dir,
                                               os.path.join(train_dir, f'ckpt-{step}'))
    for path in glob.glob(os.path.join(train_dir, 'events.out.tfevents.*')):
        kept = [event.SerializeToString() for event in tf.compat.v1.train.summary_iterator(path)
                if keep_events and event.step <= step]
        os.remove(path)
        if kept:
            with tf.io.TFRecordWriter(path) as writer:
                for record in kept:
                    writer.write(record)


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [l for l in result.stderr.splitlines() if l.startswith('error: ')]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def failure(result: subprocess.CompletedProcess) -> str:
    """What a failed command said that matters: its exit status, every error line and
    traceback, then the tail (a job's exit can end in pages of restore warnings)."""
    lines = result.stderr.splitlines()
    keep, in_traceback = [], False
    for line in lines:
        if line.startswith('Traceback'):
            in_traceback = True
        if in_traceback or line.startswith('error: ') or 'Error' in line.split(' ')[0]:
            keep.append(line)
        if in_traceback and line and not line.startswith((' ', 'Traceback')):
            in_traceback = False
    return '\n'.join([f'exit {result.returncode}', *keep[-60:], '--- tail:', *lines[-15:]])


def snapshot(directory: str) -> dict:
    """Every file under `directory` with its size and mtime: 'nothing changed' check."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            st = os.stat(path)
            out[os.path.relpath(path, directory)] = (st.st_size, st.st_mtime_ns)
    return out


def model_values(checkpoint_prefix: str) -> dict[str, np.ndarray]:
    """The model variables of a checkpoint, by layer path."""
    reader = tf.train.load_checkpoint(checkpoint_prefix)
    out = {}
    for name, _ in tf.train.list_variables(checkpoint_prefix):
        if name.startswith('model/') and name.endswith('.ATTRIBUTES/VARIABLE_VALUE'):
            out[name] = reader.get_tensor(name)
    assert out, f'no model variables in {checkpoint_prefix}'
    return out


def overrides(**kw: object) -> str:
    return '--params_override=' + ','.join(f'{k}={v!r}' for k, v in kw.items())


def fast_flags(max_steps: int, save_every: int, extra: Sequence[str] = ()) -> list[str]:
    return ['--job=trainer', f'--max_steps={max_steps}',
            f'--gin_bindings=trainer.save_interval_steps={save_every}',
            '--gin_bindings=trainer.summary_interval_steps=1', *extra]


def losses_by_step(train_dir: str, tag: str = 'loss') -> dict[int, float]:
    """The `tag` scalar ('loss', 'grad_norm', ...) the trainer logged at each step, from
    its event files."""
    import glob
    out = {}
    for path in sorted(glob.glob(os.path.join(train_dir, 'events.out.tfevents.*'))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    out[event.step] = float(tf.make_ndarray(value.tensor))
    return out


def wait_for_checkpoint(proc: subprocess.Popen, train_dir: str, step: int,
                        timeout: float = 240) -> None:
    """Returns once `proc` has saved a checkpoint of `step` or later while still running."""
    import time
    from tfpipe import checkpoints
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        path = checkpoints.latest(train_dir) if os.path.isdir(train_dir) else None
        if path and checkpoints.step_of(path) >= step:
            return
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    raise AssertionError(f'no checkpoint of step {step} in {train_dir} within {timeout} s')


@contextlib.contextmanager
def tmpfs(mount: str, options: str) -> Iterator[str]:
    """A tmpfs mounted at the empty directory `mount` with `options` (e.g. 'ro,size=1m'),
    unmounted afterwards: a real read-only or full disk. Mounting needs root; without it
    the test is skipped."""
    import pytest
    os.makedirs(mount)
    if subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', mount],
                      capture_output=True).returncode != 0:
        pytest.skip('needs permission to mount a tmpfs (root)')
    try:
        yield mount
    finally:
        subprocess.run(['umount', mount], check=True)


def finish(procs, timeout: float = 400) -> list[str]:
    """Waits for each process; asserts it exited 0 (with its stderr's tail); their stderrs."""
    out = []
    for proc in procs:
        _, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-3000:]
        out.append(err)
    return out


def checkpoint_state(logdir: str, step: int) -> dict:
    """Every saved value of ckpt-`step` (model, optimizer slots and step, global step)."""
    prefix = os.path.join(logdir, 'train', f'ckpt-{step}')
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(prefix)
            if name.startswith(('model/', 'optimizer/', 'step/'))}


def same_run(logdir: str, reference: str, steps: int) -> tuple[dict, dict]:
    """Asserts that the trainer in `logdir` logged `reference`'s loss at each of steps 1 to
    `steps` within 1e-5, and that both saved ckpt-`steps` under the same keys; returns
    those checkpoints' values (`checkpoint_state`), `logdir`'s first."""
    got = losses_by_step(os.path.join(logdir, 'train'))
    want = losses_by_step(os.path.join(reference, 'train'))
    assert sorted(got) == sorted(want) == list(range(1, steps + 1))
    for step in want:
        np.testing.assert_allclose(got[step], want[step], rtol=1e-5, err_msg=f'step {step}')
    saved, expected = checkpoint_state(logdir, steps), checkpoint_state(reference, steps)
    assert saved.keys() == expected.keys()
    return saved, expected
