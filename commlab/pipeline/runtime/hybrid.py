"""Hybrid pipeline x data parallelism: each stage's replicas kept in sync by commlab's DDP or ZeRO.

In a (tp x) pp x dp :class:`~commlab.runtime.topology.Topology`, the ``dp`` ranks holding the same
stage wrap it in :class:`commlab.DistributedDataParallel` over their data-parallel group, or with
``zero_stage`` 1-3 in :class:`commlab.ShardedDataParallel` over it. Gradients
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

ZeRO reduces inside backward and expects every gradient of a wrapper in one backward call, while
W may be one call per layer: so each layer of an nn.Sequential stage gets its own
ShardedDataParallel (the layer is the unit that a split backward never cuts), and the stage's
last backward (its last B or W, or an I that runs its last W fused) runs outside ``no_sync``.

3D: apply tensor parallelism first, ``commlab.tensor.parallelize(model, plan,
group=topology.tp_group)``, then cut. Each tensor rank of a stage then sends to the same tensor
rank of the next stage (the pipeline group is one tensor rank's column of the mesh): the
activations between stages are whole (replicated over the tensor group) or, with
``sequence_parallel=True``, this rank's block of the sequence. The data-parallel wrappers see
the rank's blocks as their parameters; the tensor group's own gradient sums (sequence
parallelism's replicated parameters) are tensor hooks, which run before the gradient is
accumulated and so before DDP's or ZeRO's post-accumulate hooks read it.
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
from commlab.sharded import ShardedDataParallel


class DataParallelStage(RankStages):
    """This rank's stages in a (tp x) pp x dp mesh, each wrapped in DDP over ``topology.dp_group``.

    The model is cut as :class:`RankStages` cuts it: ``balance`` for an nn.Sequential, or
    ``split_points`` with ``example_args`` / ``example_kwargs`` for any module (keywords).
    ``ddp_options`` go to :class:`commlab.DistributedDataParallel` (e.g. ``bucket_cap_mb``), or,
    with ``zero_stage`` 1-3, to one :class:`commlab.ShardedDataParallel` per layer (``balance``
    only); build the optimizer over :meth:`parameters` (the shards, then).
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
        zero_stage: int | None = None,
        **ddp_options: Any,
    ):
        if zero_stage is not None and (zero_stage not in (1, 2, 3) or split_points is not None):
            raise ValueError(f"zero_stage is 1, 2 or 3 (got {zero_stage!r}) and needs balance= (an nn.Sequential "
                             "cut into layers, each its own ShardedDataParallel), not split_points=")
        if topology is None or topology.pp_group is None or topology.dp_group is None:
            raise ValueError("the topology has no process groups: create it with Topology.build(pp, dp)")
        super().__init__(model, balance, placement, split_points=split_points, example_args=example_args,
                         example_kwargs=example_kwargs, group=topology.pp_group, device=device)  # fmt: skip
        self.topology = topology
        # Wrap in stage order: DDP's constructor is collective over the data-parallel group. A stage
        # without trainable parameters (an activation, Dropout) has nothing to synchronise: it
        # stays as it is on every replica alike, so no group waits for it.
        self.zero_stage = zero_stage
        group = topology.dp_group
        if zero_stage is None:
            self.modules = {
                s: DistributedDataParallel(m, process_group=group, **ddp_options) if _trainable(m) else m
                for s, m in sorted(self.modules.items())
            }
        else:
            self.modules = {s: nn.Sequential(*(
                _ShardedLayer(ShardedDataParallel(layer, stage=zero_stage, process_group=group, **ddp_options))
                if _trainable(layer) else layer for layer in m)) for s, m in sorted(self.modules.items())}  # fmt: skip
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

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: the stages' parameters, or with ZeRO this rank's shards."""
        if self.zero_stage is None:
            return super().parameters()
        return [p for s in sorted(self.modules) for layer in self.modules[s] if isinstance(layer, _ShardedLayer)
                for p in layer.sharded.parameters()]  # fmt: skip

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        if self.zero_stage is not None:
            raise ValueError("under ZeRO the optimizer's parameters are flat shards, without names: use "
                             "parameters(), and state_dict() of each layer's ShardedDataParallel for values")
        return super().named_parameters()

    def sharded_layers(self, stage: int) -> list[ShardedDataParallel]:
        """The ShardedDataParallel of each trainable layer of ``stage`` (ZeRO), in order."""
        return [layer.sharded for layer in self.modules[stage] if isinstance(layer, _ShardedLayer)]

    def forward_context(self, stage: int) -> ContextManager:
        ddp = self.modules[stage]
        return ddp.no_sync() if isinstance(ddp, DistributedDataParallel) else contextlib.nullcontext()

    def backward_context(self, stage: int, last: bool, outputs: Sequence[torch.Tensor] | None) -> ContextManager:
        if self.zero_stage is not None:
            return self._zero_context(stage) if not last or self._accumulating else contextlib.nullcontext()
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


    @contextlib.contextmanager
    def _zero_context(self, stage: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for sharded in self.sharded_layers(stage):
                stack.enter_context(sharded.no_sync())
            yield


class _ShardedLayer(nn.Module):
    """A layer run through its ShardedDataParallel, whose ``parameters()`` are still the layer's own:
    the split backward asks autograd for them (the shards are not in the graph)."""

    def __init__(self, sharded: ShardedDataParallel):
        super().__init__()
        self.layer = sharded.module
        object.__setattr__(self, "sharded", sharded)  # not a submodule: its parameters are the shards

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # The whole tensors forward computes with, not the module's DTensor shards that sit in its
        # slots between forwards: a split backward (W) asks autograd for their gradients.
        for name, p in self.layer.named_parameters(prefix=f"{prefix}.layer" if prefix else "layer",
                                                   remove_duplicate=remove_duplicate):
            yield name, self.sharded.whole_of(p)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.sharded(*args, **kwargs)


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())
