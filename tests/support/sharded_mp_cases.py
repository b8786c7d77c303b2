"""Rank-side code of the mixed-precision test: an MLP and a GPT trained 5 steps of SGD with
momentum under bf16 parameters and fp32 reductions, by commlab's ShardedDataParallel at stages
1-3 and by torch's ``fully_shard`` with the same ``MixedPrecisionPolicy``; plain data goes back
to the parent, which asserts.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from commlab.models import GPT, lm_loss
from commlab.sharded import MixedPrecision, ShardedDataParallel

STEPS = 5
PEAK_STEPS = 3  # steps whose peaks are compared, after one tracked step that over-counts
BF16, FP32 = torch.bfloat16, torch.float32


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # fully_shard does not broadcast: every rank builds the same values
    # 33 rows: uneven over two ranks, so padding is in the buffers.
    return nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 16), nn.Tanh(), nn.Linear(16, 1))


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, layers=2, heads=4, seq=16)
    model.head.weight = model.tok.weight  # tied: one master, cast once per gather
    return model


def _units(model: nn.Module) -> list[nn.Module]:
    return list(model.layers) if isinstance(model, GPT) else [model[0], model[2]]


def _batch(model: nn.Module, step: int):
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    if isinstance(model, GPT):
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        return tokens[:, :-1], lambda out: lm_loss(out.float(), tokens[:, 1:])
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)  # fp32: the wrapper casts x
    return x, lambda out: nn.functional.mse_loss(out.float(), y)


def _train(model: nn.Module, base: nn.Module) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, out_dtypes = [], set()
    for step in range(STEPS):
        x, loss_of = _batch(base, step)
        opt.zero_grad()
        out = model(x)
        out_dtypes.add(str(out.dtype))
        loss = loss_of(out)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = dict(model.named_parameters())
    return {
        "losses": losses,
        "out_dtypes": out_dtypes,
        "local": {n: p.to_local().detach().clone() for n, p in params.items()},
        "optimizer_dtypes": {str(p.dtype) for g in opt.param_groups for p in g["params"]},
        "grad_dtypes": {str(p.grad.dtype) for p in params.values()},
        "momentum_dtypes": {str(s["momentum_buffer"].dtype) for s in opt.state.values()},
    }


def _fully_shard(make, reduce_dtype: torch.dtype, param_dtype: torch.dtype | None = BF16) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in _units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _wire_bytes(ours: ShardedDataParallel) -> dict[str, list[float]]:
    """Bytes per element of each collective of the last iteration, by kind (its buffer's
    padded elements): the dtype on the wire."""
    padded = [layout.padded for layout in ours.layouts]
    out: dict[str, set[float]] = {}
    for e in ours.iteration_timings[-1].collectives:
        out.setdefault(e.kind, set()).add(e.nbytes / padded[e.bucket])
    return {k: sorted(v) for k, v in out.items()}


def _rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's rows of ``full`` as fully_shard holds them (torch.chunk's; none past the last chunk)."""
    chunks = torch.chunk(full, world)
    return chunks[rank] if rank < len(chunks) else full[:0]


def _load(ours: ShardedDataParallel, full: dict, make) -> dict:
    """Load changed fp32 values: this rank's master rows are theirs, and the next forward computes
    on their bf16 casts, as the unwrapped model cast to bf16 does."""
    changed = {k: v + 0.01 for k, v in full.items()}
    ours.load_state_dict(changed)
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = make()
    plain.load_state_dict(changed)
    plain.to(BF16)
    x, _ = _batch(plain, STEPS)
    with torch.no_grad():
        same_output = torch.equal(ours(x), plain(x.to(BF16) if x.is_floating_point() else x))
    rows = all(torch.equal(p.to_local(), _rows(changed[n], rank, world)) for n, p in ours.named_parameters())
    return {"rows": rows, "output": same_output}


def _compare(make, policy, algorithm: str) -> dict:
    theirs = _train(_fully_shard(make, FP32), make())
    bf16_reduce = _train(_fully_shard(make, BF16), make())
    out = {
        "fully_shard": {k: theirs[k] for k in ("losses", "optimizer_dtypes", "grad_dtypes", "out_dtypes")},
        "reduce_dtype_shows": any(not torch.equal(theirs["local"][n], t) for n, t in bf16_reduce["local"].items()),
        "stages": {},
    }
    for stage in (1, 2, 3):
        base = make()
        kw = {"units": _units(base)} if stage == 3 else {"bucket_cap_mb": 0.002}
        ours = ShardedDataParallel(base, stage=stage, mixed_precision=policy, algorithm=algorithm, **kw)
        mine = _train(ours, base)
        full = ours.full_state_dict()
        rank, world = dist.get_rank(), dist.get_world_size()
        out["stages"][stage] = {
            **{k: mine[k] for k in ("losses", "optimizer_dtypes", "grad_dtypes", "momentum_dtypes", "out_dtypes")},
            "exact": {n: torch.equal(mine["local"][n], t) for n, t in theirs["local"].items()},
            "largest_difference": max((mine["local"][n] - t).abs().max().item() for n, t in theirs["local"].items()
                                      if t.numel()),
            "compute_dtypes": {str(b.full.dtype) for b in ours.buckets},
            "wire_bytes": _wire_bytes(ours),
            # The state dict gives the fp32 masters (not the bf16 compute copies), torch.chunk rows each.
            "state_dict_is_master": all(
                v.dtype == FP32 and torch.equal(_rows(v, rank, world), mine["local"][n])
                for n, v in full.items() if n in mine["local"]
            ),
            "dtensors": all(isinstance(p, DTensor) for p in ours.parameters()),
            "load": _load(ours, full, make),
        }
    return out


def _reduction_only() -> dict:
    """An fp32 model with bf16 reductions only (``param_dtype`` None), each stage against
    fully_shard with the same policy: are this rank's rows equal, and do stages 1-2 keep the
    shards as views of the replica (no master of their own)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(reduce_dtype=BF16)
    theirs = _train(_fully_shard(_mlp, BF16, param_dtype=None), _mlp())
    out = {}
    for stage in (1, 2, 3):
        base = _mlp()
        ours = ShardedDataParallel(base, stage=stage, mixed_precision=policy, bucket_cap_mb=0.002)
        mine = _train(ours, base)
        out[stage] = {"exact": all(torch.equal(mine["local"][n], t) for n, t in theirs["local"].items()),
                      "losses": mine["losses"] == theirs["losses"],
                      "own_master": any(b.shard is not None for b in ours.buckets)}
    return out


MICRO = 3  # micro-batches per step in the accumulation case: the first two without a reduction


def _accumulate(model: nn.Module, base: nn.Module, pause) -> dict:
    """3 steps of SGD with momentum, each over MICRO micro-batches; ``pause(flag)`` turns the
    reduction off (True) for all but the last."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        for micro in range(MICRO):
            pause(micro < MICRO - 1)
            x, loss_of = _batch(base, 10 * step + micro)
            loss_of(model(x)).backward()
        opt.step()
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _accumulation() -> dict:
    """Gradient accumulation under bf16 compute and fp32 reductions: fully_shard sums the
    micro-batches' gradients in reduce_dtype (_fsdp_param.py, to_accumulated_grad_if_needed);
    each stage against it, exact equality of this rank's rows."""
    import contextlib

    theirs_model = _fully_shard(_mlp, FP32)
    theirs = _accumulate(theirs_model, _mlp(), lambda off: theirs_model.set_requires_gradient_sync(not off))
    out = {}
    for stage in (1, 2, 3):
        base = _mlp()
        kw = {"units": _units(base)} if stage == 3 else {"bucket_cap_mb": 0.002}
        ours = ShardedDataParallel(base, stage=stage, mixed_precision=MixedPrecision(BF16, FP32), **kw)
        held = contextlib.ExitStack()

        def pause(off: bool) -> None:
            held.close()
            if off:
                held.enter_context(ours.no_sync())

        mine = _accumulate(ours, base, pause)
        out[stage] = max((mine[n] - t).abs().max().item() for n, t in theirs.items() if t.numel())
    return out


def _memory() -> dict:
    """Bytes held after a step of Adam (memory(opt)), each stage, on a model of even rows (no
    padding), against commlab's mixed-precision memory model, fp32 and bf16 reductions."""
    from commlab.sharded.memory_model import mixed_precision_memory

    out = {}
    for reduce in (FP32, BF16):
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 16, bias=False))
            kw = {"units": [model[0], model[2]]} if stage == 3 else {"bucket_cap_mb": 0.0005}
            ours = ShardedDataParallel(model, stage=stage, mixed_precision=MixedPrecision(BF16, reduce), **kw)
            opt = torch.optim.Adam(ours.parameters(), lr=1e-3)
            ours(torch.randn(4, 16)).float().sum().backward()
            opt.step()
            held = ours.memory(opt)
            steps = sum(st["step"].untyped_storage().nbytes() for st in opt.state.values())  # Adam's counters
            model_ = mixed_precision_memory(512, dist.get_world_size(), stage, reduce_bytes=reduce.itemsize)
            out[(str(reduce), stage)] = {
                "measured": (held.parameters, held.gradients, held.optimizer - steps),
                "model": (model_.parameters, model_.gradients, model_.optimizer),
            }
    return out


def _peak() -> dict:
    """Measured peak bytes of steps of Adam (torch's default implementation for these CPU tensors)
    at each stage, fp32 and bf16 reductions, on 16 x Linear(512, 512) (the parameters dominate: a
    batch of 2), one bucket per layer, Gloo's own collectives: their allocations and frees run
    with the issuing thread's profiler state, where a p2p algorithm's worker thread frees unseen
    (commlab/memtrack.py). The rank's sizes go back, for the parent's peak model."""
    from commlab.memtrack import live_bytes
    from commlab.sharded.memory import track_memory

    out = {}
    for reduce in (FP32, BF16):
        for stage in (1, 2, 3):
            gc.collect()
            base = live_bytes()  # what earlier cases left: this one's bytes are counted above it
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(16)])
            ours = ShardedDataParallel(model, stage=stage, units=list(model), algorithm="native", prefetch=1,
                                       mixed_precision=MixedPrecision(BF16, reduce))
            opt = torch.optim.Adam(ours.parameters(), lr=1e-3)
            x = torch.randn(2, 512, generator=torch.Generator().manual_seed(dist.get_rank()))

            def step():
                ours(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

            step()  # Adam's state exists from here on
            peaks = []
            with track_memory(ours):
                for _ in range(PEAK_STEPS + 1):
                    step()
                    peaks.append(ours.memory(opt).peak)  # the previous step's: a step ends at the next forward
            peaks = [p - base for p in (*peaks[2:], ours.memory(opt).peak)]  # the first tracked step over-counts
            out[(str(reduce), stage)] = {"peaks": peaks, "padded": [lay.padded for lay in ours.layouts],
                                         "largest_param": max(p.numel() for p in model.parameters())}
            del ours, opt, model
    return out


def run() -> dict:
    policy_torch = __import__("torch.distributed.fsdp", fromlist=["MixedPrecisionPolicy"]).MixedPrecisionPolicy(
        param_dtype=BF16, reduce_dtype=FP32)
    # The MLP through commlab's own policy on Gloo's collectives, the GPT through torch's object
    # on commlab's ring: both policies are accepted, both kinds of collective cast alike.
    return {"mlp": _compare(_mlp, MixedPrecision(param_dtype=BF16, reduce_dtype=FP32), "native"),
            "gpt": _compare(_gpt, policy_torch, "ring"), "memory": _memory(),
            "reduction_only": _reduction_only(), "accumulation": _accumulation(), "peak": _peak()}
