"""`commlab --help` answers without importing torch (which alone takes seconds to import)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

PROBE = """
import sys
from commlab.cli import main
for args in (["--help"], ["sweep", "--help"], ["figures", "--help"], ["trace", "--help"], ["bench", "--help"]):
    try:
        main(args)
    except SystemExit as stop:
        assert stop.code == 0, (args, stop.code)
import commlab
print("HEAVY", sorted(m for m in ("torch", "pandas", "numpy", "matplotlib") if m in sys.modules))
"""


def test_help_imports_no_heavy_module():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    assert "sweep" in out.stdout and "--bucket-mb" in out.stdout and "--repeat" in out.stdout


def test_the_public_api_still_loads_on_first_use():
    out = subprocess.run([sys.executable, "-c", "from commlab import launch, LaunchError, Runtime; "
                          "import commlab; print(commlab.launch is launch, issubclass(LaunchError, RuntimeError))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stderr


# Each command's --help in a fresh interpreter: the command is loaded through the lazy group (as
# `commlab bench ddp --help` does) and must not have imported torch on the way.
HELP_PROBE = """
import sys
from commlab.cli import main
try:
    main({args!r}, standalone_mode=False)
except SystemExit:
    pass
print("TORCH", "torch" in sys.modules)
"""
OWN_COMMANDS = [["sweep"], ["figures"], ["trace"], ["bench"], ["bench", "ddp"], ["bench", "sharded"],
                ["bench", "collectives"]]


def test_each_command_help_imports_no_torch_and_names_nothing_private():
    for command in OWN_COMMANDS:
        out = subprocess.run([sys.executable, "-c", HELP_PROBE.format(args=[*command, "--help"])],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (command, out.stderr)
        assert out.stdout.strip().endswith("TORCH False"), (command, out.stdout)
        assert "Usage: " in out.stdout and " _" not in out.stdout.replace("--", ""), (command, out.stdout)
