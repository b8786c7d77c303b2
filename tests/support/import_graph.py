"""The import walk over commlab's modules: every import counted wherever it is written.

An import inside a function runs later than one at the top of a module, so it can hide a cycle
from Python; the walk counts it. Imports under ``if TYPE_CHECKING:`` never run and only name
types: they are not counted. Used by the import-cycle, architecture and package-map tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
