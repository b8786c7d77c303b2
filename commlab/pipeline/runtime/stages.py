"""This rank's pipeline stages: the parts of a partitioned nn.Sequential it holds, and who holds the others.

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

from commlab.pipeline.partition import split
from commlab.pipeline.schedule.actions import check_placement, looping


def check_stages(stages: int, ranks: int) -> int:
    """Stages per rank (v); ValueError unless the stages divide evenly over the ranks."""
    if stages < ranks:
        raise ValueError(f"{stages} stages for {ranks} pipeline ranks: every rank needs a stage")
    if stages % ranks:
        raise ValueError(f"{stages} stages do not divide evenly over {ranks} pipeline ranks")
    return stages // ranks


class RankStages:
    """This rank's stage modules of ``model`` split by ``balance`` and placed by ``placement``
    (default: looping) over the ranks of ``group``.

    ``group`` is the pipeline group (``Topology.pp_group`` in a hybrid run; None: all ranks). The
    modules are moved to ``device`` (default: the CPU for Gloo, this rank's GPU for NCCL) and share
    parameters with ``model``.
    """

    supports_split_backward = True  # may run I and W actions (a subclass may refuse)

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int],
        placement: Sequence[int] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_world_size(group)
        parts = split(model, balance)
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
            s: parts[s].to(self.device) for s in range(self.num_stages) if self.placement[s] == self.rank
        }
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

    def forward_context(self, stage: int) -> ContextManager:
        """Entered around every forward of ``stage`` (including a checkpoint's recomputation)."""
        return contextlib.nullcontext()

    def backward_context(self, stage: int, last: bool, outputs: Sequence[torch.Tensor]) -> ContextManager:
        """Entered around every backward of ``stage`` from ``outputs``; ``last``: its final one in the step."""
        return contextlib.nullcontext()


# The old name, kept for a release: the object holds all of a rank's stages, not one.
Stage = RankStages
