"""`--model package.module:factory` finds the module in the current directory, as `python -m` does."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

FACTORY = """
import torch

def tiny(width=8):
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
"""
# Started as the `commlab` console script is: sys.path[0] is the script's own directory, not the
# current directory (which `python -c` and `python -m` would add themselves).
ENTRY = "import sys\nfrom commlab.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n"


def _commlab(tmp_path, *args):
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    (work / "userpkg").mkdir(parents=True, exist_ok=True)
    (work / "userpkg" / "models.py").write_text(FACTORY)
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "commlab").write_text(ENTRY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, str(bin_dir / "commlab"), *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_module_in_the_current_directory_is_found_by_the_parent_and_the_ranks(tmp_path):
    run = _commlab(tmp_path, "bench", "ddp", "--model", "userpkg.models:tiny", "--iters", "2", "--warmup", "0",
                   "--batch", "2", "--timeout", "120")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "model userpkg.models:tiny" in run.stdout and "ratio commlab/torch" in run.stdout


def test_a_missing_module_names_itself_and_the_directory_searched(tmp_path):
    run = _commlab(tmp_path, "bench", "ddp", "--model", "nopkg.models:tiny")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "cannot import 'nopkg.models'" in run.stderr and str(tmp_path / "work") in run.stderr
    assert "PYTHONPATH" in run.stderr
