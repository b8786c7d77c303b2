"""Rank-side code of the tensor-parallel tests: commlab's tensor parallelism beside the unpartitioned
model and torch's ``parallelize_module``, many configurations per spawn, returning plain numbers.

Every comparison is ``max |a - b| / max |reference|`` per tensor (the worst over tensors and steps
is returned): losses per step, every gradient per step (a split parameter's gradient against its
block of the reference gradient), and after the last step the full parameters.
"""

from __future__ import annotations

import copy
import fnmatch

import torch
import torch.distributed as dist
from torch.nn import functional as F

from commlab import collectives
from commlab.models import GPT
from commlab.tensor import full_state_dict, gpt_plan, parallelize, vocab_parallel_cross_entropy
from tests.support.helpers import error_of
from tests.support.tensor_models import VARIANTS, SmallLM, batch, commlab_plan, torch_plan

STEPS = 5
# A key's bias adds the same amount to every score of a query, which softmax ignores: its gradient
# is zero in exact arithmetic, and what is computed is rounding noise, in the reference too. It is
# bounded against the step's largest gradient rather than compared with the reference's noise.
ZERO_GRADIENT = "*.k.bias"


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _full_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _scaled(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.detach() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)


def _train(model, loss_fn, steps: int = STEPS, make_batch=batch, report=None):
    """Losses (``report(loss)``: by default its value) and gradients (full values: a DTensor's
    gathered) of ``steps`` SGD steps; a DDP wrapper's parameters under the wrapped module's names."""
    from torch.distributed.tensor import DTensor

    opt, trace = _sgd(model.parameters()), []
    for step in range(steps):
        tokens, target = make_batch(step)
        opt.zero_grad()
        loss = loss_fn(model(tokens), target)
        loss.backward()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                 for n, p in getattr(model, "module", model).named_parameters()}
        trace.append((loss.item() if report is None else report(loss), grads))
        opt.step()
    return trace


def _block_of(model, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a reference tensor: its block where commlab split the parameter."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    dim = getattr(owner, "tp_split", {}).get(leaf)
    return full if dim is None else full.chunk(owner.tp.size, dim)[owner.tp.rank]


def _compare(trace, reference, model=None, final=None, ref_final=None) -> dict:
    worst = {"loss": 0.0, "grad": 0.0, "zero_grad": 0.0, "names_equal": True}
    for (loss, grads), (ref_loss, ref_grads) in zip(trace, reference, strict=True):
        worst["loss"] = max(worst["loss"], abs(loss - ref_loss) / abs(ref_loss))
        worst["names_equal"] &= set(grads) == set(ref_grads)
        largest = max(g.abs().max().item() for g in ref_grads.values())
        for name, grad in grads.items():
            if fnmatch.fnmatchcase(name, ZERO_GRADIENT):  # rounding noise on both sides: bound it instead
                worst["zero_grad"] = max(worst["zero_grad"], grad.abs().max().item() / largest)
                continue
            want = ref_grads[name] if model is None else _block_of(model, name, ref_grads[name])
            err = _scaled(grad, want)
            if err > worst["grad"]:
                worst["grad"], worst["grad_at"] = err, name
    if final is not None:
        worst["names_equal"] &= set(final) == set(ref_final)
        worst["param"] = max(_scaled(final[n], ref_final[n]) for n in ref_final)
    return worst


def _holdings(model, full_state) -> dict:
    """Of the split layers' parameters: the fraction this rank holds, weights alone and all."""
    split = {name: m for name, m in model.named_modules() if hasattr(m, "tp_split")}
    local = {f"{name}.{leaf}": p for name, m in split.items() for leaf, p in m.named_parameters()}
    weights = [n for n in local if n.endswith("weight")]
    return {"layers": sorted(split),
            "weights": sum(local[n].numel() for n in weights) / sum(full_state[n].numel() for n in weights),
            "all": sum(p.numel() for p in local.values()) / sum(full_state[n].numel() for n in local)}


def _commlab(init, variant: str, algorithm: str, reference, ref_final) -> tuple[dict, object]:
    vocab, sp, head = VARIANTS[variant]
    model = SmallLM()
    model.load_state_dict(init)
    parallelize(model, commlab_plan(vocab, head), sequence_parallel=sp, algorithm=algorithm)
    if head == "colwise":
        loss_fn = lambda logits, target: vocab_parallel_cross_entropy(logits, target, algorithm=algorithm)  # noqa: E731
    else:
        loss_fn = _full_loss
    trace = _train(model, loss_fn)
    return _compare(trace, reference, model, full_state_dict(model), ref_final), model


def _torch(init, variant: str, mesh, reference, ref_final) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    vocab, sp, head = VARIANTS[variant]
    model = SmallLM()
    model.load_state_dict(init)
    parallelize_module(model, mesh, torch_plan(vocab, sp, head))

    def loss_fn(logits, target):
        if head != "colwise":
            return _full_loss(logits, target)
        with loss_parallel():  # backward inside the context too, as torch asks: a wrapper
            return _LossParallel(_full_loss(logits, target))

    trace = _train(model, loss_fn)
    final = {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in model.state_dict().items()}
    return _compare(trace, reference, None, final, ref_final)


class _LossParallel:
    """A loss whose backward runs inside ``loss_parallel()``, as torch requires."""

    def __init__(self, loss):
        self.loss = loss

    def backward(self):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            self.loss.backward()

    def full_tensor(self):
        return self.loss.full_tensor()


def _errors() -> dict:
    """Bad input raises ValueError on both ranks before any collective: the group still works after."""
    out = {
        "no_module": error_of(lambda: parallelize(SmallLM(), {"layers.*.attention.q": "colwise"})),
        "bad_kind": error_of(lambda: parallelize(SmallLM(), {"head": "diagonal"})),
        "heads": error_of(lambda: parallelize(SmallLM(d=12, heads=3), {"layers.*.attn.q": "colwise"})),
        "vocab": error_of(lambda: parallelize(SmallLM(vocab=31), {"tok": "vocab"})),
        "algorithm": error_of(lambda: parallelize(SmallLM(), {"head": "colwise"}, algorithm="carrier-pigeon")),
    }
    odd = parallelize(SmallLM(), commlab_plan(True, "colwise"), sequence_parallel=True)
    out["odd_sequence"] = error_of(lambda: odd(torch.zeros(2, 7, dtype=torch.long)))
    probe = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(probe)
    out["group_after"] = probe.tolist()
    return out


def _gpt(algorithm: str = "native") -> dict:
    """commlab's GPT under its ready plan (vocab-parallel, sequence parallel) against itself unsplit."""
    torch.manual_seed(1)
    ref = GPT(vocab=32, d_model=16, layers=2, heads=4, seq=8)
    model = copy.deepcopy(ref)
    reference = _train(ref, _full_loss, steps=2)
    parallelize(model, gpt_plan(vocab_parallel=True), sequence_parallel=True, algorithm=algorithm)
    trace = _train(model, lambda lg, t: vocab_parallel_cross_entropy(lg, t, algorithm=algorithm), steps=2)
    return _compare(trace, reference, model, full_state_dict(model), ref.state_dict())


def _groups(tp: int, dp: int):
    """This rank's tensor- and data-parallel groups of ``arange(dp * tp).view(dp, tp)``: tp innermost,
    as torch's ``init_device_mesh`` orders them. Every rank creates every group, in one order."""
    rank, tp_group, dp_group = dist.get_rank(), None, None
    for replica in range(dp):
        ranks = list(range(replica * tp, (replica + 1) * tp))
        group = dist.new_group(ranks)
        tp_group = group if rank in ranks else tp_group
    for position in range(tp):
        ranks = list(range(position, dp * tp, tp))
        group = dist.new_group(ranks)
        dp_group = group if rank in ranks else dp_group
    return tp_group, dp_group, rank // tp


def run_tp2_dp2() -> dict:
    """TP 2 x commlab DDP 2 (DDP over the data-parallel group) against the unpartitioned model
    trained on both replicas' batches at once."""
    from commlab import DistributedDataParallel

    tp_group, dp_group, replica = _groups(2, 2)
    torch.manual_seed(0)
    ref = SmallLM()
    init = copy.deepcopy(ref.state_dict())
    both = lambda step: tuple(torch.cat(pair) for pair in zip(batch(step, 0), batch(step, 1)))  # noqa: E731
    reference = _train(ref, _full_loss, make_batch=both)
    ref_final = ref.state_dict()

    def replica_mean(loss):  # the reference's loss is the mean of the replicas' (equal batch sizes)
        value = loss.detach().clone()
        dist.all_reduce(value, group=dp_group)
        return value.item() / 2

    out = {}
    for variant, algorithm in (("plain", "native"), ("sp_vocab", "ring")):
        vocab, sp, head = VARIANTS[variant]
        model = SmallLM()
        model.load_state_dict(init)
        parallelize(model, commlab_plan(vocab, head), group=tp_group, sequence_parallel=sp, algorithm=algorithm)
        ddp = DistributedDataParallel(model, process_group=dp_group)
        if head == "colwise":
            loss_fn = lambda lg, t: vocab_parallel_cross_entropy(lg, t, group=tp_group, algorithm=algorithm)  # noqa: E731
        else:
            loss_fn = _full_loss
        trace = _train(ddp, loss_fn, make_batch=lambda step: batch(step, replica), report=replica_mean)
        out[variant] = _compare(trace, reference, model, full_state_dict(model), ref_final)
    return out


def run_world2() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    ref = SmallLM()
    init = copy.deepcopy(ref.state_dict())
    reference = _train(ref, _full_loss)
    ref_final = ref.state_dict()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {"commlab": {}, "torch": {}, "algorithms": {}, "holdings": {}}
    for variant in VARIANTS:
        out["commlab"][variant], model = _commlab(init, variant, "native", reference, ref_final)
        out["holdings"][variant] = _holdings(model, ref_final)
        out["torch"][variant] = _torch(init, variant, mesh, reference, ref_final)
    for algorithm in collectives.algorithm_names():
        out["algorithms"][algorithm] = {v: _commlab(init, v, algorithm, reference, ref_final)[0]
                                        for v in ("plain", "sp_vocab", "sp_gather_head")}
    out["gpt"] = _gpt()
    out["errors"] = _errors()
    return out
