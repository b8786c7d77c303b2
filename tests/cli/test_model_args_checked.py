"""A user's factory given --model-args it does not take is refused in the parent, with the
factory's signature, by every command that takes --model (no rank is spawned)."""

import sys

import pytest
from click.testing import CliRunner

import commlab
from commlab.cli import main
from commlab.models import check_workload

FACTORY = """
import torch

def tiny(width=8):
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))

def sized(width):
    return torch.nn.Linear(width, 2)

def anything(**sizes):
    return torch.nn.Linear(sizes.get("width", 4), 2)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "newcomer_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("newcomer_models", None)

    def refuse(*_a, **_k):
        raise AssertionError("a rank was spawned")

    monkeypatch.setattr(commlab, "launch", refuse)
    monkeypatch.setattr("commlab.runtime.launch.launch", refuse, raising=False)
    yield "newcomer_models"
    sys.modules.pop("newcomer_models", None)


def test_check_workload_binds_the_sizes_to_the_factory(user_module):
    check_workload(f"{user_module}:tiny", width=16)
    check_workload(f"{user_module}:anything", depth=3, width=4)  # **sizes takes every name
    with pytest.raises(ValueError, match=r"depth=3.*tiny\(width=8\).*takes width"):
        check_workload(f"{user_module}:tiny", depth=3)
    with pytest.raises(ValueError, match=r"sized\(width\).*missing"):
        check_workload(f"{user_module}:sized")


@pytest.mark.parametrize("command", [
    ["sweep"], ["calibrate"], ["predict"], ["tune"],
    ["pipeline", "plan", "--no-calibrate"],
])
def test_every_model_command_refuses_a_size_the_factory_does_not_take(user_module, tmp_path, command):
    r = CliRunner().invoke(main, [*command, "--model", f"{user_module}:tiny", "--model-args", "depth=3",
                                  *(["--out", str(tmp_path / "out")] if command[0] in ("sweep", "predict") else []),
                                  *(["--profile", str(tmp_path / "p.json")] if command[0] in ("calibrate", "predict", "tune") else [])])
    assert r.exit_code == 2, r.output
    assert "depth=3" in r.output and "takes width" in r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "p.json").exists()


def test_bench_ddp_refuses_a_factory_that_needs_sizes(user_module):
    r = CliRunner().invoke(main, ["bench", "ddp", "--model", f"{user_module}:sized"])
    assert r.exit_code == 2 and "sized(width)" in r.output, r.output
