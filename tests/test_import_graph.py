"""The project's import graph, read from the code (nothing is imported): the running
side (`tfpipe.pipeline`) never imports the measuring and planning side
(`tfpipe.tuning`), and no modules import each other in a circle. Imports inside
functions and under `if TYPE_CHECKING` count: a circle a reader has to untangle is
one whether or not Python trips over it."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ('tfpipe', 'trainer', 'model_registry', 'params', 'benchmarks', 'examples')


def module_paths() -> dict[str, pathlib.Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob('*.py'):
            parts = path.relative_to(ROOT).with_suffix('').parts
            mods['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
    return mods


def imported_names(tree: ast.AST) -> list[str]:
    """Dotted names an import statement may refer to: `from a.b import c` can be the
    module a.b.c or the name c of a.b."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f'{node.module}.{alias.name}' for alias in node.names]
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's own parents excluded:
    importing a.b runs a's __init__, which is no dependency of a.b's code)."""
    mods = module_paths()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges[name] = set()
        for target in imported_names(ast.parse(path.read_text(), str(path))):
            while target and target not in mods:
                target = target.rpartition('.')[0]
            if target and target != name and not name.startswith(target + '.'):
                edges[name].add(target)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(edges[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def test_the_graph_sees_the_project():
    edges = import_graph()
    assert 'tfpipe.pipeline.executor' in edges and 'tfpipe.tuning.timeline' in edges
    assert 'tfpipe.pipeline.recorder' in edges['tfpipe.tuning.timeline']
    assert 'tfpipe.tuning.timeline' in edges['trainer.train_job']


def test_circles_finds_a_circle():
    edges = {'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}
    assert circles(edges) == [['a', 'b', 'c']]


def test_running_side_never_imports_tuning():
    edges = import_graph()
    back = {f'{m} -> {t}' for m, targets in edges.items() if m.startswith('tfpipe.pipeline')
            for t in targets if t == 'tfpipe.tuning' or t.startswith('tfpipe.tuning.')}
    assert not back, f'tfpipe.pipeline must not import tfpipe.tuning: {sorted(back)}'


def test_no_import_circles():
    assert circles(import_graph()) == []
