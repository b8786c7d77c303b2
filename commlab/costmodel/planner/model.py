"""The planner's profile of any model: cut by name at every candidate split point, each piece a layer.

``pipeline plan --model gpt`` (or any ``package.module:factory`` that :func:`commlab.models.build_workload`
builds) traces the model with the pipeline's own splitter
(:func:`commlab.pipeline.runtime.traced.trace_stages`) before every candidate split point, at each
micro-batch size (the traced stages are static-shape, as torch's are). The pieces are then the
planner's layers: :func:`commlab.costmodel.planner.layers.profile` times them and counts what each saves for
backward, and a plan's balance (pieces per stage) names its split points (:func:`split_points`).
The candidates are every block of the model's longest ``nn.ModuleList``/``nn.Sequential`` (a
transformer's ``layers.0 ... layers.N-1``) unless named. Every cut must carry one tensor: the
profile runs pieces one tensor to the next, as it does the MLP's layers. On the ranks of the
calibration launch, :func:`rank_stage_times` builds the model (or the MLP) again and times its
candidate stages there, every rank at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from commlab.costmodel.planner.plan import LayerProfile
from commlab.costmodel.planner.layers import loss_saved_bytes, profile
from commlab.pipeline.runtime.traced import check_split_points, trace_stages
from commlab.runtime.threads import rank_threads


def candidate_points(model: nn.Module, sample: torch.Tensor | None = None) -> list[str]:
    """Every block of the model's longest ModuleList / Sequential, by name (``layers.0``, ...),
    but the first when forward calls it before anything else (given ``sample``, one micro-batch):
    a cut there would leave the first stage empty."""
    lists = [(name, m) for name, m in model.named_modules() if name and isinstance(m, (nn.ModuleList, nn.Sequential))]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks to cut between: "
                         "name the split points (--split-at)")  # fmt: skip
    name, blocks = max(lists, key=lambda nm: len(nm[1]))
    points = [f"{name}.{k}" for k in range(len(blocks))]
    # The first module forward calls that is not a container of the blocks (the encoder around them).
    first = next((n for n in _called(model, sample) if not points[0].startswith(n + ".")), None) if sample is not None else None
    if first is not None and (first == points[0] or first.startswith(points[0] + ".")):
        points = points[1:]
    return points


def _called(model: nn.Module, sample: torch.Tensor) -> list[str]:
    """The names of the submodules ``model``'s forward calls on ``sample``, in the order called (a forward pre-hook on each)."""
    called: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda _m, _a, n=n: called.append(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(sample)
    finally:
        for h in hooks:
            h.remove()
    return called


class _Piece(nn.Module):
    """One traced piece as a layer of one tensor in, one tensor out."""

    def __init__(self, part: nn.Module, index: int):
        super().__init__()
        self.part, self.index = part, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.part((x,))
        if isinstance(out, tuple):
            if len(out) != 1:
                raise ValueError(f"the cut after piece {self.index} carries {len(out)} tensors; the planner profiles "
                                 "cuts that carry one (choose other --split-at points)")  # fmt: skip
            out = out[0]
        return out


def pieces_at_size(workload, points: Sequence[str], size: int, name: str = "the model"):
    """The workload's model traced at micro-batches of ``size`` and cut before each of ``points``:
    its pieces as an nn.Sequential of one tensor in and out, one micro-batch, and its loss on it."""
    sample, target = workload.make_batch(size, torch.Generator().manual_seed(0))
    traced = trace_stages(workload.model, points, (sample,))
    if len(traced.carried[0]) != 1:
        raise ValueError(f"model {name!r} takes {len(traced.carried[0])} input tensors; the planner profiles one")
    pieces = nn.Sequential(*(_Piece(p, k) for k, p in enumerate(traced.parts)))
    return pieces, sample, (lambda y, t=target: workload.loss_fn(y, t))


def profile_model(name: str, batch: int, microbatches: Sequence[int], ranks: int,
                  points: Sequence[str] | None = None, plans: Mapping | None = None,
                  **sizes) -> tuple[dict[int, LayerProfile], list[str]]:  # fmt: skip
    """The model ``name`` profiled piece by piece at the micro-batch size of each count, and the
    split points the pieces start at (the first piece starts at the model's input); ``plans``:
    also time every stage of them whole, with the workload's loss (as :func:`commlab.costmodel.planner.layers.profile_mlp`)."""
    from commlab.models import build_workload

    torch.manual_seed(0)
    workload = build_workload(name, **sizes)
    model = workload.model
    first, _ = workload.make_batch(1, torch.Generator().manual_seed(0))
    points = check_split_points(model, list(points)) if points else candidate_points(model, first)
    with rank_threads(ranks):  # a rank's threads, as :func:`commlab.costmodel.planner.layers.profile_mlp` does
        out, pieces_at, samples, losses = {}, {}, {}, {}
        for m in microbatches:
            pieces, sample, losses[m] = pieces_at_size(workload, points, max(1, batch // m), name)
            out[m] = replace(profile(pieces, sample), kept_nodes=weight_node_bytes(pieces, sample),
                             loss_saved=loss_saved_bytes(pieces, sample, losses[m]))  # fmt: skip
            pieces_at[m], samples[m] = pieces, sample
        if plans is not None:
            from commlab.costmodel.planner.stages import add_stage_times

            timed = {m: add_stage_times({m: out[m]}, list(pieces_at[m]), samples, losses, plans.get("ranks", ranks), plans["virtuals"],
                                        plans["schedules"], plans.get("balance_mode", "time"), whole=True)[m] for m in out}  # fmt: skip
            out = timed
        return out, points


def weight_node_bytes(pieces: nn.Sequential, sample: torch.Tensor) -> list[float]:
    """Per piece, the bytes a split backward's I keeps at its weight nodes for W: a traced stage is
    one autograd graph, split at each node with parameters below it (the gradients arriving at a
    Linear's addmm, a LayerNorm, ...: commlab/pipeline/runtime/weight_split.py), not only at its
    output. Measured by running that split on each piece; 0 where it does not apply (an input
    without gradient, no parameters, tied weights: W then runs the whole graph)."""
    from commlab.pipeline.runtime.weight_split import split_input_grad

    out, x = [], sample
    for k, piece in enumerate(pieces):
        # The first stage's input is the model's: no gradient, so its I does nothing and W runs whole.
        x = x.detach().requires_grad_(k > 0 and x.is_floating_point())
        params = [p for p in piece.parameters() if p.requires_grad]
        with torch.enable_grad():
            y = piece(x)
        split = split_input_grad([y], [torch.ones_like(y)], [x], params) if x.requires_grad and y.requires_grad and params else None
        kept = split[1] if split is not None and split[1] is not None else []
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for _, grads, _ in kept for g in grads if isinstance(g, torch.Tensor)}  # fmt: skip
        out.append(float(sum(storages.values())))
        x = y.detach()
    return out


def split_points(points: Sequence[str], balance: Sequence[int]) -> list[str]:
    """The names a plan cuts at: piece k starts at ``points[k - 1]``, so a balance of pieces per
    stage cuts before the first piece of every stage but the first."""
    starts = [sum(balance[:s]) for s in range(1, len(balance))]
    return [points[k - 1] for k in starts]


def layers_at_size(model: Mapping, batch: int, m: int) -> tuple[list, object, Callable]:
    """On a rank: the planned model's layers (``model`` as :func:`commlab.validation.planner.measure_rank`
    describes it: the MLP's ``depth`` and ``width``, or ``model``, ``sizes`` and the ``points``
    its pieces start at), one micro-batch at ``m`` micro-batches of ``batch``, and its loss."""
    import torch
    import torch.nn.functional as F

    size = max(1, batch // m)
    torch.manual_seed(0)
    if model.get("model") is None:
        from commlab.models import mlp

        net = mlp(model["depth"], model["width"])
        sample, target = torch.randn(size, model["width"]), torch.randint(0, 10, (size,))  # the bench's loss
        return list(net), sample, (lambda y: F.cross_entropy(y, target))
    from commlab.models import build_workload

    pieces, sample, loss = pieces_at_size(build_workload(model["model"], **model.get("sizes", {})), model["points"], size)
    return list(pieces), sample, loss


def rank_stage_times(spec: Mapping) -> dict[int, dict[tuple[int, int], dict[str, float]]]:
    """On every rank of the calibration launch: every stage of ``spec["ranges"]`` (per micro-batch
    count) timed whole (:func:`~commlab.costmodel.planner.stages.profile_stages`), every rank timing the same stages at once, so
    each computes while the others do, as the ranks of a pipeline do (alone, a 16 x 512 Linear
    stage's backward came out up to 1.17x faster than inside one)."""
    import torch.distributed as dist

    from commlab.costmodel.planner.stages import profile_stages

    out = {}
    for m, ranges in spec["ranges"].items():
        layers, sample, loss = layers_at_size(spec["model"], spec["batch"], m)
        dist.barrier()
        timed = profile_stages(layers, sample, [tuple(r) for r in ranges], loss, split=spec["split"],
                               whole=spec["model"].get("model") is not None)  # a traced model's stages are whole graphs
        out[m] = {r: t.__dict__ for r, t in timed.items()}
    return out


def stage_builder(common: dict[str, Any]):
    """The model ``common`` names, its mini-batch and loss, and a function that builds a plan's
    stages on this rank: the MLP (``depth``, ``width``) cut by balance, a fresh copy per plan, or a
    ``model`` (with ``sizes`` and its split ``points``) cut by name at the plan's split points and
    traced at its micro-batch size, as ``Stage(model, split_points=...)`` runs it for a user."""
    import torch
    import torch.nn.functional as F

    from commlab.pipeline.runtime.stages import RankStages

    gen = torch.Generator().manual_seed(1)
    if common.get("model") is None:
        from commlab.models import mlp

        x = torch.randn(common["batch"], common["width"], generator=gen)
        y = torch.randint(0, 10, (common["batch"],), generator=gen)

        def build(p, placement):
            torch.manual_seed(0)
            model = mlp(common["depth"], common["width"])
            return model, RankStages(model, p["balance"], placement)

        return x, y, F.cross_entropy, build
    from commlab.models import build_workload

    torch.manual_seed(0)
    workload = build_workload(common["model"], **common.get("sizes", {}))
    x, y = workload.make_batch(common["batch"], gen)

    def build_traced(p, placement):
        example = x[: common["batch"] // p["microbatches"]]
        cut = split_points(common["points"], p["balance"])
        return workload.model, RankStages(workload.model, split_points=cut, example_args=(example,), placement=placement)

    return x, y, workload.loss_fn, build_traced
