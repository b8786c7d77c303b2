"""The layout shows the architecture: rooms by role, imports one way, commands only in the CLI.

- the cost model never imports the measurement harness (commlab.sweep, commlab.bench), and the
  sweep never imports the cost model: both speak commlab.runs, and commlab.validation sits above;
- no module outside commlab/cli/ declares a click command or runs as ``__main__`` (the sweep's
  torchrun rank entry aside: torchrun starts a module, not a command);
- no folder of commlab/ holds more than 20 modules, and no module is over 300 lines.
Imports are counted wherever they are written (tests/support/import_graph.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.import_graph import ROOT, import_graph, module_files

MAX_MODULES, MAX_LINES = 20, 300
# torchrun runs `python -m commlab.sweep.worker` on every rank of a multi-node sweep.
RANK_ENTRIES = {"commlab.sweep.worker"}


def crossings(graph: dict[str, set[str]], source: str, targets: tuple[str, ...]) -> list[str]:
    """``a -> b`` for every module a under ``source`` importing a module b under one of ``targets``."""
    inside = lambda m, p: m == p or m.startswith(p + ".")  # noqa: E731
    return sorted(f"{a} -> {b}" for a, deps in graph.items() if inside(a, source)
                  for b in deps if any(inside(b, t) for t in targets))


def _is_click_decorator(node: ast.expr) -> bool:
    """``@click.command(...)``, ``@click.group``, ``@something.command(...)`` / ``.group(...)``."""
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Attribute) and target.attr in ("command", "group")


def _is_main_guard(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def entry_points(path: Path) -> list[str]:
    """What in this file makes it a command: click decorators and ``if __name__ == ...`` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    found = [f"{path.name}:{n.lineno} click {n.name}" for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(_is_click_decorator, n.decorator_list))]
    found += [f"{path.name}:{n.lineno} __main__" for n in tree.body if _is_main_guard(n)]
    return found


def test_the_checks_find_what_they_look_for(tmp_path):
    graph = {"commlab.costmodel.search.predict": {"commlab.sweep.runner", "commlab.runs.store"},
             "commlab.sweep.worker": {"commlab.runs.config"}}
    assert crossings(graph, "commlab.costmodel", ("commlab.sweep", "commlab.bench")) == [
        "commlab.costmodel.search.predict -> commlab.sweep.runner"]
    assert crossings(graph, "commlab.sweep", ("commlab.costmodel",)) == []
    script = tmp_path / "script.py"
    script.write_text("import click\n@click.command()\ndef main():\n    pass\n\n@main.group\ndef sub():\n    pass\n\n"
                      "def helper():\n    pass\n\nif __name__ == '__main__':\n    main()\n")
    assert entry_points(script) == ["script.py:3 click main", "script.py:7 click sub", "script.py:13 __main__"]


def test_the_cost_model_and_the_harness_do_not_import_each_other():
    graph = import_graph()
    assert crossings(graph, "commlab.costmodel", ("commlab.sweep", "commlab.bench", "commlab.validation",
                                                  "commlab.cli")) == []
    assert crossings(graph, "commlab.sweep", ("commlab.costmodel", "commlab.validation")) == []
    assert crossings(graph, "commlab.runs", ("commlab.sweep", "commlab.bench", "commlab.costmodel")) == []
    # tensor parallelism is a mechanism beside DDP and the pipeline: it knows none of the applications
    assert crossings(graph, "commlab.tensor", ("commlab.ddp", "commlab.pipeline", "commlab.sweep", "commlab.bench",
                                               "commlab.costmodel", "commlab.validation", "commlab.cli")) == []


def test_commands_live_in_the_cli_only():
    found = [hit for name, path in module_files().items()
             if not name.startswith("commlab.cli") and name not in RANK_ENTRIES for hit in entry_points(path)]
    assert not found, "a command outside commlab/cli/: " + "; ".join(found)


def test_folders_and_modules_stay_small():
    files = module_files()
    per_folder: dict[Path, int] = {}
    for path in files.values():
        per_folder[path.parent] = per_folder.get(path.parent, 0) + 1
    crowded = {str(d.relative_to(ROOT)): n for d, n in per_folder.items() if n > MAX_MODULES}
    long = {str(p.relative_to(ROOT)): n for p in files.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not crowded, f"folders over {MAX_MODULES} modules: {crowded}"
    assert not long, f"modules over {MAX_LINES} lines: {long}"
