"""Messages between stages: micro-batch splitting, the first step's shape handshake, tags.

Activations and gradients travel as plain tensors over torch.distributed point-to-point ops
(Gloo on CPU, NCCL on GPU), so a receiver must allocate the right buffer before the data arrives.
As torch's PipelineStage does, shapes are learned once, on the first step: each stage runs its
module on a one-sample zero batch to find its output's per-sample shape and passes it on with the
micro-batch sizes, in stage order. Later steps must use the same batch shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from commlab.pipeline.schedules import FORWARD, Action
from commlab.pipeline.stage import Stage


@dataclass(frozen=True)
class Boundary:
    """What crosses from one stage to the next: per-sample shape and dtype, and micro-batch sizes."""

    sizes: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def buffer(self, microbatch: int, device: torch.device) -> torch.Tensor:
        return torch.empty((self.sizes[microbatch], *self.shape), dtype=self.dtype, device=device)


def split_batch(batch: torch.Tensor, microbatches: int, what: str = "batch") -> tuple[torch.Tensor, ...]:
    """``microbatches`` slices along dim 0, sizes differing by at most one (torch.tensor_split)."""
    if batch.dim() == 0 or batch.shape[0] < microbatches:
        size = batch.shape[0] if batch.dim() else 0
        raise ValueError(f"{what} of {size} samples cannot be split into {microbatches} micro-batches")
    return torch.tensor_split(batch, microbatches, dim=0)


def tag(action: Action, microbatches: int) -> int:
    """A tag unique to the message ``action`` produces, so Gloo matches it whatever the posting order."""
    return 2 * (action.stage * microbatches + action.microbatch) + (0 if action.kind == FORWARD else 1)


def handshake(stage: Stage, first: tuple[torch.Tensor, ...] | None) -> dict[int, Boundary]:
    """The input boundary of every stage this rank holds or feeds (key: stage index).

    ``first`` is the first stage's micro-batches (on the rank holding stage 0, else None). Runs in
    stage order with blocking object sends, so stage s waits only for stage s - 1. The result also
    holds the boundary after each local stage: the shape of the gradients that come back to it.
    """
    inputs: dict[int, Boundary] = {}
    for s in sorted(stage.modules):
        if s == 0:
            assert first is not None
            inputs[s] = Boundary(tuple(int(t.shape[0]) for t in first), tuple(first[0].shape[1:]), first[0].dtype)
        elif s not in inputs:
            box: list = [None]
            dist.recv_object_list(box, src=stage.global_rank_of(s - 1), group=stage.group, device=_object_device(stage))
            inputs[s] = box[0]
        if s + 1 < stage.num_stages:
            inputs[s + 1] = _output_boundary(stage, s, inputs[s])
            if s + 1 not in stage.modules:
                dst = stage.global_rank_of(s + 1)
                dist.send_object_list([inputs[s + 1]], dst=dst, group=stage.group, device=_object_device(stage))
    return inputs


def _output_boundary(stage: Stage, s: int, inp: Boundary) -> Boundary:
    module = stage.modules[s]
    module = getattr(module, "module", module)  # a DDP wrapper's own forward would talk to its group
    was_training = [m.training for m in module.modules()]
    module.eval()  # a one-sample batch in eval mode: no batch-norm statistics or dropout RNG touched
    try:
        with torch.no_grad():
            out = module(torch.zeros((1, *inp.shape), dtype=inp.dtype, device=stage.device))
    finally:
        for m, flag in zip(module.modules(), was_training):
            m.training = flag
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"stage {s} must return one tensor, got {type(out).__name__}")
    return Boundary(inp.sizes, tuple(out.shape[1:]), out.dtype)


def _object_device(stage: Stage) -> torch.device | None:
    return stage.device if stage.device.type == "cuda" else None
