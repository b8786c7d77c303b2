"""The CUDA path: comm streams, events, CUDA-event timings, DDP parity.

Skipped without CUDA, with the reason; scripts/gpu_check.py runs this file on a GPU machine.
- world 1 on NCCL: a p2p collective runs on its channel's own stream, which waits on the compute
  stream through an event, its future completes on that stream (the waiter's stream waits, the
  host does not), and DDP's bucket timings are ordered ready <= launched <= done;
- world 2 on one GPU over Gloo with CUDA tensors: commlab's DDP equals torch's DDP, and CPU
  inputs are moved to device_ids[0] as torch moves them (output_device and dim kept);
- world 1 on NCCL: calibration's queued collective timing (commlab/runtime/timer.py's
  time_queued; its logic on a fake clock: tests/costmodel/calibration/test_collective_timing.py).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import commlab
from commlab import collectives as C
from commlab.collectives import worker as W
from commlab.models import mlp

pytestmark = pytest.mark.slow  # every test here starts processes

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.py on a GPU machine)"
)


def _stream_semantics() -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    out = {}
    seen = {}

    def body(flat, tag):
        seen["stream"] = torch.cuda.current_stream(device)
        flat.mul_(2)

    compute = torch.cuda.current_stream(device)
    # A long kernel on the compute stream produces x; the comm stream must wait for it (event).
    a = torch.randn(4096, 4096, device=device)
    x = (a @ a).sum(dim=0)
    expected = x.clone() * 2
    handle = W.run_collective(body, x, None, True)
    value = handle.get_future().wait()  # the compute stream waits on the comm stream's event
    out["own_stream"] = seen["stream"] != compute and seen["stream"] == W.worker_for(None).stream(device)
    out["value"] = bool(torch.allclose(value, expected))
    out["launched_is_event"] = isinstance(handle.launched, torch.cuda.Event)
    # A real algorithm (world 1: a no-op reduce) sync and async on CUDA tensors.
    y = torch.arange(10.0, device=device)
    C.all_reduce(y, "sum", algorithm="ring")
    C.all_reduce(y, "avg", algorithm="tree", async_op=True).wait()
    out["algorithms"] = y.tolist() == list(range(10))
    # DDP: CUDA-event timings, ordered.
    torch.manual_seed(0)
    model = mlp(6, 512, in_features=64, classes=4).to(device)
    for algorithm in ("native", "ring"):
        ddp = commlab.DistributedDataParallel(copy.deepcopy(model), device_ids=[device.index], bucket_cap_mb=0.5,
                                              algorithm=algorithm)  # fmt: skip
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            x, y = torch.randn(32, 64, device=device), torch.randint(0, 4, (32,), device=device)
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        t = ddp.iteration_timings[-1]
        eps = 1e-5  # CUDA events resolve to about half a microsecond
        out[f"ordered_{algorithm}"] = all(
            -eps <= b.ready <= b.launched + eps <= b.done + 2 * eps <= t.total + 3 * eps for b in t.buckets
        )
        out[f"columns_{algorithm}"] = t.write_back >= 0 and t.exposed_comm >= 0 and len(t.buckets) > 1
    return out


@pytest.mark.gpu
@needs_cuda
def test_comm_stream_events_and_timings_on_nccl_world_one():
    (out,) = commlab.launch(_stream_semantics, world_size=1, backend="nccl", timeout=180)
    assert all(out.values()), out


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, pair, scale=None):
        return self.fc(pair[0] + pair[1]) * scale["s"]


def _device_keywords(device: torch.device) -> bool:
    """As torch's forward: CPU inputs (nested, and in kwargs) reach the module on device_ids[0];
    output_device and dim are kept, and the legacy gather helper concatenates along dim."""
    model = _Nested().to(device)
    a, b, s = torch.randn(2, 4), torch.randn(2, 4), torch.full((1,), 3.0)
    got = []
    for make in (commlab.DistributedDataParallel, TorchDDP):
        ddp = make(copy.deepcopy(model), device_ids=[device], output_device=device.index, dim=1)
        out = ddp((a, b), scale={"s": s})
        gathered = ddp.gather([out, out], device.index)
        got.append(((ddp.device_ids, ddp.output_device, ddp.dim), out.device, out.detach().cpu(), tuple(gathered.shape)))
    (mine, theirs) = got
    return mine[0] == theirs[0] and mine[1] == theirs[1] == device and torch.equal(mine[2], theirs[2]) and mine[3] == theirs[3] == (2, 8)


def _gloo_on_one_gpu() -> dict:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(dist.get_rank())  # different initial weights: construction broadcasts
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    ours = commlab.DistributedDataParallel(copy.deepcopy(model), device_ids=[0], bucket_cap_mb=1e-3)
    theirs = TorchDDP(copy.deepcopy(model), device_ids=[0], bucket_cap_mb=1e-3)
    for ddp in (ours, theirs):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
            x, y = torch.randn(8, 16, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(ours.module.parameters(), theirs.module.parameters()))
    t = ours.iteration_timings[-1]
    eps = 1e-5
    ordered = all(-eps <= b.ready <= b.launched + eps <= b.done + 2 * eps for b in t.buckets)
    return {"diff": diff, "ordered": ordered, "buckets": len(t.buckets), "device_keywords": _device_keywords(device)}


@pytest.mark.gpu
@needs_cuda
def test_gloo_with_cuda_tensors_two_ranks_on_one_gpu_matches_torch_ddp():
    for out in commlab.launch(_gloo_on_one_gpu, world_size=2, backend="gloo", timeout=180):
        assert out["diff"] <= 1e-6 and out["ordered"] and out["buckets"] > 1 and out["device_keywords"], out


def _sharded_on_gpu() -> dict:
    """Stages 1-3 on CUDA tensors: the same parameters as torch's DDP (both on this backend), the
    flat shards and gathers on the GPU, and the step's peak read from the CUDA allocator."""
    from commlab.sharded import ShardedDataParallel, track_memory

    device = torch.device("cuda", torch.cuda.current_device() if dist.get_backend() == "nccl" else 0)
    torch.cuda.set_device(device)
    torch.manual_seed(dist.get_rank())
    base = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)).to(device)
    out = {}
    theirs = TorchDDP(copy.deepcopy(base), device_ids=[device.index])
    reference = None
    for stage in (0, 1, 2, 3):
        model = theirs if stage == 0 else ShardedDataParallel(copy.deepcopy(base), stage=stage, bucket_cap_mb=0.1)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        tracker = track_memory(model) if stage else contextlib.nullcontext()
        with tracker:
            for step in range(3):
                g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
                x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        if stage == 0:
            reference = model.module.state_dict()
            continue
        # each rank's DTensor rows against the same rows of torch's parameters (no collective: on
        # Gloo with CUDA tensors torch's DTensor all-gather crashes, see full_state_dict)
        out[f"diff{stage}"] = max((_local(v) - _rows_of(reference[k], v)).abs().max().item()
                                  for k, v in model.state_dict().items())
        # the optimizer's DTensor rows and the gathered replica live on the GPU
        out[f"on_gpu{stage}"] = all(p.to_local().device == device for p in model.parameters()) and all(
            b.full.device == device for b in model.buckets)
        out[f"peak{stage}"] = model.memory(opt).peak
        if dist.get_backend() == "gloo":  # torch's DTensor all-gather crashes there: refused first
            try:
                model.full_state_dict()
                out[f"refused{stage}"] = False
            except NotImplementedError as e:
                out[f"refused{stage}"] = "Gloo" in str(e)
        else:
            out[f"mixed{stage}"] = _mixed_precision_against_fully_shard(base, stage, device)
    return out


def _local(v: torch.Tensor) -> torch.Tensor:
    return v.to_local() if hasattr(v, "to_local") else v


def _rows_of(whole: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The block of ``whole`` that DTensor ``v`` holds on this rank (``whole`` itself for a plain tensor)."""
    if not hasattr(v, "to_local"):
        return whole
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _mixed_precision_against_fully_shard(base: nn.Module, stage: int, device) -> dict:
    """bf16 compute, fp32 reductions and master rows: commlab against torch's fully_shard with the
    same MixedPrecisionPolicy (world size 1 on NCCL: the same kernels on both sides)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from commlab.sharded import ShardedDataParallel

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = ShardedDataParallel(copy.deepcopy(base), stage=stage, bucket_cap_mb=0.1, mixed_precision=policy)
    ref = copy.deepcopy(base)
    for layer in ref:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mp_policy=policy)
    fully_shard(ref, mp_policy=policy)
    dtypes = set()
    for model in (ours, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
            opt.zero_grad()
            out = model(x)
            dtypes.add(str(out.dtype))
            nn.functional.mse_loss(out.float(), y).backward()
            opt.step()
    mine = {k: v.full_tensor() for k, v in ours.state_dict().items()}
    theirs = {k: v.full_tensor() for k, v in ref.state_dict().items()}
    scale = max(v.abs().max().item() for v in theirs.values())
    return {"diff": max((mine[k] - theirs[k]).abs().max().item() for k in theirs) / scale, "out_dtypes": sorted(dtypes),
            "master": sorted({str(v.dtype) for v in mine.values()})}


@pytest.mark.gpu
@needs_cuda
def test_sharded_stages_on_cuda_match_torch_ddp_on_nccl_and_on_gloo():
    for backend, world in (("nccl", 1), ("gloo", 2)):
        for out in commlab.launch(_sharded_on_gpu, world_size=world, backend=backend, timeout=180):
            assert all(out[f"diff{s}"] <= 1e-5 for s in (1, 2, 3)), (backend, out)
            assert all(out[f"on_gpu{s}"] for s in (1, 2, 3)), (backend, out)
            assert all(out[f"peak{s}"] and out[f"peak{s}"] > 0 for s in (1, 2, 3)), (backend, out)
            if backend == "gloo":
                assert all(out[f"refused{s}"] for s in (1, 2, 3)), out
            else:  # bf16 compute on both sides, fp32 masters: equal to bf16's resolution
                for s in (1, 2, 3):
                    m = out[f"mixed{s}"]
                    assert m["out_dtypes"] == ["torch.bfloat16"] and m["master"] == ["torch.float32"], (s, m)
                    assert m["diff"] <= 1e-2, (s, m)


def _queued_collective_timing() -> dict:
    import statistics
    import time

    from commlab.costmodel.calibration.measure import _time_collective
    from commlab.runtime.timer import CudaClock, time_collective, time_queued

    device = torch.device("cuda", torch.cuda.current_device())
    clock, out = CudaClock(), {}
    start = clock.stamp()
    clock.hold(0.02)
    out["hold_s"] = clock.seconds(start, clock.stamp())  # the spin rate measured on first use
    buf = torch.ones(1024, device=device)  # 4 KiB: a launch outlasts the all-reduce

    def call():
        C.all_reduce(buf, "sum", algorithm="native")

    # The premise of the hold: NCCL's enqueue does not wait for the device, so the whole batch
    # is queued while the spin runs (the device has not reached the event behind it).
    call()
    torch.cuda.synchronize()
    host = time.perf_counter()
    for _ in range(9):
        call()
    enqueue_s = time.perf_counter() - host
    torch.cuda.synchronize()
    clock.hold(2 * enqueue_s + 0.005)
    for _ in range(9):
        call()
    behind = clock.stamp()
    out["queued_behind_hold"] = not behind.query()
    behind.synchronize()
    # the launch out: queued batches time less than a call alone from a barrier on an idle stream
    alone = statistics.median(time_collective(call, 9, clock=clock))
    queued = statistics.median(time_queued(call, 9, clock=clock, hold=clock.hold))
    out["launch_out"] = 0 < queued < alone
    # calibration's own path on the GPU: a table of positive medians over the samples asked
    medians, samples = _time_collective("native", [4096, 1 << 20], 5, device)
    out["table"] = all(m > 0 for m in medians) and [len(s) for s in samples] == [5, 5]
    out["times"] = {"alone_s": alone, "queued_s": queued, "enqueue_s": enqueue_s, "medians": medians}
    return out


@pytest.mark.gpu
@needs_cuda
def test_calibration_times_nccl_collectives_queued_behind_a_spin_on_world_one():
    (out,) = commlab.launch(_queued_collective_timing, world_size=1, backend="nccl", timeout=180)
    # the spin lasts about the 20 ms asked: its rate is measured, and the clock may move after
    assert 0.005 < out["hold_s"] < 0.2, out
    assert out["queued_behind_hold"] and out["launch_out"] and out["table"], out
