"""The fully_shard-shaped shim that runs torch's FSDP2 tests on commlab (tests/sharded/torch_fsdp2/shim.py).

In one process: what it records, what it refuses by name, and that at world size 1 the root's
forward runs through commlab.ShardedDataParallel with the wrapper's parameters as the module's.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_fsdp2"))
import shim  # noqa: E402
import table  # noqa: E402


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_records_units_as_fsdp_modules_and_returns_the_module():
    model = _mlp()
    assert shim.fully_shard(model[0]) is model[0]
    assert shim.fully_shard(model) is model
    assert isinstance(model, FSDPModule) and isinstance(model, nn.Sequential)
    assert isinstance(model[0], nn.Linear) and not isinstance(model[2], FSDPModule)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"shard_placement_fn": lambda p: None}, "shard_placement_fn"),
        ({"offload_policy": CPUOffloadPolicy()}, "offload_policy=CPUOffloadPolicy"),
        ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}, "mp_policy"),
    ],
)
def test_refuses_options_commlab_lacks_by_name(kwargs, named):
    with pytest.raises(NotImplementedError, match=named):
        shim.fully_shard(_mlp(), **kwargs)


def test_an_int_reshard_after_forward_reshards_fully():
    # torch would reshard to a smaller group; commlab reshards fully: the same values, more gathering
    model = _mlp()
    assert shim.fully_shard(model, reshard_after_forward=2) is model


def test_fsdp_module_methods_without_a_counterpart_refuse_by_name():
    model = shim.fully_shard(_mlp())
    for name in ("unshard", "reshard", "set_modules_to_forward_prefetch", "_get_fsdp_state"):
        with pytest.raises(NotImplementedError, match=name):
            getattr(model, name)()


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_root_runs_through_commlab_with_the_wrappers_parameters(one_rank):
    model, ref = _mlp(), _mlp()
    shim.fully_shard(model[0])
    shim.fully_shard(model)
    params = list(model.parameters())  # the first touch wraps the root
    wrapper = model._commlab_shim["wrapper"]
    assert [id(p) for p in params] == [id(p) for p in wrapper.parameters()]
    assert len(wrapper.buckets) == 2  # model[0] as a unit, the rest of the root
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), ref(x))
    model(x).sum().backward()
    assert all(p.grad is not None for p in params)
    assert len(wrapper.iteration_timings) == 1  # the wrapper timed the step: its forward ran


def test_first_error_line_skips_the_process_exit_wrapper():
    text = "RuntimeError: Process 0 exited with error code 10 and exception:\nTraceback\nValueError: units[1] holds no\n"
    assert table.first_error(text) == "ValueError: units[1] holds no"
