"""The pipeline package's shape: no import cycle (imports inside functions counted), small modules
that each name their one job, and ``commlab pipeline --help`` without torch."""

import ast
import subprocess
import sys
from pathlib import Path

import commlab

ROOT = Path(commlab.__file__).resolve().parent
PIPELINE = ROOT / "pipeline"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The commlab modules ``path`` imports, anywhere in the file (functions and TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            # A name is its module if it is one, else the nearest enclosing package or module.
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("commlab"):
                found.add(name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_through_the_pipeline_counting_imports_in_functions():
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {m: _imports(p, set(files)) - {m} for m, p in files.items()}
    # A package's __init__ importing its own submodules is how re-exports work, not a cycle.
    graph = {m: {d for d in deps if not (d.startswith(m + ".") and files[m].name == "__init__.py")} for m, deps in graph.items()}
    pipeline = {m: deps for m, deps in graph.items()}
    cycle = _cycle({m: {d for d in deps if d in pipeline} for m, deps in pipeline.items() if m.startswith("commlab.pipeline")})
    assert cycle is None, " -> ".join(cycle)


def test_pipeline_modules_are_small_and_name_their_job():
    for path in sorted(PIPELINE.rglob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) < 300, f"{path.relative_to(ROOT)} has {len(text.splitlines())} lines"
        doc = ast.get_docstring(ast.parse(text))
        assert doc and doc.splitlines()[0].strip(), f"{path.relative_to(ROOT)} has no first docstring line"


_HELP = """
import sys
from commlab.cli import main
for args in {args!r}:
    try:
        main.main(args, standalone_mode=False)
    except SystemExit:
        pass
print("TORCH" if "torch" in sys.modules else "NO TORCH")
"""


def test_pipeline_help_does_not_import_torch():
    for args in (["pipeline", "--help"], ["pipeline", "bench", "--help"], ["pipeline", "plan", "--help"]):
        out = subprocess.run([sys.executable, "-c", _HELP.format(args=[args])], capture_output=True, text=True, timeout=120,
                             cwd=ROOT.parent, env={"PYTHONPATH": str(ROOT.parent), "PATH": "/usr/bin:/bin"})  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "Usage:" in out.stdout and out.stdout.strip().endswith("NO TORCH"), (args, out.stdout[-300:], out.stderr[-2000:])
