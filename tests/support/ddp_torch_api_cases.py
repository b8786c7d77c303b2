"""Rank-side code of tests/ddp/test_torch_api.py: torch DDP's API edges on torch's DDP and commlab's.

``first`` runs every check of one spawn (no_sync with find_unused_parameters, pickling and
deepcopy, the logging dictionary, ``_set_static_graph``, backward under distributed autograd);
``second`` loads the DDP that ``first`` saved, in new processes, and trains it.
"""

from __future__ import annotations

import copy
import io
import pickle
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import commlab
from tests.support.helpers import error_of


class SometimesB(nn.Module):
    """``a`` always; ``b`` only when the caller says so (a layer one micro-batch uses)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x, use_b: bool):
        return self.a(x) + (self.b(x) if use_b else 0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 8, bias=False), nn.Linear(8, 6, bias=False), nn.Linear(6, 2, bias=False)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _grads(module: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    """Same names, the same Nones, equal values."""
    return a.keys() == b.keys() and all(
        (a[k] is None) == (b[k] is None) and (a[k] is None or torch.equal(a[k], b[k])) for k in a
    )


def _params(module: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def no_sync_accumulation(rank: int) -> dict:
    """Two accumulations of two micro-batches, find_unused_parameters=True. In the first only
    rank 0 uses ``b``, only in its no_sync micro-batch; in the second nobody uses it."""
    torch.manual_seed(0)
    base = SometimesB()
    out = {}
    for name, cls in (("torch", TorchDDP), ("ours", commlab.DistributedDataParallel)):
        ddp = cls(copy.deepcopy(base), find_unused_parameters=True)
        grads = []
        for step in range(2):
            x = torch.full((2, 6), float(rank + 1 + step))
            with ddp.no_sync():
                ddp(x, use_b=(rank == 0 and step == 0)).sum().backward()
            ddp(2 * x, use_b=False).sum().backward()
            grads.append(_grads(ddp.module))
        out[name] = grads
    return {"same": [_same(t, o) for t, o in zip(out["torch"], out["ours"])],
            "b_grad_none": [g["b.weight"] is None for g in out["ours"]],
            "b_grad": out["ours"][0]["b.weight"]}  # fmt: skip


def _train(ddp, rank: int, steps: int, seed: int = 1) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(3, 4, generator=gen)).square().sum().backward()
        opt.step()


def pickling(rank: int, save_path: str) -> dict:
    torch.manual_seed(2)
    ddp = commlab.DistributedDataParallel(Net())
    _train(ddp, rank, 2)
    loaded = pickle.loads(pickle.dumps(ddp))
    copied = copy.deepcopy(ddp)
    buffer = io.BytesIO()
    torch.save(ddp, buffer)
    buffer.seek(0)
    reloaded = torch.load(buffer, weights_only=False)
    before = _params(ddp.module)
    result = {
        "types": [type(m).__name__ for m in (loaded, copied, reloaded)],
        "equal_after_load": [_same(before, _params(m.module)) for m in (loaded, copied, reloaded)],
        "shared": any(p is q for p, q in zip(ddp.parameters(), copied.parameters())),
    }
    # The copy trains as the original does (from here on, the same batches).
    _train(ddp, rank, 2, seed=5)
    _train(copied, rank, 2, seed=5)
    result["copy_trains_as_original"] = _same(_params(ddp.module), _params(copied.module))
    result["copy_grads_averaged"] = _same(_grads(ddp.module), _grads(copied.module))
    subgroup = dist.new_group([0, 1])
    result["subgroup_error"] = error_of(lambda: pickle.dumps(commlab.DistributedDataParallel(Net(), process_group=subgroup)))
    if rank == 0:
        torch.save(ddp, save_path)
    dist.barrier()
    return result


def logging_data(rank: int) -> dict:
    """The dictionaries of both DDPs after the same training, and the sampled iterations."""
    out = {}
    for name, cls in (("torch", TorchDDP), ("ours", commlab.DistributedDataParallel)):
        torch.manual_seed(3)
        ddp = cls(Net())
        ddp._set_ddp_runtime_logging_sample_rate(2)
        iterations = []
        for _ in range(14):
            _train(ddp, rank, 1)
            iterations.append(ddp._get_ddp_logging_data().get("iteration"))
        unused = cls(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), find_unused_parameters=True, bucket_cap_mb=1e-4)
        _train(unused, rank, 3)
        # torch's attribute and its first-bucket cap, for the default and explicit caps
        built = [cls(Net(), bucket_cap_mb=mb) for mb in (None, 0.5, 25, 100.5)]
        firsts = [d._bucket_config.first_bucket_bytes_cap if name == "torch" else d.first_bucket_bytes_cap for d in built]
        out[name] = {"trained": ddp._get_ddp_logging_data(), "iterations": iterations,
                     "unused": unused._get_ddp_logging_data(), "caps": [d.bucket_bytes_cap for d in built], "firsts": firsts,
                     "bad_rate": error_of(lambda: ddp._set_ddp_runtime_logging_sample_rate(0))}  # fmt: skip
    return out


def static_graph(rank: int) -> dict:
    torch.manual_seed(4)
    base = Net()
    reference = TorchDDP(copy.deepcopy(base), static_graph=True)
    ours = commlab.DistributedDataParallel(copy.deepcopy(base))
    ours._set_static_graph()
    for ddp in (reference, ours):
        _train(ddp, rank, 3)
    late = commlab.DistributedDataParallel(Net())
    _train(late, rank, 1)
    return {
        "same": _same(_params(reference.module), _params(ours.module)),
        "static": (ours.static_graph, ours._get_ddp_logging_data().get("static_graph")),
        "late": error_of(late._set_static_graph),
        "late_logged": (late._get_ddp_logging_data().get("has_error"), late._get_ddp_logging_data().get("error", "")),
    }


def distributed_autograd(rank: int, rpc_file: str) -> dict:
    """A synchronised forward inside a distributed autograd context raises NotImplementedError on
    every rank, before any collective; no_sync and no_grad forwards there are allowed; afterwards
    the DDP trains as torch's (nothing was left half done)."""
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{rpc_file}", rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=dist.get_world_size(), rpc_backend_options=options)
    torch.manual_seed(5)
    base = Net()
    ours = commlab.DistributedDataParallel(copy.deepcopy(base))
    reference = TorchDDP(copy.deepcopy(base))
    x = torch.full((2, 4), float(rank + 1))
    result = {}
    with dist_autograd.context():
        start = time.monotonic()
        result["error"] = error_of(lambda: ours(x))
        result["seconds"] = time.monotonic() - start
        with torch.no_grad():
            result["no_grad"] = error_of(lambda: ours(x))
        with ours.no_sync():
            result["no_sync"] = error_of(lambda: ours(x))
    for ddp in (ours, reference):
        ddp.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
    result["trains_after"] = _same(_grads(ours.module), _grads(reference.module))
    rpc.shutdown()
    return result


def first(save_path: str, rpc_file: str) -> dict:
    rank = dist.get_rank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "no_sync": no_sync_accumulation(rank),
            "pickling": pickling(rank, save_path),
            "logging": logging_data(rank),
            "static_graph": static_graph(rank),
            "dist_autograd": distributed_autograd(rank, rpc_file),
        }


def second(save_path: str) -> dict:
    """In new processes: load the pickled DDP, check it, and train it beside torch's DDP."""
    rank = dist.get_rank()
    loaded = torch.load(save_path, weights_only=False)
    reference = TorchDDP(copy.deepcopy(loaded.module))
    same_start = _same(_params(loaded.module), _params(reference.module))
    _train(loaded, rank, 2, seed=7)
    _train(reference, rank, 2, seed=7)
    return {"type": type(loaded).__name__, "same_start": same_start,
            "trains_as_torch": _same(_params(loaded.module), _params(reference.module))}  # fmt: skip
