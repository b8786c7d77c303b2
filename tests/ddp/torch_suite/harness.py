"""torch's own DDP test classes, rebuilt as torch's CI spawns them, with a chosen DDP in every rank.

torch runs ``_DistTestBase`` through test/distributed/test_distributed_spawn.py (TestDistBackend
plus ``_spawn_processes``, BACKEND / WORLD_SIZE / TEMP_DIR from the environment) and the
distributed-autograd suites through rpc_utils.generate_tests (the suite, an agent fixture and
SpawnHelper mixed into one class). The classes below do the same. ``COMMLAB_SUITE_DDP`` picks the
DDP: ``commlab`` puts commlab's class where the tests look it up (``nn.parallel`` and the test
modules' own imported name) before each rank runs its test; ``torch`` leaves torch's. Either way
every construction appends the class actually built to ``COMMLAB_SUITE_LOG/<test>.<rank>``, the
check that the swap took. Set the environment (run.py does) before importing this module.
"""

from __future__ import annotations

import inspect
import os
import re

import torch
import torch.nn.parallel
from torch.testing._internal.distributed import ddp_under_dist_autograd_test as under_autograd
from torch.testing._internal.distributed import distributed_test
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import TensorPipeRpcAgentTestFixture
from torch.testing._internal.distributed.rpc_utils import SpawnHelper

import commlab

TORCH_DDP = torch.nn.parallel.DistributedDataParallel


def chosen_ddp() -> type:
    return {"commlab": commlab.DistributedDataParallel, "torch": TORCH_DDP}[os.environ["COMMLAB_SUITE_DDP"]]


def install(test_name: str, rank: int) -> None:
    """In a spawned rank, before its test: put the chosen class everywhere torch's tests find
    DDP, and record each construction."""
    cls = chosen_ddp()
    original_init = cls.__init__
    log = os.path.join(os.environ["COMMLAB_SUITE_LOG"], f"{test_name}.{rank}")

    def recording_init(self, *args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{type(self).__module__}.{type(self).__qualname__}\n")
        original_init(self, *args, **kwargs)

    cls.__init__ = recording_init
    torch.nn.parallel.DistributedDataParallel = cls
    distributed_test.DistributedDataParallel = cls
    under_autograd.DistributedDataParallel = cls
    # The check inside the rank: every name the tests use resolves to the chosen class.
    assert distributed_test.nn.parallel.DistributedDataParallel is cls
    assert under_autograd.DistributedDataParallel is cls


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """test/distributed/test_distributed_spawn.py's class for BACKEND=gloo."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        install(test_name, rank)
        super()._run(rank, test_name, file_name, pipe, **kwargs)


class TensorPipeDdpUnderDistAutogradTest(
    under_autograd.DdpUnderDistAutogradTest, TensorPipeRpcAgentTestFixture, SpawnHelper
):
    """rpc_utils.generate_tests("TensorPipe", TensorPipeRpcAgentTestFixture, [...])'s class."""

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        install(test_name, rank)
        super()._run(rank, test_name, file_name, pipe, **kwargs)


class TensorPipeDdpComparisonTest(under_autograd.DdpComparisonTest, TensorPipeRpcAgentTestFixture, SpawnHelper):
    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        install(test_name, rank)
        super()._run(rank, test_name, file_name, pipe, **kwargs)


CLASSES = [TestDistBackendWithSpawn, TensorPipeDdpUnderDistAutogradTest, TensorPipeDdpComparisonTest]


MENTIONS_DDP = re.compile(r"DistributedDataParallel|ddp|DDP")


def is_ddp_test(cls: type, name: str) -> bool:
    """The selection: tests whose name, source, or the source of the ``self._helper(...)`` methods
    it calls mentions DistributedDataParallel, ddp or DDP."""
    if not name.startswith("test_"):
        return False
    text = name + _source(getattr(cls, name))
    for helper in set(re.findall(r"self\.(_\w+)\(", text)):
        text += _source(getattr(cls, helper, None))
    return MENTIONS_DDP.search(text) is not None


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (TypeError, OSError):  # not a Python function (or a property, a builtin)
        return ""
