"""Hybrid pipeline x data parallelism: each stage's replicas kept in sync by commlab's DDP.

In a pp x dp :class:`~commlab.runtime.topology.Topology`, the ``dp`` ranks holding the same stage
wrap it in :class:`commlab.DistributedDataParallel` over their data-parallel group. Gradients
must be all-reduced once per mini-batch, not once per micro-batch, and DDP's forward is what arms
its reducer for the next backward. Under 1F1B the last forward of a stage is followed by other
micro-batches' backwards before its own, so "leave the last forward outside no_sync" would arm
the reducer too early. We therefore do what torch.distributed.pipelining's stage does
(``backward_maybe_with_nosync``): every forward and every backward but the stage's last run under
``no_sync()``; just before the last backward we arm the reducer ourselves
(``reducer.prepare_for_backward``). Its buckets are then all-reduced while the rest of that last
backward runs, and the end of backward waits for them, averaging the accumulated gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, ContextManager

import torch
from torch import nn

from commlab.ddp import DistributedDataParallel
from commlab.pipeline.runtime.stages import RankStages
from commlab.runtime.topology import Topology


class DataParallelStage(RankStages):
    """This rank's stages in a pp x dp grid, each wrapped in DDP over ``topology.dp_group``.

    ``ddp_options`` go to :class:`commlab.DistributedDataParallel` (e.g. ``bucket_cap_mb``).
    """

    # DDP's reducer is armed for one backward call; a split I/W backward is two calls per
    # micro-batch, so zero-bubble schedules are refused here (PipelineExecutor raises).
    supports_split_backward = False

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int],
        topology: Topology,
        *,
        placement: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        **ddp_options: Any,
    ):
        if topology.pp_group is None or topology.dp_group is None:
            raise ValueError("the topology has no process groups: create it with Topology.build(pp, dp)")
        super().__init__(model, balance, placement, group=topology.pp_group, device=device)
        self.topology = topology
        # Wrap in stage order: DDP's constructor is collective over the data-parallel group. A stage
        # without trainable parameters (an activation, Dropout) has nothing to synchronise: it
        # stays as it is on every replica alike, so no group waits for it.
        self.modules = {
            s: DistributedDataParallel(m, process_group=topology.dp_group, **ddp_options) if _trainable(m) else m
            for s, m in sorted(self.modules.items())
        }

    def forward_context(self, stage: int) -> ContextManager:
        ddp = self.modules[stage]
        return ddp.no_sync() if isinstance(ddp, DistributedDataParallel) else contextlib.nullcontext()

    def backward_context(self, stage: int, last: bool, outputs: Sequence[torch.Tensor]) -> ContextManager:
        ddp = self.modules[stage]
        if not isinstance(ddp, DistributedDataParallel):
            return contextlib.nullcontext()
        if not last:
            return ddp.no_sync()
        ddp.reducer.start_iteration()
        ddp.reducer.prepare_for_backward(list(outputs))
        return contextlib.nullcontext()


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())
