"""Every Python example in README.md runs as written (each in a fresh interpreter, as a user
would paste it into a file). A block fenced ```python fragment continues an earlier example and
is only compiled."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```(python[^\n]*)\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
RUNNABLE = [code for info, code in BLOCKS if info.strip() == "python"]


def test_the_readme_has_examples():
    assert len(RUNNABLE) >= 4 and all(info.strip() in ("python", "python fragment") for info, _ in BLOCKS)
    for info, code in BLOCKS:
        compile(code, f"README.md {info}", "exec")


@pytest.mark.parametrize("code", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_readme_python_block_runs(tmp_path, code):
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
