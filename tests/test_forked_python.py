"""tests/forked_python.py, the docs' shell `python`: it forks the repository's programs from
the worker's fork server and is, to the shell, the program it forked."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import forked_python
from tests import trainer_forkserver
from tests import trainer_helpers as th

SHIM = [sys.executable, '-S', os.path.join(th.REPO, 'tests', 'forked_python.py')]


def _shim_env(server) -> dict:
    return {**th.env(), forked_python.SERVER_VARIABLE: server.path}


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    """One fork server for the module: starting one imports TensorFlow."""
    started = trainer_forkserver.Server(str(tmp_path_factory.mktemp('server')), th.env(),
                                        th.REPO)
    yield started
    started.stop()


def test_a_script_is_forked_and_its_exit_status_is_the_shims(tmp_path, server):
    script = tmp_path / 'parent.py'
    script.write_text('import os, sys\nprint(os.getppid(), flush=True)\nsys.exit(3)\n')
    result = subprocess.run([*SHIM, str(script)], env=_shim_env(server), cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) == server.proc.pid  # the server forked it
    # `-c` needs a real interpreter: the shim became one (its parent is this test).
    inline = subprocess.run([*SHIM, '-c', 'import os; print(os.getppid())'],
                            env=_shim_env(server), capture_output=True, text=True,
                            timeout=120)
    assert inline.returncode == 0 and int(inline.stdout) == os.getpid(), inline.stderr


def test_sigterm_to_the_shim_ends_the_forked_program_and_the_shim_by_it(tmp_path, server):
    script = tmp_path / 'wait.py'
    script.write_text('import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n')
    shim = subprocess.Popen([*SHIM, str(script)], env=_shim_env(server), cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(shim.stdout.readline())
        assert child != shim.pid
        shim.send_signal(signal.SIGTERM)
        assert shim.wait(timeout=60) == -signal.SIGTERM
        deadline = time.time() + 30
        while _alive(child) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(child), f'the forked program {child} outlived its shim'
    finally:
        if shim.poll() is None:
            shim.kill()
            shim.wait()
        shim.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except FileNotFoundError:
        return False
