"""This rank's pipeline stages: the parts of a partitioned model it holds, and who holds the others.

A model is cut into stages either by ``balance`` (an nn.Sequential, so many layers per stage) or
by ``split_points`` (any module, traced with torch.export and cut before each named submodule:
:mod:`commlab.pipeline.runtime.traced`).

``placement`` lists the rank of each stage. The default is the looping placement (stage s on rank
s % p), under which a rank holds ``v = stages / p`` stages (v = 1 for GPipe and 1F1B); ZB-V uses
the V placement [0, 1, ..., p-1, p-1, ..., 0] (:func:`commlab.pipeline.schedule.actions.v_shape`). The object owns no schedule: the executor asks it for the module of
a stage and for the global rank of the rank holding another stage. Subclasses hook the forward
and backward of each stage module (hybrid pipeline x data parallel uses this to control DDP's
gradient synchronisation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn

from commlab._lazy import renamed_getattr
from commlab.pipeline.runtime.partition import split
from commlab.pipeline.runtime.values import Boundary
from commlab.pipeline.runtime.traced import Traced, trace_stages
from commlab.pipeline.schedule.actions import check_placement, looping


def check_stages(stages: int, ranks: int) -> int:
    """Stages per rank (v); ValueError unless the stages divide evenly over the ranks."""
    if stages < ranks:
        raise ValueError(f"{stages} stages for {ranks} pipeline ranks: every rank needs a stage")
    if stages % ranks:
        raise ValueError(f"{stages} stages do not divide evenly over {ranks} pipeline ranks")
    return stages // ranks


class RankStages:
    """This rank's stage modules of ``model``, placed by ``placement`` (default: looping) over the
    ranks of ``group``.

    ``RankStages(seq, balance=[3, 2])`` cuts an nn.Sequential into stages of so many layers.
    ``RankStages(model, split_points=["layers.4"], example_args=(x,), example_kwargs={...})`` cuts
    any module before each named submodule, in the order forward calls them, by tracing it with
    torch.export on one example micro-batch (:func:`~commlab.pipeline.runtime.traced.trace_stages`);
    ``step()`` then takes the model's own arguments, and every micro-batch must have the example's
    shapes. Parameters shared across stages (tied embeddings) are refused with their names.
    ``named_parameters()`` names this rank's parameters as ``model`` names them, so optimizers and
    checkpoints line up. A bad split point, split points out of order, a model torch.export
    cannot trace: ValueError, raised by :func:`trace_stages` alone too (it needs no process group,
    so a launcher can refuse bad input before any rank starts).

    ``group`` is the pipeline group (``Topology.pp_group`` in a hybrid run; None: all ranks). The
    modules are moved to ``device`` (default: the CPU for Gloo, this rank's GPU for NCCL) and share
    parameters with ``model``.
    """

    supports_split_backward = True  # may run I and W actions (a subclass may refuse)

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | None = None,
        placement: Sequence[int] | None = None,
        *,
        split_points: Sequence[str] | None = None,
        example_args: tuple | None = None,
        example_kwargs: dict | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ):
        if (balance is None) == (split_points is None):
            raise ValueError("give either balance= (an nn.Sequential) or split_points= (any module, with example_args=)")
        self.traced: Traced | None = None
        if split_points is not None:
            if example_args is None:
                raise ValueError("split_points= needs example_args=: one micro-batch of the inputs, to trace the model")
            self.traced = trace_stages(model, split_points, example_args, example_kwargs)
            parts = list(self.traced.parts)
        else:
            parts = split(model, balance)
        self.group = group
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_world_size(group)
        self.num_stages = len(parts)
        if placement is None:
            check_stages(self.num_stages, self.ranks)
            placement = looping(self.ranks, self.num_stages)
        self.placement = check_placement(placement, self.ranks, self.num_stages)
        self.virtual = self.num_stages // self.ranks
        if device is None:
            backend = str(dist.get_backend(group)).lower()
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.modules: dict[int, nn.Module] = {
            s: parts[s].place(self.device) if self.traced else parts[s].to(self.device)
            for s in range(self.num_stages) if self.placement[s] == self.rank
        }
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._global_ranks = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self.ranks)
        ]

    @property
    def is_first(self) -> bool:
        return 0 in self.modules

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.modules

    def rank_of(self, stage: int) -> int:
        """The rank (in the pipeline group) holding ``stage``."""
        return self.placement[stage]

    def global_rank_of(self, stage: int) -> int:
        """The global rank holding ``stage``, for point-to-point calls."""
        return self._global_ranks[self.rank_of(stage)]

    def parameters(self) -> list[nn.Parameter]:
        return [p for s in sorted(self.modules) for p in self.modules[s].parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as the original model names them."""
        return [(self._names[id(p)], p) for p in self.parameters()]

    def boundaries(self, sizes: tuple[int, ...]) -> dict[int, Boundary] | None:
        """Every stage's input boundary for micro-batches of ``sizes``, if known without running
        anything (a traced model: its shapes are static); None for an nn.Sequential."""
        if self.traced is None:
            return None
        return {s: Boundary(sizes, tuple(shape for shape, _ in c), tuple(d for _, d in c), packed=True, whole=True)
                for s, c in enumerate(self.traced.carried)}  # fmt: skip

    def forward_context(self, stage: int) -> ContextManager:
        """Entered around every forward of ``stage`` (including a checkpoint's recomputation)."""
        return contextlib.nullcontext()

    def backward_context(self, stage: int, last: bool, outputs: Sequence[torch.Tensor] | None) -> ContextManager:
        """Entered around every backward of ``stage`` from ``outputs`` (None: a split backward's W,
        the weights' half); ``last``: its final one in the step."""
        return contextlib.nullcontext()


# The old name, for a release: the object holds all of a rank's stages, not one.
__getattr__ = renamed_getattr(__name__, {"Stage": "RankStages"})
