"""Rank-side code of the sharded tests: commlab's ShardedDataParallel beside torch's DDP and
torch's fully_shard, many configurations per spawn, returning plain data for the parent to assert.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.optim.optimizer import _global_optimizer_pre_hooks

from tests.support.helpers import error_of
from commlab.models import TinyTransformer
from commlab.sharded import ShardedDataParallel
from commlab.sharded.memory_model import zero_memory
from tests.support.sharded_models import MODELS, Net, WithUnused

STEPS = 5


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}
SPLIT_MB = 200 / (1024 * 1024)  # 200-byte cap: the 134 parameters (536 B) fall into 3 buckets


def _data(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + micro)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _edit(model, scale: float | None = None) -> None:
    """Weights written outside the optimizer, in place: a scaled init after wrapping, or a clamp
    after each step (WGAN's weight clipping); through the DTensor shards on a sharded model."""
    with torch.no_grad():
        for p in model.parameters():
            if scale is not None:
                p.mul_(scale)
            else:
                p.clamp_(-0.2, 0.2)


def _train(model, opt, steps: int, micro: int, no_sync=None, after_last_step=None, edit: bool = False) -> None:
    if edit:
        _edit(model, 0.5)
    for step in range(steps):
        for m in range(micro):
            x, y = _data(step, m)
            if m < micro - 1 and no_sync is not None:
                with no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
            else:
                nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if edit:
            _edit(model)
        if after_last_step is not None and step == steps - 1:
            after_last_step()  # the end of a step: gradients and state still held
        opt.zero_grad()


def _diff(ours: dict, theirs: dict) -> dict:
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    # Element-wise relative difference, and the difference relative to the tensor's largest value.
    rel = max(((ours[k] - theirs[k]).abs() / theirs[k].abs().clamp_min(1e-12)).max().item() for k in ours)
    scaled = max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-30)).item() for k in ours)
    return {"rel": rel, "scaled": scaled, "exact": all(torch.equal(ours[k], theirs[k]) for k in ours)}


def against_ddp(
    stage: int, opt: str = "adam", micro: int = 1, frozen: bool = False, units: bool = False, model: str = "net",
    edit: bool = False, **kw
) -> dict:
    torch.manual_seed(dist.get_rank())  # ranks start different: construction must broadcast
    base = MODELS[model](frozen)
    theirs = TorchDDP(copy.deepcopy(base), broadcast_buffers=False)
    if units:
        kw["units"] = [base.a, base.b, base.head]
    ours = ShardedDataParallel(base, stage=stage, **kw)
    opt_o, opt_t = OPTIMIZERS[opt](ours.parameters()), OPTIMIZERS[opt](theirs.parameters())
    memory = {}
    def at_end_of_step():
        memory.update(_memory(ours, opt_o))
        memory["gathers_in_flight"] = len(ours._engine.gathers)  # launched by the step's post-hook

    _train(ours, opt_o, STEPS, micro, ours.no_sync if micro > 1 else None, at_end_of_step, edit)
    _train(theirs, opt_t, STEPS, micro, theirs.no_sync if micro > 1 else None, edit=edit)
    result = _diff(ours.full_state_dict(), theirs.module.state_dict())
    result["buckets"] = ours.bucket_names
    result["memory"] = memory
    result["memory_after_zero_grad"] = _memory(ours, opt_o)["measured"]
    timings = ours.iteration_timings
    result["timings"] = (len(timings), [sorted({c.kind for c in t.collectives}) for t in timings[-1:]],
                         [len(t.collectives) for t in timings[-1:]])
    result["finite_times"] = all(c.ready <= c.launched <= c.done for t in timings for c in t.collectives)
    result["gathers_before_forward"] = sum(c.kind == "all_gather" and c.launched < 0 for c in timings[-1].collectives)
    result["optimizer_state"] = _optimizer_state(ours, opt_o, opt_t, opt, MODELS[model](frozen))
    # Stage 3 shards a frozen parameter too (a DTensor, as fully_shard's): compare it whole.
    if frozen:
        mine = base.b.bias.full_tensor() if isinstance(base.b.bias, DTensor) else base.b.bias
    result["frozen_equal"] = torch.equal(mine, theirs.module.b.bias) if frozen else None
    return result


def _optimizer_state(ours, opt_o, opt_t, opt: str, plain: nn.Module) -> dict:
    """The gathered optimizer state against torch DDP's optimizer's, and loaded into a plain one."""
    full, ref = ours.full_optimizer_state_dict(opt_o), opt_t.state_dict()

    def flat(sd):
        return {f"{i}.{k}": v for i, entry in sd["state"].items() for k, v in entry.items()}

    plain_opt = OPTIMIZERS[opt](plain.parameters())
    plain_opt.load_state_dict(full)
    return {
        **_diff(flat(full), flat(ref)),
        "groups_equal": full["param_groups"] == ref["param_groups"],
        "loaded_equal": all(torch.equal(a, b) for a, b in zip(flat(plain_opt.state_dict()).values(), flat(full).values())),
    }


def _memory(ours: ShardedDataParallel, opt) -> dict:
    """Measured bytes at the end of a step against the ZeRO model (fp32 Adam: K = 8)."""
    m = ours.memory(opt)
    psi = sum(layout.total for layout in ours.layouts)
    world = dist.get_world_size()
    model = zero_memory(psi, world, ours.stage, "fp32")
    return {
        "measured": (m.parameters, m.gradients, m.optimizer),
        "model": (model.parameters, model.gradients, model.optimizer),
        "padding": sum(layout.padding for layout in ours.layouts),
        "total": psi,
        "valid": sum(layout.valid(dist.get_rank()) for layout in ours.layouts),
        "params": sum(len(layout.shapes) for layout in ours.layouts),
        "buckets": len(ours.layouts),
        "peak_gathered": m.peak_gathered,
        "gathered_now": m.gathered,
        "full_bytes": [layout.padded * 4 for layout in ours.layouts],
    }


def against_fully_shard() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # fully_shard does not broadcast: every rank builds the same values
    base = Net()
    theirs = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (theirs.a, theirs.b, theirs.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    ours = ShardedDataParallel(base, stage=3, units=[base.a, base.b, base.head])
    opt_o, opt_t = OPTIMIZERS["adam"](ours.parameters()), OPTIMIZERS["adam"](theirs.parameters())
    _train(ours, opt_o, STEPS, 1)
    _train(theirs, opt_t, STEPS, 1)
    full = {k: v.full_tensor().detach() for k, v in theirs.state_dict().items()}
    return _diff(ours.full_state_dict(), full)


def transformer(stage: int, **kw) -> bool:
    """A small transformer (embedding, attention, layer norms, a root-held position table) after
    three Adam steps: the same parameters as torch's DDP?"""
    torch.manual_seed(dist.get_rank())
    base = TinyTransformer(vocab=32, d_model=8, layers=2, heads=2, seq=6)
    theirs = TorchDDP(copy.deepcopy(base))
    if kw.pop("units", False):
        kw["units"] = [base.embed, *base.encoder.layers, base.head]
    ours = ShardedDataParallel(base, stage=stage, **kw)
    opt_o, opt_t = OPTIMIZERS["adam"](ours.parameters()), OPTIMIZERS["adam"](theirs.parameters())
    for step in range(3):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        x = torch.randint(0, 32, (3, 6), generator=g)
        for model, opt in ((ours, opt_o), (theirs, opt_t)):
            nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
    return _diff(ours.full_state_dict(), theirs.module.state_dict())["exact"]


def state_dicts(stage: int) -> dict:
    torch.manual_seed(dist.get_rank())
    base = Net()
    ours = ShardedDataParallel(base, stage=stage, bucket_cap_mb=SPLIT_MB)
    opt = OPTIMIZERS["adam"](ours.parameters())
    _train(ours, opt, 2, 1)
    sd = ours.full_state_dict()
    plain = Net()
    plain.load_state_dict(sd)  # loads into the unsharded model
    x, _ = _data(99)
    same_output = torch.equal(plain(x), ours(x))
    # Round trip: a fresh wrapper of other values takes the dict and gives it back.
    torch.manual_seed(50 + dist.get_rank())
    other = ShardedDataParallel(Net(), stage=stage, bucket_cap_mb=SPLIT_MB)
    other.load_state_dict(sd)
    again = other.full_state_dict()
    bad = dict(sd)
    bad["extra"] = bad.pop("a.bias")
    return {
        "keys": sorted(sd) == sorted(Net().state_dict()),
        "same_output": same_output,
        "round_trip": all(torch.equal(again[k], sd[k]) for k in sd),
        "same_output_after_load": torch.equal(other(x), plain(x)),
        "bad_keys": error_of(lambda: other.load_state_dict(bad)),
        "bad_shape": error_of(lambda: other.load_state_dict({**sd, "a.bias": torch.zeros(2)})),
    }


def misuse() -> dict:
    base = Net()
    originals = [p for p in base.parameters()]
    ours = ShardedDataParallel(base, stage=2)
    wrong = torch.optim.SGD(originals, lr=0.1)
    x, y = _data(0)
    nn.functional.mse_loss(ours(x), y).backward()
    factored = torch.optim.Adafactor(ours.parameters()) if hasattr(torch.optim, "Adafactor") else None
    return {
        "unsharded": error_of(wrong.step),
        "adafactor": error_of(factored.step) if factored is not None else "ValueError: not element-wise (absent)",
        "unrelated": error_of(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1).step),
        # Every rank leaves the same parameter unused: it gets no gradient, the rest trains.
        "unused": error_of(lambda: nn.functional.mse_loss(ShardedDataParallel(WithUnused(), stage=3)(x), y).backward()),
        # A unit run on its own at stage 3 prefetches the next unit's bucket, which no module then
        # waits for: the end of backward waits for it before freeing; the other units get no gradient.
        "unit_alone": error_of(lambda: _unit_alone(x)),
        "gathered_after_no_grad_forward": _no_grad_forward_gathered(),
        # One parameter per bucket: attention's out_proj weight is read by its parent's forward.
        "outside_its_module": error_of(lambda: transformer(3, bucket_cap_mb=1e-6)),
        "collected": _collected(),
        "module_called_directly": _module_called_directly(),
    }


def _collected() -> tuple[bool, int]:
    """A dropped wrapper is collected, and its optimizer step pre-hook goes with it."""
    before = len(_global_optimizer_pre_hooks)
    ours = ShardedDataParallel(Net(), stage=3)
    during = len(_global_optimizer_pre_hooks)
    ref = weakref.ref(ours)
    del ours
    gc.collect()
    return ref() is None, during - before, len(_global_optimizer_pre_hooks) - before


def _unit_alone(x) -> None:
    net = Net()
    ShardedDataParallel(net, stage=3, units=[net.a, net.b, net.head], prefetch=1)
    net.a(x).sum().backward()


def _module_called_directly() -> bool:
    """Stage 2 after a step: calling the wrapped module itself still gathers the new values first."""
    net = Net()
    ours = ShardedDataParallel(net, stage=2)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    x, y = _data(0)
    first = ours(x)
    nn.functional.mse_loss(first, y).backward()
    opt.step()
    direct = net(x)
    return torch.equal(direct, ours(x)) and not torch.equal(direct, first)


def _no_grad_forward_gathered() -> int:
    ours = ShardedDataParallel(Net(), stage=3, reshard_after_forward=False)
    with torch.no_grad():
        ours(_data(0)[0])
    return ours.memory().gathered


def requires_grad_changed() -> dict:
    """Freezing a trained parameter, or unfreezing a frozen one, after wrapping: the buckets and
    shards were fixed at construction, so the next forward says so on every rank (before, the
    frozen one went on training and the unfrozen one stayed as it was, silently)."""
    out = {}
    for stage in (1, 2, 3):
        for name, frozen in (("a.weight", False), ("b.bias", True)):
            ours = ShardedDataParallel(Net(frozen=frozen), stage=stage, bucket_cap_mb=SPLIT_MB)
            opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
            _train(ours, opt, 1, 1)
            param = dict(ours.named_parameters())[name]
            param.requires_grad_(frozen)
            x, y = _data(1)
            out[f"s{stage}-{name}"] = error_of(lambda: nn.functional.mse_loss(ours(x), y).backward())
    return out


def run_world2() -> dict:
    warnings.simplefilter("ignore", FutureWarning)
    cases = {}
    for stage in (1, 2, 3):
        for opt in OPTIMIZERS:
            cases[f"s{stage}-{opt}"] = against_ddp(stage, opt)
        cases[f"s{stage}-split"] = against_ddp(stage, bucket_cap_mb=SPLIT_MB)
        cases[f"s{stage}-units"] = against_ddp(stage, units=True)
        cases[f"s{stage}-no_sync"] = against_ddp(stage, "sgd", micro=3, bucket_cap_mb=SPLIT_MB)
        cases[f"s{stage}-frozen"] = against_ddp(stage, frozen=True, bucket_cap_mb=SPLIT_MB)
        cases[f"s{stage}-tied"] = against_ddp(stage, model="tied", bucket_cap_mb=SPLIT_MB)
        cases[f"s{stage}-bn"] = against_ddp(stage, model="bn", bucket_cap_mb=SPLIT_MB)
        cases[f"s{stage}-edited"] = against_ddp(stage, edit=True, bucket_cap_mb=SPLIT_MB)
    for prefetch in (0, 1, 2):
        for reshard in (True, False):
            cases[f"s3-p{prefetch}-r{int(reshard)}"] = against_ddp(
                3, "adamw", bucket_cap_mb=SPLIT_MB, prefetch=prefetch, reshard_after_forward=reshard
            )
            # With units, where the peak of gathered bytes shows the prefetch window.
            cases[f"s3-units-p{prefetch}-r{int(reshard)}"] = against_ddp(
                3, "adam", units=True, prefetch=prefetch, reshard_after_forward=reshard
            )
    return {
        "cases": cases,
        "fully_shard": against_fully_shard(),
        "transformer": {
            "s3-units": transformer(3, units=True),
            "s3-one-bucket": transformer(3),
            "s3-split": transformer(3, bucket_cap_mb=0.0005),
            "s2-split": transformer(2, bucket_cap_mb=0.0005),
        },
        "state": {stage: state_dicts(stage) for stage in (1, 2, 3)},
        "requires_grad_changed": requires_grad_changed(),
        "optimizer": misuse(),  # last: it leaves a failed backward behind
    }


def run_world3() -> dict:
    warnings.simplefilter("ignore", FutureWarning)
    cases = {}
    for stage in (1, 2, 3):
        cases[f"s{stage}-split"] = against_ddp(stage, bucket_cap_mb=SPLIT_MB)
        cases[f"s{stage}-units"] = against_ddp(stage, units=True, prefetch=2)
        cases[f"s{stage}-no_sync"] = against_ddp(stage, "adamw", micro=2)
    return {"cases": cases, "fully_shard": against_fully_shard(), "state": {3: state_dicts(3)},
            "requires_grad_changed": requires_grad_changed()}


def run_ring() -> dict:
    """Stages 1-3 on commlab's ring reduce-scatter, all-gather and all-reduce (algorithm="ring")."""
    warnings.simplefilter("ignore", FutureWarning)
    # Refused on 3 ranks before any collective: the ring cases after it still pair up.
    refused = error_of(lambda: ShardedDataParallel(Net(), stage=2, algorithm="halving_doubling"))
    cases = {}
    for stage in (1, 2, 3):
        cases[f"s{stage}-split"] = against_ddp(stage, bucket_cap_mb=SPLIT_MB, algorithm="ring")
        cases[f"s{stage}-units"] = against_ddp(stage, "sgd", units=True, prefetch=2, algorithm="ring")
    cases["s2-no_sync"] = against_ddp(2, "adamw", micro=2, algorithm="ring")
    cases["s3-no-reshard"] = against_ddp(3, "adamw", bucket_cap_mb=SPLIT_MB, reshard_after_forward=False,
                                         algorithm="ring")
    return {"cases": cases, "halving_doubling": refused}
