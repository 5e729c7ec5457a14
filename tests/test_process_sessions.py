"""Every process the tests start leads a session of its own, forked or not.

Why: tests freeze trainers with SIGSTOP (a frozen client, a frozen worker) and expect them
to stay frozen. In the suite's own process group they do not always: when the shell that
started pytest exits (a CI step, nohup, a tool that ran it in the background), the group is
orphaned and the kernel sends it SIGHUP and SIGCONT. That thawed a frozen client mid-test
(its peer's log showed it stepping 20 s after its SIGSTOP); a SIGSTOPped `sleep` left in the
group of a shell that then exits is running again, one in a session of its own is not.
"""
import os
import subprocess
import sys
import time

from tests import trainer_helpers as th


def _session_of(pid: int, timeout: float = 60) -> int:
    """The process's session once it has set it up (the forked child calls setsid first)."""
    deadline = time.time() + timeout
    while os.getsid(pid) != pid and time.time() < deadline:
        time.sleep(0.05)
    return os.getsid(pid)


def test_a_forked_trainer_leads_its_own_session(tmp_path, data_dir, processes):
    # An evaler on an empty logdir waits for a checkpoint: alive until stopped by its PID.
    evaler = processes.start(th.command(th.FAST, str(tmp_path / 'run'), data_dir,
                                        '--job=evaler_dev'))
    assert type(evaler).__name__ == 'ForkedProcess'  # the fork server's path
    assert _session_of(evaler.pid) == evaler.pid != os.getsid(0)
    assert evaler.poll() is None


def test_a_started_interpreter_leads_its_own_session(processes):
    sleeper = processes.start([sys.executable, '-c', 'import time; time.sleep(120)'])
    assert isinstance(sleeper, subprocess.Popen)
    assert _session_of(sleeper.pid) == sleeper.pid != os.getsid(0)


def _gone(pid: int, timeout: float = 60) -> bool:
    """Whether `pid` has exited (and been reaped: init adopts an orphan and reaps it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_stopping_a_fork_server_ends_the_trainers_it_forked(tmp_path, data_dir):
    # The trainers lead their own sessions, so a Ctrl-C or a hang-up of the suite's group
    # no longer reaches them: their fork server must end them when it is stopped.
    from tests import trainer_forkserver
    server = trainer_forkserver.Server(str(tmp_path), th.env(), th.REPO)
    try:
        evaler = server.start(trainer_forkserver.program(th.command(
            th.FAST, str(tmp_path / 'run'), data_dir, '--job=evaler_dev')[1:]), th.env(),
            th.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert _session_of(evaler.pid) == evaler.pid and evaler.poll() is None
    finally:
        server.stop()
    assert _gone(evaler.pid), f'trainer {evaler.pid} outlived its fork server'
