"""The trainer's help flags: the usage and flags on stdout, exit status 0.

`python -m trainer --helpfull` and `trainer.run(['--helpfull'])` (the binary as a call,
for a Ray worker) answer alike: absl's own handling exited 1 after the help, and
`trainer.run` refused --helpfull as an unknown flag while telling the user to use it.
"""
import sys

import pytest

from tests import trainer_helpers as th

IN_PROCESS = 'import sys, trainer; sys.exit(100 + trainer.run(sys.argv[1:]))'


def _binary(flag):
    return th.run_command([sys.executable, '-m', 'trainer', flag], timeout=60)


def _call(flag):
    """trainer.run in a fresh interpreter; its return value comes back as 100 + status."""
    return th.run_command([sys.executable, '-c', IN_PROCESS, flag], timeout=60)


@pytest.mark.parametrize('how', [_binary, _call], ids=['binary', 'trainer.run'])
def test_helpfull_prints_every_flag_and_exits_0(how):
    result = how('--helpfull')
    assert result.returncode in (0, 100), result.stderr[-3000:]
    assert result.returncode == (0 if how is _binary else 100)
    assert result.stdout.startswith('tfpipe trainer binary.'), result.stdout[:300]
    for flag in ('--model:', '--prompt:', '--[no]logtostderr', '--verbosity'):
        assert flag in result.stdout  # the trainer's, generate mode's and absl's flags
    assert 'error' not in result.stderr


@pytest.mark.parametrize('how', [_binary, _call], ids=['binary', 'trainer.run'])
def test_help_lists_the_trainers_flags_and_points_at_helpfull(how):
    result = how('--help')
    assert result.returncode == (0 if how is _binary else 100), result.stderr[-3000:]
    assert '--model:' in result.stdout and '--verbosity' not in result.stdout
    assert result.stdout.rstrip().endswith('(--helpfull lists every flag)')
