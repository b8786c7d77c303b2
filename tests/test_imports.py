"""No import cycle between commlab's modules, counting imports placed inside functions.

An import inside a function runs later than one at the top of a module, so it can hide a cycle
from Python; the layering rule (commlab/cli -> apps -> ddp, collectives, pipeline -> runtime) is
about what depends on what, so it counts every import wherever it is written. Imports under
``if TYPE_CHECKING:`` never run and only name types: they are not counted. tests/test_docs.py
uses the same walk for the package map of docs/design.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "commlab"


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every commlab module's dotted name and its file (a package is its ``__init__.py``)."""
    files = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def module_imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The commlab modules that ``name`` imports. ``from pkg import x`` counts ``pkg.x`` when x is
    a module and ``pkg`` otherwise; relative imports are resolved against the importing module."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        for target in targets:
            # `import commlab.a.b` names a module; an attribute path falls back to its module
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the commlab modules it imports (anywhere in its file)."""
    files = module_files(root)
    return {name: module_imports(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None. Iterative depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from commlab import c\n"
        "def f():\n    from .b import g\n    import commlab.c.x\n")
    (pkg / "sub" / "b.py").write_text("from ..c import thing\n")
    (pkg / "c.py").write_text("import commlab.sub.a\n")
    graph = import_graph(tmp_path)
    assert graph["commlab.sub"] == {"commlab.sub.b"}
    assert graph["commlab.sub.a"] == {"commlab.sub.b", "commlab.c"}
    assert graph["commlab.sub.b"] == {"commlab.c"}
    assert find_cycle(graph) == ["commlab.c", "commlab.sub.a", "commlab.c"]  # via the function's import
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_commlab_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
