"""No merge-conflict marker is left in any file of the repository.

A merge of two branches once left docs/clients.md with both sides of a
conflict for weeks (issue 40): the docs tests read its code blocks, which
were all still valid, so nothing failed. Markdown, Python and shell all
accept the markers as text somewhere, so only a check of the raw lines
catches them.
"""
from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Built from pieces so that this file does not hold a marker itself.
_MARKER = re.compile('^(' + '<' * 7 + '( |$)|' + '>' * 7 + '( |$)|' + '=' * 7 + '$|'
                     + r'\|' * 7 + '( |$))')
_SKIPPED_DIRS = {'__pycache__', 'build', 'dist', 'venv'}


def _text_files(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if not d.startswith('.') and d not in _SKIPPED_DIRS
                       and not d.endswith('.egg-info')]
        if os.path.relpath(dirpath, root) == '.':
            dirnames.append('.ci')
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, 'rb') as f:
                data = f.read()
            if b'\0' not in data:
                yield path, data.decode('utf-8', errors='replace')


def conflict_markers(root: str) -> list[str]:
    """'path:line' of every line that opens, splits or closes a merge conflict."""
    found = []
    for path, text in _text_files(root):
        for number, line in enumerate(text.splitlines(), 1):
            if _MARKER.match(line):
                found.append(f'{os.path.relpath(path, root)}:{number}')
    return found


def test_no_file_holds_a_merge_conflict_marker():
    found = conflict_markers(REPO)
    assert not found, f'unresolved merge conflicts at {", ".join(found)}'


def test_the_check_finds_each_kind_of_marker(tmp_path):
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs' / 'page.md').write_text(
        'text\n' + '<' * 7 + ' HEAD\nours\n' + '=' * 7 + '\ntheirs\n' + '>' * 7 + ' branch\n')
    (tmp_path / 'clean.py').write_text("x = '" + '=' * 7 + "'\n# " + '<' * 7 + '\n')
    assert conflict_markers(str(tmp_path)) == [
        os.path.join('docs', 'page.md') + f':{n}' for n in (2, 4, 6)]
