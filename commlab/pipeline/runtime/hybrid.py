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

Zero-bubble schedules split a stage's backward into I and W, and W may be several backward calls
(one per layer) while DDP's reducer is armed for one. So a split stage runs all of them under
``no_sync()`` and, right after its last W, all-reduces its accumulated gradients itself (one
flattened all-reduce over the data-parallel group, averaged as DDP averages). ``no_sync()`` on
the stages accumulates gradients over several steps, reducing nothing until the first step
outside it (DDP's ``no_sync`` across a pipeline step; torch's pipeline stage has the same switch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from commlab.ddp import DistributedDataParallel
from commlab.pipeline.runtime.stages import RankStages
from commlab.runtime.topology import Topology


class DataParallelStage(RankStages):
    """This rank's stages in a pp x dp grid, each wrapped in DDP over ``topology.dp_group``.

    The model is cut as :class:`RankStages` cuts it: ``balance`` for an nn.Sequential, or
    ``split_points`` with ``example_args`` / ``example_kwargs`` for any module (keywords).
    ``ddp_options`` go to :class:`commlab.DistributedDataParallel` (e.g. ``bucket_cap_mb``).
    """

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | None = None,
        topology: Topology | None = None,
        *,
        placement: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        split_points: Sequence[str] | None = None,
        example_args: tuple | None = None,
        example_kwargs: dict | None = None,
        **ddp_options: Any,
    ):
        if topology is None or topology.pp_group is None or topology.dp_group is None:
            raise ValueError("the topology has no process groups: create it with Topology.build(pp, dp)")
        super().__init__(model, balance, placement, split_points=split_points, example_args=example_args,
                         example_kwargs=example_kwargs, group=topology.pp_group, device=device)  # fmt: skip
        self.topology = topology
        # Wrap in stage order: DDP's constructor is collective over the data-parallel group. A stage
        # without trainable parameters (an activation, Dropout) has nothing to synchronise: it
        # stays as it is on every replica alike, so no group waits for it.
        self.modules = {
            s: DistributedDataParallel(m, process_group=topology.dp_group, **ddp_options) if _trainable(m) else m
            for s, m in sorted(self.modules.items())
        }
        self._accumulating = False
        self.reductions = {s: 0 for s in self.modules}  # gradient all-reduces after a split stage's last W

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside accumulate gradients locally; the first step after it reduces them all."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def forward_context(self, stage: int) -> ContextManager:
        ddp = self.modules[stage]
        return ddp.no_sync() if isinstance(ddp, DistributedDataParallel) else contextlib.nullcontext()

    def backward_context(self, stage: int, last: bool, outputs: Sequence[torch.Tensor] | None) -> ContextManager:
        ddp = self.modules[stage]
        if not isinstance(ddp, DistributedDataParallel):
            return contextlib.nullcontext()
        if outputs is None and last and not self._accumulating:  # a split stage's last W
            return self._reduce_after(stage, ddp)
        if not last or outputs is None or self._accumulating:
            return ddp.no_sync()
        ddp.reducer.start_iteration()
        ddp.reducer.prepare_for_backward(list(outputs))
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _reduce_after(self, stage: int, ddp: DistributedDataParallel) -> Iterator[None]:
        with ddp.no_sync():
            yield
        grads = [p.grad for p in ddp.module.parameters() if p.requires_grad and p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.topology.dp_group)
            flat /= dist.get_world_size(self.topology.dp_group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        self.reductions[stage] += 1


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())
