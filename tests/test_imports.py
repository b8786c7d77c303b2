"""No import cycle between commlab's modules, counting imports placed inside functions.

An import inside a function runs later than one at the top of a module, so it can hide a cycle
from Python; the layering rule (commlab/cli -> apps -> ddp, collectives, pipeline -> runtime) is
about what depends on what, so it counts every import wherever it is written
(tests/support/import_graph.py, the walk the architecture and docs tests use too).
"""

from __future__ import annotations

from tests.support.import_graph import PACKAGE, import_graph


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
