"""One bucket as a flat padded buffer: the rank's parameter shard, the gathered parameters, the
gradient buffer, and the collectives that move between them.

The module's parameters become views into ``full``, the gathered flat buffer (as torch's FSDP1
FlatParameter views, torch/distributed/fsdp/_flat_param.py). Stages 1 and 2 keep ``full`` for
good and the shard is a view into it, so the optimizer updates the rank's part of the replica in
place and an all-gather refreshes the rest. Stage 3 keeps the shard as a tensor of its own and
frees ``full`` by resizing its storage to zero bytes: the parameter views keep their shapes (and
autograd its saved references to them) while holding no memory, and a later all-gather into the
same storage brings them back. Parameters keep their own version counters (``.data`` assignment
does not share the buffer's), so writing the gathered values does not invalidate what autograd
saved.
"""

from __future__ import annotations


import torch
from torch import nn

from commlab.sharded import comm
from commlab.sharded.layout import shard_layout


class FlatBucket:
    """The parameters of one bucket, flattened, padded and sharded over the group's ranks."""

    def __init__(
        self, index: int, params: list[nn.Parameter], rank: int, world_size: int, stage: int, group,
        algorithm: str = "native",
    ):
        self.index, self.params, self.rank, self.stage, self.group = index, params, rank, stage, group
        self.algorithm = algorithm  # the collectives' (commlab/sharded/comm.py)
        self.world_size = world_size
        self.layout = shard_layout([p.numel() for p in params], world_size)
        self.lo, self.hi = self.layout.shard_range(rank)
        self.element_size = params[0].element_size()
        first = params[0]
        self.full = torch.zeros(self.layout.padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, offset in zip(params, self.layout.offsets):
                self.full[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.full[offset : offset + p.numel()].view(p.shape)
        # Stages 1-2: a view, so that optimizer steps land in the replica; stage 3: its own memory.
        own = self.full[self.lo : self.hi]
        self.shard = nn.Parameter(own.clone() if stage == 3 else own)
        self.grad_buffer: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None  # where the reduction writes the rank's shard
        self.gathered = True
        self.pending = len(params)  # gradients still to arrive in this backward

    @property
    def full_nbytes(self) -> int:
        return self.layout.padded * self.element_size

    # --- parameters -----------------------------------------------------------------------
    def free(self) -> None:
        """Stage 3: release the gathered parameters (the views stay, holding no memory)."""
        assert self.stage == 3 and self.gathered
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def launch_gather(self):
        """All-gather the shards into ``full``, allocating it again if freed."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.full_nbytes)
        self.gathered = True
        # Stages 1-2 gather into the buffer the shard lives in: the backend's all-gather gets a
        # copy, not an alias; a p2p algorithm gathers in place, its own block untouched.
        inplace = self.stage == 3 or self.algorithm != "native"
        source = self.shard.detach() if inplace else self.shard.detach().clone()
        return comm.all_gather(self.full, source, self.group, self.algorithm)

    # --- gradients -----------------------------------------------------------------------
    def add_gradient(self, slot: int) -> None:
        """Copy parameter ``slot``'s accumulated gradient into the bucket, pre-divided by the world
        size as torch's DDP does it (a multiplication by 1/N while copying: reducer.cpp's
        copy_grad_to_bucket), so that the sums are the same numbers DDP's are."""
        if self.grad_buffer is None:
            # Every parameter's slot is written below before the reduction reads the buffer, so
            # only the padding needs zeros: one pass over new memory instead of two.
            self.grad_buffer = torch.empty(self.layout.padded, dtype=self.full.dtype, device=self.full.device)
            self.grad_buffer[self.layout.total:].zero_()
        p, offset = self.params[slot], self.layout.offsets[slot]
        view = self.grad_buffer[offset : offset + p.numel()].view(p.shape)
        torch.mul(p.grad, 1.0 / self.world_size, out=view)
        # Stage 1 keeps the full reduced gradient in .grad (ZeRO-1); 2 and 3 keep only the shard.
        p.grad = view if self.stage == 1 else None

    def launch_reduction(self):
        """Stage 1 all-reduces the whole buffer; stages 2-3 reduce-scatter it into a new shard."""
        assert self.grad_buffer is not None
        if self.stage == 1:
            self.reduced = self.grad_buffer[self.lo : self.hi]
            return comm.all_reduce(self.grad_buffer, self.group, self.algorithm)
        self.reduced = torch.empty(self.hi - self.lo, dtype=self.full.dtype, device=self.full.device)
        return comm.reduce_scatter(self.reduced, self.grad_buffer, self.group, self.algorithm)

    def finish_reduction(self) -> None:
        """After the reduction's wait: the shard's gradient (accumulated, as torch's .grad is);
        stages 2-3 drop the full gradient buffer."""
        if self.shard.grad is None:
            self.shard.grad = self.reduced
        else:
            self.shard.grad.add_(self.reduced)
        self.reduced = None
        if self.stage != 1:
            self.grad_buffer = None

    def drop_full_gradients(self) -> None:
        """The module's full gradients go (the shard's stays): stage 1 at the next forward, any
        stage after a backward that left the bucket incomplete."""
        for p in self.params:
            p.grad = None
        self.grad_buffer = None

    # --- state ---------------------------------------------------------------------------
    def write_full(self, values: list[torch.Tensor]) -> None:
        """Set every parameter of the bucket (all ranks pass the same values): the rank's shard,
        and the replica where it is gathered."""
        flat = torch.zeros(self.layout.padded, dtype=self.full.dtype, device=self.full.device)
        for value, offset in zip(values, self.layout.offsets):
            flat[offset : offset + value.numel()].copy_(value.reshape(-1))
        with torch.no_grad():
            if self.gathered:
                self.full.copy_(flat)
            if self.stage == 3:
                self.shard.copy_(flat[self.lo : self.hi])
