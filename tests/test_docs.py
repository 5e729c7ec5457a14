"""Docs that run: every shell and Python block of README.md and docs/*.md.

A block a user is meant to run carries a marker on the line before its fence:
`<!-- run -->` (this test runs it: it must finish on this machine in about a minute,
so trainer commands carry a small `--max_steps`) or `<!-- syntax-only -->` (it needs a
GPU, a second host or a package install: only its syntax is checked). A ```bash, ```sh
or ```python block without either fails, so a new block has to choose; output and
pseudo-code use ```text.

Blocks run as a user would paste them, with four differences that keep the machine
clean and the run cheap: `/tmp/` in a block becomes a fresh temporary directory, HOME is
a temporary home whose `~/tensorflow_datasets` is the session's generated data, Python
blocks that do not configure devices themselves get the 8 logical CPUs the tests use
(`tfpipe.configure_logical_cpus(8)`), and Python blocks and the shell blocks'
`python -m trainer ...` are forked from the test worker's fork server, TensorFlow already
imported (tests/trainer_forkserver.py, tests/forked_python.py); `python -c` and heredocs
on `python -` start a real interpreter.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from tests import forked_python
from tests import trainer_helpers as th

ROOT = pathlib.Path(th.REPO)
SHELL, PYTHON = ('bash', 'sh', 'shell'), ('python', 'py')
RUN, SYNTAX_ONLY = '<!-- run -->', '<!-- syntax-only -->'
FENCE = re.compile(r'^(\s*)```(\S*)\s*$')
TIMEOUT_SECONDS = 240


@dataclasses.dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    language: str
    marker: str  # RUN, SYNTAX_ONLY or ''
    code: str

    @property
    def id(self) -> str:
        return f'{self.path}:{self.line}'


def blocks_of(text: str, path: str) -> list[Block]:
    """Every fenced block of `text` with its language and the marker before it."""
    lines = text.split('\n')
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.group(1), opening.group(2).lower()
        end = i + 1
        while end < len(lines) and lines[end].strip() != '```':
            end += 1
        before = lines[i - 1].strip() if i else ''
        marker = before if before in (RUN, SYNTAX_ONLY) else ''
        code = '\n'.join(line[len(indent):] if line.startswith(indent) else line
                         for line in lines[i + 1:end])
        found.append(Block(path, i + 1, language, marker, code + '\n'))
        i = end + 1
    return found


def doc_blocks() -> list[Block]:
    paths = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))
    return [b for p in paths for b in blocks_of(p.read_text(), str(p.relative_to(ROOT)))
            if b.language in SHELL + PYTHON]


BLOCKS = doc_blocks()


def test_blocks_of_reads_languages_markers_and_indented_fences():
    text = '\n'.join(['<!-- run -->', '```bash', 'echo hi', '```', '- item:', '  ```python',
                      '  x = 1', '  ```', SYNTAX_ONLY, '```sh', 'ls', '```', '```text', 'out',
                      '```'])
    got = [(b.line, b.language, b.marker, b.code) for b in blocks_of(text, 'x.md')]
    assert got == [(2, 'bash', RUN, 'echo hi\n'), (6, 'python', '', 'x = 1\n'),
                   (10, 'sh', SYNTAX_ONLY, 'ls\n'), (13, 'text', '', 'out\n')]


def test_every_shell_and_python_block_is_marked():
    unmarked = [b.id for b in BLOCKS if not b.marker]
    assert not unmarked, (f'blocks without {RUN} or {SYNTAX_ONLY} on the line before the '
                          f'fence (output and pseudo-code: use ```text): {unmarked}')


def test_quick_start_keeps_its_two_lines_in_one_marked_bash_block():
    text = (ROOT / 'README.md').read_text()
    section = text[text.index('## Quick start'):]
    section = section[:section.index('\n## ', 1)]
    (block,) = [b for b in blocks_of(section, 'README.md') if b.language == 'bash']
    commands = [line for line in block.code.splitlines()
                if line.strip() and not line.lstrip().startswith('#')]
    assert len(commands) == 2 and block.marker == SYNTAX_ONLY


@pytest.mark.parametrize('block', [b for b in BLOCKS if b.marker == SYNTAX_ONLY],
                         ids=lambda b: b.id)
def test_syntax_only_block_parses(block):
    if block.language in PYTHON:
        compile(block.code, block.id, 'exec')
    else:
        result = subprocess.run(['bash', '-n'], input=block.code, capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, f'{block.id}: {result.stderr}'


@pytest.fixture(scope='module')
def home(tmp_path_factory, data_dir):
    """A HOME whose ~/tensorflow_datasets is the session's generated data."""
    path = tmp_path_factory.mktemp('home')
    (path / 'tensorflow_datasets').symlink_to(data_dir)
    return path


@pytest.fixture(scope='module')
def forking_python(tmp_path_factory):
    """A directory whose `python` is tests/forked_python.py, for the shell blocks' PATH."""
    path = tmp_path_factory.mktemp('bin')
    shim = path / 'python'
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S '
                    f'"{ROOT / "tests" / "forked_python.py"}" "$@"\n')
    shim.chmod(0o755)
    return path


@pytest.mark.parametrize('block', [b for b in BLOCKS if b.marker == RUN], ids=lambda b: b.id)
def test_run_block_succeeds(block, home, forking_python, tmp_path):
    scratch = tmp_path / 'tmp'
    scratch.mkdir()
    code = block.code.replace('/tmp/', f'{scratch}/')
    env = th.env()
    env['HOME'] = str(home)
    env['PATH'] = os.pathsep.join([str(forking_python), os.path.dirname(sys.executable),
                                   env['PATH']])
    server = th.forkserver(env)
    if server is not None:
        env[forked_python.SERVER_VARIABLE] = server.path
    if block.language in PYTHON:
        if 'configure_logical_cpus' not in code:
            code = 'import tfpipe\ntfpipe.configure_logical_cpus(8)\n' + code
        script = tmp_path / 'block.py'
        script.write_text(code)
        process = th.popen([sys.executable, str(script)], env, subprocess.PIPE,
                           subprocess.STDOUT, cwd=str(tmp_path))
    else:
        process = th.popen(['bash', '-e', '-o', 'pipefail', '-c', code], env, subprocess.PIPE,
                           subprocess.STDOUT, cwd=str(tmp_path))
    # Each leads its own session, so that teardown can stop whatever the block started in
    # the background by the group of the one process this test started.
    try:
        output, _ = process.communicate(timeout=TIMEOUT_SECONDS)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    assert process.returncode == 0, f'{block.id} exited {process.returncode}:\n{output[-3000:]}'
