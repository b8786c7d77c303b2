"""The pipeline package's shape: small modules that each name their one job, and ``commlab pipeline
--help`` without torch (tests/test_imports.py checks the whole package for import cycles)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import commlab

ROOT = Path(commlab.__file__).resolve().parent
PIPELINE = ROOT / "pipeline"


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


@pytest.mark.slow
def test_pipeline_help_does_not_import_torch():
    for args in (["pipeline", "--help"], ["pipeline", "bench", "--help"], ["pipeline", "plan", "--help"]):
        out = subprocess.run([sys.executable, "-c", _HELP.format(args=[args])], capture_output=True, text=True, timeout=120,
                             cwd=ROOT.parent, env={"PYTHONPATH": str(ROOT.parent), "PATH": "/usr/bin:/bin"})  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "Usage:" in out.stdout and out.stdout.strip().endswith("NO TORCH"), (args, out.stdout[-300:], out.stderr[-2000:])
