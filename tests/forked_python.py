"""A `python` for the docs' shell blocks that forks the repository's programs.

tests/test_docs.py puts a `python` first on a shell block's PATH that runs this file
(`python -S`, no site: it starts in milliseconds). `python -m MODULE ...` or
`python SCRIPT.py ...` of the repository (what `trainer_helpers.popen` forks) is forked
from the worker's fork server named by $TFPIPE_TEST_FORKSERVER, as the tests' own trainer
commands are (tests/trainer_forkserver.py); anything else (`python -c`, a heredoc on
`python -`, no server) becomes the real interpreter with the same arguments.

Seen from the shell, this process is the program: its exit status is the child's (a
signal that ended the child ends this process too), SIGTERM, SIGINT and SIGHUP sent to it
are passed on, and the child writes to the same stdout and stderr. Its stdin is
/dev/null, as the fork server gives every child.
"""
import os
import signal
import sys

SERVER_VARIABLE = 'TFPIPE_TEST_FORKSERVER'


def main(args: list) -> None:
    from tests import trainer_forkserver  # stdlib only; the repository is on PYTHONPATH
    server = os.environ.get(SERVER_VARIABLE)
    program = trainer_forkserver.program(args)
    if not server or not program:
        os.execv(sys.executable, [sys.executable, *args])
    # Held from before the fork until the handlers pass them on: a signal that came as
    # soon as the child existed would otherwise end this process and leave the child.
    passed_on = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    signal.pthread_sigmask(signal.SIG_BLOCK, passed_on)
    child = trainer_forkserver.ForkedProcess(server, program, dict(os.environ), os.getcwd(),
                                             None, None)
    for sig in passed_on:
        signal.signal(sig, lambda received, _: child.send_signal(received))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, passed_on)
    code = child.wait()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == '__main__':
    main(sys.argv[1:])
