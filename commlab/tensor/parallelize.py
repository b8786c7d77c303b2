"""``parallelize``: a plan applied to a model in place, and ``full_state_dict``, its inverse for checkpoints.

Where each collective sits (forward | backward), per kind; with ``sequence_parallel=True`` the
second form:

    colwise          before: identity | all-reduce      or  all-gather | reduce-scatter (sequence)
    colwise_gather   as colwise, then all-gather | own block (features)
    rowwise          after: all-reduce | identity       or  reduce-scatter | all-gather (sequence)
    vocab            after: all-reduce | identity
    split_sequence   before: own block | all-gather (sequence)
    gather_sequence  before: all-gather | own block (sequence)
    sequence         its parameters' gradients: all-reduce, in backward

Sequence parallelism thus keeps the activations between a row layer and the next column layer
(the residual stream, norms, dropout) in blocks of the sequence, from ``split_sequence`` to
``gather_sequence`` (or a column-split head). A whole parameter used there (a norm's weight, a
row layer's bias) gets only its block's part of the gradient, so its gradient is summed over the
group by a hook, before it is accumulated: accumulation over micro-batches stays correct.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from commlab.tensor import operators as ops
from commlab.tensor.comm import TPGroup
from commlab.tensor.layers import SEQUENCE_DIM, ColwiseLinear, InputCache, RowwiseLinear, VocabEmbedding, sum_gradient_hook
from commlab.tensor.plan import SEQUENCE_KINDS, resolve
from commlab.tensor.timing import Recorder


def parallelize(module: nn.Module, plan: Mapping[str, str], *, group=None, sequence_parallel: bool = False,
                algorithm: str = "native") -> nn.Module:
    """Split the modules ``plan`` names over ``group`` (None: the world) and return ``module``.

    ``plan`` maps fnmatch patterns of module names to kinds (``commlab.tensor.kind_names()``);
    ``algorithm`` is any registered all-reduce (``commlab.collectives.algorithm_names()``).
    Every rank of the group calls it with the same model, initialised alike (the layers slice the
    weights they are given). A wrong plan raises ValueError before any collective.
    """
    tp = TPGroup.of(group, algorithm)
    kinds = resolve(module, plan, tp.size, sequence_parallel)
    cache = InputCache()
    module.register_forward_pre_hook(cache.clear)
    recorder = _recorder(module)
    for name, kind in kinds.items():
        target, tp = module.get_submodule(name), tp.at(name, recorder)
        if kind in SEQUENCE_KINDS:
            if sequence_parallel:
                _mark_sequence(target, kind, tp)
            continue
        if kind == "vocab":
            new = VocabEmbedding(target, tp)
        elif kind == "rowwise":
            new = RowwiseLinear(target, tp, sequence_parallel=sequence_parallel)
        else:
            new = ColwiseLinear(target, tp, cache, sequence_parallel=sequence_parallel,
                                gather_output=kind == "colwise_gather")
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, new)
    return module


def _recorder(module: nn.Module) -> Recorder:
    """The module's timing recorder (commlab/tensor/timing.py), one however many plans it is given."""
    if not hasattr(module, "_tensor_parallel_timing"):
        module._tensor_parallel_timing = Recorder()
        module.register_forward_pre_hook(module._tensor_parallel_timing.forward_start)
        module.register_forward_hook(module._tensor_parallel_timing.forward_end)
    return module._tensor_parallel_timing


def _mark_sequence(target: nn.Module, kind: str, tp: TPGroup) -> None:
    if kind == "sequence":
        for p in target.parameters():
            if p.requires_grad:
                p.register_hook(sum_gradient_hook(tp))
        return
    op = ops.split if kind == "split_sequence" else ops.gather

    def first_input(_module, args, kwargs):
        if not args or not isinstance(args[0], torch.Tensor):
            raise ValueError(f"{kind!r} acts on a module's first positional argument, a tensor; "
                             f"{type(_module).__name__} got {len(args)} positional arguments")
        return (op(args[0], tp, SEQUENCE_DIM), *args[1:]), kwargs

    target.register_forward_pre_hook(first_input, with_kwargs=True)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The unpartitioned model's state dict (same names, full values) on every rank.

    Collective: every rank of each tensor-parallel group calls it. Split parameters are gathered
    along the dimension they were cut (``tp_split`` of their layer); everything else is copied.
    """
    out = {}
    for name, value in module.state_dict().items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        dim = getattr(owner, "tp_split", {}).get(leaf)
        tp = None if dim is None else owner.tp.at("")  # not stamped: no part of an iteration
        out[name] = value.detach().clone() if dim is None else tp.all_gather(value.detach().contiguous(), dim)
    return out
