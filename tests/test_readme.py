"""Every example in README.md runs as written.

Python: each ```python block runs in a fresh interpreter in its own directory, as a user would
paste it into a file; a block fenced ```python fragment continues an earlier example and is only
compiled.

Bash: the ```bash blocks run in order, each with ``bash -e`` (every command must succeed), in one
temporary working directory shared by all of them, as a user would type them one after another
in a fresh clone: the directory holds a copy of the repository's sweeps/ and examples/, a
``commlab`` on PATH runs this checkout's CLI with this interpreter (PYTHONPATH is the repository
root), and HOME is a fresh directory so that calibrations do not touch the user's cache.
Each block has its own timeout. Blocks are fenced with a word after ``bash`` when they must not
run here:

- ```bash setup: the two set-up commands at the top. They install the package (pip, the
  network); .ci/run runs the second one on a clean clone, and the first one's sweep is the
  default grid, whose code the sweep block runs on a smaller grid;
- ```bash gpu and ```bash multinode: need a GPU or several nodes; skipped with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FENCES = re.findall(r"^```(\w*)([^\n]*)\n(.*?)^```", README, re.M | re.S)
PYTHON = [(info.strip(), code) for lang, info, code in FENCES if lang == "python"]
RUNNABLE = [code for info, code in PYTHON if info == ""]
BASH = [(info.strip(), code) for lang, info, code in FENCES if lang == "bash"]
NOT_RUN_HERE = {
    "setup": "installs with pip; .ci/run runs the test command on a clean clone",
    "gpu": "needs a GPU",
    "multinode": "needs several nodes",
}
BLOCK_TIMEOUT_S = 300
SHIM = """#!/bin/sh
exec "{python}" -c 'import sys; from commlab.cli import main; sys.argv[0] = "commlab"; main()' "$@"
"""


def test_the_readme_has_examples():
    assert len(RUNNABLE) >= 4 and all(info in ("", "fragment") for info, _ in PYTHON)
    for info, code in PYTHON:
        compile(code, f"README.md python {info}", "exec")
    assert BASH and BASH[0][0] == "setup", "the README opens with its set-up commands"
    setup = [line for line in BASH[0][1].splitlines() if line.strip()]
    assert len(setup) == 2 and "pytest" in setup[1], "two set-up commands: run the job, run the tests"
    assert "pytest" in (ROOT / ".ci" / "run").read_text()
    assert all(info in ("", *NOT_RUN_HERE) for info, _ in BASH), [info for info, _ in BASH]
    assert "..." not in "".join(code for info, code in BASH), "a literal ... does not run"


@pytest.mark.parametrize("code", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
@pytest.mark.slow
def test_readme_python_block_runs(tmp_path, code):
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


class BashSession:
    """One working directory for all of the README's bash blocks, run in order on demand (so a
    block selected alone still runs after the blocks before it)."""

    def __init__(self, base: Path):
        self.cwd, self.home, bin_dir = base / "work", base / "home", base / "bin"
        for name in ("sweeps", "examples"):
            shutil.copytree(ROOT / name, self.cwd / name)
        self.home.mkdir()
        bin_dir.mkdir()
        shim = bin_dir / "commlab"
        shim.write_text(SHIM.format(python=sys.executable))
        shim.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                    "PYTHONPATH": str(ROOT), "HOME": str(self.home)}
        self.results: dict[int, subprocess.CompletedProcess | str] = {}

    def run(self, index: int) -> subprocess.CompletedProcess | str:
        for i in range(index + 1):
            if i not in self.results:
                self.results[i] = self._run_one(*BASH[i])
        return self.results[index]

    def _run_one(self, info: str, code: str) -> subprocess.CompletedProcess | str:
        if info:
            return NOT_RUN_HERE[info]
        start = time.perf_counter()
        try:
            out = subprocess.run(["bash", "-e", "-c", code], cwd=self.cwd, env=self.env, capture_output=True,
                                 text=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            return f"timed out after {BLOCK_TIMEOUT_S} s: {code}\n{e.stdout or ''}{e.stderr or ''}"
        print(f"README bash block took {time.perf_counter() - start:.1f} s:\n{code}")
        return out


@pytest.fixture(scope="module")
def bash_session(tmp_path_factory):
    return BashSession(tmp_path_factory.mktemp("readme"))


@pytest.mark.parametrize("index", range(len(BASH)), ids=[f"bash{i}-{info or 'run'}" for i, (info, _) in enumerate(BASH)])
@pytest.mark.slow
def test_readme_bash_block_runs(bash_session, index):
    info, code = BASH[index]
    if info:
        pytest.skip(f"```bash {info}: {NOT_RUN_HERE[info]}")
    out = bash_session.run(index)
    assert not isinstance(out, str), out
    assert out.returncode == 0, f"{code}\nexit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}"
