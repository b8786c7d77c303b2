"""Micro-batches of ``step()``'s arguments: every tensor chunked by its chunk spec, and merged back.

As torch.distributed.pipelining's ``split_args_kwargs_into_chunks`` does, each tensor argument is
split along its batch dimension (dim 0) unless a per-argument chunk spec says otherwise:
``args_chunk_spec`` (one entry per positional argument) and ``kwargs_chunk_spec`` (by name) give
a dimension (an int, or torch's ``TensorChunkSpec``) or None to give every micro-batch the whole
tensor (torch's ``_Replicate``). :func:`merge` concatenates the last stage's outputs along dim 0,
as torch's ``merge_chunks`` does by default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from commlab.pipeline.runtime.traced import flatten_inputs
from commlab.pipeline.runtime.values import Value


def _dim(spec) -> int | None:
    if spec is None or isinstance(spec, int):
        return spec
    if hasattr(spec, "split_dim"):  # torch.distributed.pipelining.microbatch.TensorChunkSpec
        return int(spec.split_dim)
    if type(spec).__name__ == "_Replicate":  # torch's marker for "the whole tensor in every chunk"
        return None
    raise ValueError(f"a chunk spec is a dimension (int or TensorChunkSpec) or None (the whole tensor), got {spec!r}")


def chunk(tensor: torch.Tensor, microbatches: int, dim: int | None, what: str) -> tuple[torch.Tensor, ...]:
    """``microbatches`` slices of ``tensor`` along ``dim`` (sizes differing by at most one), or the
    whole tensor ``microbatches`` times when ``dim`` is None."""
    if dim is None:
        return (tensor,) * microbatches
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"{what} of shape {list(tensor.shape)} has no dimension {dim} to split into micro-batches")
    if tensor.shape[dim] < microbatches:
        raise ValueError(f"{what} of {tensor.shape[dim]} along dimension {dim} cannot be split into {microbatches} micro-batches")
    return torch.tensor_split(tensor, microbatches, dim=dim)


def split_inputs(leaves: Sequence, spec: pytree.TreeSpec, microbatches: int, args_chunk_spec: Sequence | None,
                 kwargs_chunk_spec: Mapping | None, names: Sequence[str]) -> list[tuple[torch.Tensor, ...]]:  # fmt: skip
    """Per micro-batch, the tuple of every input leaf's chunk. ``leaves``/``spec``: ``(args, kwargs)``
    flattened; ``names``: a readable name per leaf for errors."""
    args, kwargs = pytree.tree_unflatten(list(range(len(leaves))), spec)  # each leaf's index, in place
    dims: dict[int, int | None] = {}
    for k, arg in enumerate(args):
        dim = _dim(args_chunk_spec[k]) if args_chunk_spec is not None and k < len(args_chunk_spec) else 0
        dims.update({i: dim for i in pytree.tree_leaves(arg)})
    for key, arg in kwargs.items():
        dim = _dim(kwargs_chunk_spec[key]) if kwargs_chunk_spec is not None and key in kwargs_chunk_spec else 0
        dims.update({i: dim for i in pytree.tree_leaves(arg)})
    columns = []
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{names[i]} is a {type(t).__name__}: every input to a pipeline step must be a tensor")
        columns.append(chunk(t, microbatches, dims[i], names[i]))
    return list(zip(*columns))


def merge(outputs: Sequence[Value]) -> Value:
    """The micro-batches' outputs as one batch: concatenated along dim 0 (each element of a tuple)."""
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(list(outputs), dim=0)
    return tuple(torch.cat([o[k] for o in outputs], dim=0) for k in range(len(outputs[0])))


def inputs_of(stage, args: tuple, kwargs: dict, microbatches: int, args_chunk_spec: Sequence | None,
              kwargs_chunk_spec: Mapping | None) -> list[Value]:  # fmt: skip
    """The first stage's micro-batches of ``step(*args, **kwargs)``: one tensor each for an
    nn.Sequential (one positional tensor in), the tuple of every input's chunk for a traced model
    (its arguments as traced, each micro-batch of the example's shapes). ValueError otherwise."""
    if not args and not kwargs or (len(args) == 1 and args[0] is None and not kwargs):
        raise ValueError("the rank holding the first stage must pass the mini-batch to step()")
    traced = stage.traced
    if traced is None:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise ValueError("a pipeline of an nn.Sequential takes one tensor: step(x, target=y); "
                             "cut the model with split_points= to pass other arguments")  # fmt: skip
        dim = _dim(args_chunk_spec[0]) if args_chunk_spec else 0
        return list(chunk(args[0].to(stage.device), microbatches, dim, "the mini-batch"))
    leaves, spec = flatten_inputs(traced.order, args, kwargs)
    if spec != traced.spec:
        raise ValueError(f"step() must take the arguments the model was traced with ({', '.join(traced.names)}), "
                         f"got {spec}")  # fmt: skip
    leaves = [t.to(stage.device) if isinstance(t, torch.Tensor) else t for t in leaves]
    chunks = split_inputs(leaves, spec, microbatches, args_chunk_spec, kwargs_chunk_spec, traced.names)
    for i, mb in enumerate(chunks):
        for name, t, (shape, dtype) in zip(traced.names, mb, traced.inputs):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"micro-batch {i} of {name} is {t.dtype} {list(t.shape)}, but the stages were traced on "
                                 f"{dtype} {list(shape)}: traced stages are static-shape, so each argument must split "
                                 f"into {microbatches} micro-batches of the example's shape")  # fmt: skip
    return chunks


def step_inputs(stage, args: tuple, kwargs: dict, target: torch.Tensor | None, microbatches: int,
                args_chunk_spec: Sequence | None, kwargs_chunk_spec: Mapping | None,
                need_target: bool) -> tuple[list | None, tuple | None, str | None]:  # fmt: skip
    """(the first stage's micro-batches, the last stage's target chunks, why the step is refused)
    on this rank: the refusal is returned, not raised, so that every rank can raise it together."""
    chunks = targets = None
    try:
        if stage.is_first:
            chunks = inputs_of(stage, args, kwargs, microbatches, args_chunk_spec, kwargs_chunk_spec)
        if stage.is_last and (need_target or target is not None):
            if target is None:
                raise ValueError("the rank holding the last stage must pass target= to step()")
            targets = chunk(target.to(stage.device), microbatches, 0, "the target")
    except ValueError as err:
        return None, None, str(err)
    return chunks, targets, None
