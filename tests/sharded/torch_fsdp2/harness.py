"""torch's FSDP2 test classes, loaded from a torch source checkout and run on CPU/Gloo at world size 2.

torch's files (test/distributed/_composable/fsdp/test_fully_shard_*.py) are not in the wheel;
``COMMLAB_TORCH_SRC`` names the checkout. Their multi-process classes derive from
torch.testing._internal.common_fsdp.FSDPTest, which spawns one process per rank and, on a machine
without accelerators, exits every rank as "skipped" (its ``_run`` compares the accelerator count
with the world size; ``skip_if_lt_x_gpu`` checks CUDA before each test). This module lifts those
gates without editing torch's files, before importing them:

- ``skip_if_lt_x_gpu(x)`` runs the test when ``x`` ranks fit the run's world size (2), and skips
  it, saying so, when it needs more (2-D meshes, HSDP at 4 or 8 ranks);
- each FSDPTest class is subclassed here with ``world_size`` 2 (1 where the class is about a
  single rank) and a ``_run`` that starts Gloo over the test's file store, as FSDPTest's does
  for CPU, without the accelerator count;
- files that still name "cuda" (older revisions pin the device) run under a TorchFunctionMode that
  puts "cuda" tensors on the CPU, with ``init_device_mesh("cuda")`` made a CPU mesh and
  ``replicate(device_ids=...)`` of a CPU module given no device ids, as torch's CPU path does.

``COMMLAB_FSDP2_IMPL`` picks the ``fully_shard`` every rank uses: ``torch`` (torch's) or
``commlab`` (shim.py), put wherever the tests look it up (torch.distributed.fsdp, the
_composable alias, common_fsdp and each test module's imported name). Each call appends the
implementation's name to ``COMMLAB_SUITE_LOG/<test>.<rank>``: the check that the swap took.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import unittest

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
import torch.distributed.fsdp as fsdp
from torch.overrides import TorchFunctionMode
from torch.testing._internal import common_distributed, common_fsdp
from torch.testing._internal.common_utils import set_rng_seed

WORLD_SIZE = 2
SINGLE_RANK = {"TestFullyShardWorldSize1"}  # classes whose subject is one rank
FILES = ("training", "frozen", "autograd", "clip_grad_norm_", "state_dict", "mixed_precision")
TORCH_FULLY_SHARD = fsdp.fully_shard


def _ranks_gate(x: int, *, allow_cpu: bool = False):
    def decorator(test):
        if x <= WORLD_SIZE:
            return test
        return unittest.skip(f"needs {x} ranks; this harness runs {WORLD_SIZE}")(test)

    return decorator


def _cpu_device(device):
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


class CudaOnCpu(TorchFunctionMode):
    """Tensors a test asks for on "cuda" are made on the CPU (the file pins the device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


def _cpu_mesh(device_type, *args, **kwargs):
    return device_mesh.init_device_mesh(_cpu_device(device_type), *args, **kwargs)


def _replicate_on_cpu(replicate):
    @functools.wraps(replicate)
    def wrapper(module, *args, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            kwargs.pop("device_ids", None)
        return replicate(module, *args, **kwargs)

    wrapper.on_cpu = True
    return wrapper


def _load_modules() -> list:
    src = os.environ["COMMLAB_TORCH_SRC"]
    sys.path.insert(0, os.path.join(src, "test", "distributed", "_composable", "fsdp"))
    common_distributed.skip_if_lt_x_gpu = _ranks_gate
    # An older revision reads the accelerator's type at import; on a CPU-only build there is none.
    current = torch.accelerator.current_accelerator
    torch.accelerator.current_accelerator = lambda *a, **k: current(*a, **k) or torch.device("cpu")
    try:
        wanted = os.environ.get("COMMLAB_FSDP2_FILES", ",".join(FILES)).split(",")
        return [importlib.import_module(f"test_fully_shard_{name}") for name in wanted]
    finally:
        torch.accelerator.current_accelerator = current


def _pins_cuda(module) -> bool:
    with open(module.__file__) as f:
        text = f.read()
    return '"cuda"' in text or ".cuda()" in text


def recording(fully_shard, name: str):
    @functools.wraps(fully_shard)
    def wrapper(*args, **kwargs):
        path = os.environ.get("COMMLAB_FSDP2_BUILT")
        if path:
            with open(path, "a") as f:
                f.write(name + "\n")
        return fully_shard(*args, **kwargs)

    return wrapper


def install(test_name: str, rank: int) -> None:
    """In a spawned rank, before its test: the chosen fully_shard everywhere the tests find it."""
    os.environ["COMMLAB_FSDP2_BUILT"] = os.path.join(os.environ["COMMLAB_SUITE_LOG"], f"{test_name}.{rank}")
    if os.environ["COMMLAB_FSDP2_IMPL"] == "commlab":
        import shim

        chosen = shim.fully_shard
    else:
        chosen = recording(TORCH_FULLY_SHARD, "torch")
    import torch.distributed._composable.fsdp as composable_fsdp

    for namespace in (fsdp, composable_fsdp, common_fsdp, *MODULES):
        if hasattr(namespace, "fully_shard"):
            namespace.fully_shard = chosen
    for module in MODULES:
        if hasattr(module, "init_device_mesh") and module in CUDA_PINNED:
            module.init_device_mesh = _cpu_mesh
        if hasattr(module, "replicate") and not getattr(module.replicate, "on_cpu", False):
            module.replicate = _replicate_on_cpu(module.replicate)


class OnGloo:
    """FSDPTest's rank start-up for CPU: Gloo over the test's file store, world size 2."""

    @property
    def world_size(self) -> int:
        return 1 if type(self).__name__ in SINGLE_RANK else WORLD_SIZE

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        self = cls(test_name)
        self.rank, self.file_name = rank, file_name
        dist.init_process_group("gloo", init_method=f"file://{file_name}", world_size=self.world_size, rank=rank)
        install(test_name, rank)
        mode = CudaOnCpu() if sys.modules[cls.__bases__[1].__module__] in CUDA_PINNED else None
        dist.barrier()
        set_rng_seed()
        if mode is None:
            self.run_test(test_name, pipe)
        else:
            with mode:
                self.run_test(test_name, pipe)
        dist.barrier()
        dist.destroy_process_group()


MODULES = _load_modules()
CUDA_PINNED = [m for m in MODULES if _pins_cuda(m)]
CLASSES: list[type] = []
for _module in MODULES:
    for _name, _cls in vars(_module).items():
        if isinstance(_cls, type) and issubclass(_cls, common_fsdp.FSDPTest) and _cls.__module__ == _module.__name__:
            if not any(n.startswith("test_") for n in dir(_cls)):
                continue  # a base class of others (the clip tests' shared body)
            _sub = type(_name, (OnGloo, _cls), {"__module__": __name__, "__qualname__": _name})
            globals()[_name] = _sub
            CLASSES.append(_sub)


def file_of(cls: type) -> str:
    return cls.__bases__[1].__module__.removeprefix("test_fully_shard_")
