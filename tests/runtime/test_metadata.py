"""Run metadata a reviewer asks for, in the runtime layer (the sweep re-exports it)."""

import pytest
import torch

from commlab.runtime import metadata
from commlab.sweep import metadata as sweep_metadata


@pytest.mark.slow
def test_environment_records_versions_threads_and_collect_env():
    env = metadata.environment()
    assert env["torch"] == torch.__version__
    assert env["threads"]["torch"] == torch.get_num_threads() and "OMP_NUM_THREADS" in env["threads"]
    assert env["packages"]["pandas"] and env["packages"]["numpy"]
    assert env["backends"]["gloo"].startswith("bundled with torch")
    assert env["collect_env"]["torch_version"].startswith(torch.__version__.split("+")[0])
    assert env["cpu_count"] >= 1
    assert sweep_metadata.environment is metadata.environment  # the old import path still works


def test_dirty_tree_warning():
    assert metadata.dirty_warning({"git": {"commit": "0123456789abcdef", "dirty": True}}).startswith(
        "warning: the commlab checkout has uncommitted changes (commit 0123456789)")
    assert metadata.dirty_warning({"git": {"commit": "0123456789abcdef", "dirty": False}}) is None
    assert metadata.dirty_warning({"git": None}) is None
