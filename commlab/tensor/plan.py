"""A tensor-parallel plan: module-name patterns to kinds, checked against a model before any collective.

A plan maps fnmatch patterns of ``named_modules()`` names (``"layers.*.attn.[qkv]"``) to a kind
of the registry below. Every check that can fail is here and pure, so a wrong plan is a
ValueError on every rank before the first message: a pattern that names no module, an unknown
kind, a kind on the wrong module type, a module given two kinds, and a tensor-parallel size that
does not divide the features, vocabulary rows or attention heads being split.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from commlab.tensor.shards import check_divides, check_tp, head_count


@dataclass(frozen=True)
class Kind:
    """What a plan entry does: the module types it takes, the size it splits, what it means."""

    types: tuple[type, ...]
    splits: str | None  # the attribute of the module whose size is cut into tp blocks
    meaning: str


KINDS: dict[str, Kind] = {
    "colwise": Kind((nn.Linear,), "out_features", "Linear split by output features; output stays split"),
    "colwise_gather": Kind((nn.Linear,), "out_features", "Linear split by output features; output gathered"),
    "rowwise": Kind((nn.Linear,), "in_features", "Linear split by input features; output summed"),
    "vocab": Kind((nn.Embedding,), "num_embeddings", "Embedding split by vocabulary rows; output summed"),
    "sequence": Kind((nn.Module,), None, "runs on sequence blocks (norms, dropout): its gradients summed"),
    "split_sequence": Kind((nn.Module,), None, "its input is cut into sequence blocks: the region starts"),
    "gather_sequence": Kind((nn.Module,), None, "its input is gathered from sequence blocks: the region ends"),
}
# The last three act only with sequence_parallel=True, so one plan serves both settings.
SEQUENCE_KINDS = ("sequence", "split_sequence", "gather_sequence")
# Kinds that split a layer whose features may be attention heads (q/k/v and the output projection).
_HEAD_KINDS = ("colwise", "colwise_gather", "rowwise")


def kind_names() -> list[str]:
    return list(KINDS)


def _owners(root: nn.Module, name: str) -> list[nn.Module]:
    """The modules that contain ``name``, innermost first, the root last."""
    parts = name.split(".")
    return [root.get_submodule(".".join(parts[:i])) for i in range(len(parts) - 1, -1, -1)]


def resolve(module: nn.Module, plan: Mapping[str, str], tp: int, sequence_parallel: bool = False) -> dict[str, str]:
    """Module name -> kind for every module the plan names, in the model's module order.

    ValueError for anything that would fail later; nothing here communicates.
    """
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    check_tp(tp)
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"a plan is a non-empty mapping of module-name patterns to kinds, got {plan!r}")
    names = [name for name, _ in module.named_modules()]
    found: dict[str, str] = {}
    for pattern, kind in plan.items():
        if not isinstance(pattern, str) or kind not in KINDS:
            raise ValueError(f"plan entry {pattern!r}: {kind!r} is not a kind: choose from {', '.join(KINDS)}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            some = ", ".join(n for n in names[1:13] if n)
            raise ValueError(f"plan pattern {pattern!r} names no module of {type(module).__name__} "
                             f"(its modules include: {some})")
        for name in hits:
            if found.get(name, kind) != kind:
                raise ValueError(f"module {name!r} is given two kinds, {found[name]!r} and {kind!r}")
            found[name] = kind
    for name, kind in found.items():
        _check(module, name, kind, tp)
    if sequence_parallel and "split_sequence" not in found.values():
        # Without it every activation stays whole and the first column layer would gather whole
        # sequences: shapes tp times too long, failing far from the cause.
        raise ValueError("sequence_parallel=True needs a 'split_sequence' entry naming the module whose input "
                         "is the first to be cut into sequence blocks (the first block, say)")
    return {n: found[n] for n in names if n in found}


def _check(root: nn.Module, name: str, kind: str, tp: int) -> None:
    spec, target = KINDS[kind], root.get_submodule(name)
    label = name or "the root module"
    if not isinstance(target, spec.types):
        raise ValueError(f"{label} is a {type(target).__name__}; {kind!r} takes "
                         f"{' or '.join(t.__name__ for t in spec.types)}")
    if spec.splits is None:
        return
    if not name:
        raise ValueError(f"{kind!r} replaces a module inside the model, not the model itself")
    check_divides(tp, getattr(target, spec.splits), f"{label}.{spec.splits}")
    heads = head_count(_owners(root, name)) if kind in _HEAD_KINDS else None
    if heads is not None:
        check_divides(tp, heads, f"the attention heads around {label}")


def gpt_plan(vocab_parallel: bool = False) -> dict[str, str]:
    """The plan for :class:`commlab.models.GPT`: q, k, v and the MLP's first layer by columns, the
    attention projection and the MLP's second layer by rows, norms on sequence blocks (with
    ``sequence_parallel=True``). With ``vocab_parallel`` the token embedding is split by rows and
    the head by columns: its logits stay split, for :func:`vocab_parallel_cross_entropy`."""
    plan = {"layers.*.[qkv]": "colwise", "layers.*.proj": "rowwise", "layers.*.fc": "colwise",
            "layers.*.out": "rowwise", "layers.*.ln[12]": "sequence", "norm": "sequence",
            "layers.0": "split_sequence", "head": "colwise" if vocab_parallel else "gather_sequence"}
    if vocab_parallel:
        plan["tok"] = "vocab"
    return plan
