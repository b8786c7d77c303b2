"""One bucket: its parameters' whole tensors, their DTensor shards, the rank-major flat buffers
the collectives run on, and the copies between them.

The module's parameters, whole, are views into ``full``, one unpadded buffer in parameter order
(as torch's FSDP1 FlatParameter views, torch/distributed/fsdp/_flat_param.py), so that the
model computes on ordinary contiguous tensors. The optimizer holds ``sharded``: for each
parameter a DTensor (commlab/sharded/dparams.py) whose local tensor is this rank's rows. Stages
1-2 keep ``full`` for good and the local rows are views into it, so an optimizer step updates
the rank's part of the replica in place; the all-gather after it copies the rank's pieces into
its block of a rank-major buffer and, when waited for, copies every rank's pieces out into
``full``. Stage 3 keeps the rank's pieces in ``shard``, a flat buffer of its own (its block of
the rank-major layout, so it is the all-gather's input as it stands), and frees ``full`` by
resizing its storage to zero bytes: the parameter views keep their shapes (and autograd its
saved references) while holding no memory, and the copy-out after the next all-gather fills the
same storage again. Under mixed precision (commlab/sharded/precision.py) ``full`` and the
collectives' buffers hold the computation's and the reduction's dtypes, and where the
computation's differs from the parameters' every stage keeps its master rows in ``shard``.
Parameters keep their own version counters (``.data`` assignment does not share the buffer's),
so writing gathered values does not invalidate what autograd saved.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from commlab.sharded import comm, copies
from commlab.sharded.dparams import as_dtensor
from commlab.sharded.hybrid import Replication
from commlab.sharded.layout import shard_layout
from commlab.sharded.precision import BucketDtypes


class FlatBucket:
    """The parameters of one bucket, sharded by rows over the group's ranks."""

    def __init__(
        self, index: int, params: list[nn.Parameter], rank: int, world_size: int, stage: int, group,
        algorithm: str, mesh, dtypes: BucketDtypes | None = None, replicate_group=None, trains: bool = True,
    ):
        self.index, self.params, self.rank, self.stage, self.group = index, params, rank, stage, group
        self.algorithm, self.mesh = algorithm, mesh  # the collectives' (commlab/sharded/comm.py)
        self.world_size = world_size  # the shard group's: the layout's ranks
        self.replicate_group = replicate_group  # HSDP's (commlab/sharded/hybrid.py), or None
        self.replication: Replication | None = None  # launched after the shard group's reduction
        # Gradients are averaged over every data-parallel rank: shard group x replicas.
        self.divisor = world_size * (dist.get_world_size(replicate_group) if replicate_group is not None else 1)
        self.layout = shard_layout([tuple(p.shape) for p in params], world_size)
        self.lo, self.hi = self.layout.shard_range(rank)
        first = params[0]
        self.dtypes = dtypes if dtypes is not None else BucketDtypes(first.dtype, first.dtype, first.dtype)
        self.full = torch.zeros(self.layout.total, dtype=self.dtypes.compute, device=first.device)
        self.element_size = self.full.element_size()  # of the parameters the collectives move
        self.shard: torch.Tensor | None = None
        values = [p.detach() for p in params]  # the master values, before any cast
        with torch.no_grad():
            for p, whole in zip(params, self._wholes()):
                whole.copy_(p.detach())
                p.data = whole
            # A master of its own where the compute replica holds another dtype (a reduction-only
            # policy keeps the shards as views of the replica, as without one).
            if stage == 3 or self.dtypes.compute != self.dtypes.master:
                self.shard = torch.zeros(self.layout.shard_size, dtype=self.dtypes.master, device=first.device)
                for i, value in enumerate(values):
                    copies.in_shard(self.shard, self.layout, i, rank).copy_(self._local_rows(value.contiguous(), i))
        # A frozen bucket (stage 3) is gathered like any other and never reduced: no gradient is
        # expected of it in a backward.
        self.trains, self.expected = trains, len(params) if trains else 0
        self.sharded = [nn.Parameter(as_dtensor(self.local(i), mesh, p), requires_grad=trains)
                        for i, p in enumerate(params)]
        # Stages 1-2: the shards' version when last sent and when last current (edited()).
        self.sent_version = self.seen_version = self._rows_version()
        self.gather_buffer: torch.Tensor | None = None  # rank-major, while an all-gather is in flight
        self.grad_buffer: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None  # where the reduction writes the rank's shard
        self.gathered = True
        self.pending = self.expected  # gradients still to arrive in this backward
        self.no_gradient: set[int] = set()  # slots no rank has a gradient of in this backward
        self.held: dict[int, torch.Tensor] = {}  # no_sync()'s sums in the reduction's dtype (hold_gradient)

    def _wholes(self) -> list[torch.Tensor]:
        return [self.full[o : o + p.numel()].view(p.shape) for p, o in zip(self.params, self.layout.offsets)]

    def _local_rows(self, whole: torch.Tensor, i: int) -> torch.Tensor:
        return copies.local_rows(whole, self.layout, i, self.rank)

    def local(self, i: int) -> torch.Tensor:
        """This rank's rows of parameter i: in ``shard`` (stage 3, or the master under mixed
        precision) or in the replica (stages 1-2)."""
        if self.shard is not None:
            return copies.in_shard(self.shard, self.layout, i, self.rank)
        o = self.layout.offsets[i]
        return self._local_rows(self.full[o : o + self.params[i].numel()], i)

    @property
    def full_nbytes(self) -> int:
        """Bytes of the rank-major buffer each collective moves."""
        return self.layout.padded * self.element_size

    @property
    def reduce_nbytes(self) -> int:
        """Bytes of the buffer a reduction moves (in the reduction's dtype)."""
        return self.layout.padded * self.dtypes.reduce.itemsize

    # --- parameters -----------------------------------------------------------------------
    def free(self) -> None:
        """Stage 3: release the gathered parameters (the views stay, holding no memory)."""
        assert self.stage == 3 and self.gathered and self.gather_buffer is None
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def launch_gather(self):
        """All-gather every rank's pieces into a rank-major buffer; ``finish_gather`` copies out."""
        self.gathered = True
        buffer = torch.empty(self.layout.padded, dtype=self.full.dtype, device=self.full.device)
        if self.shard is not None:  # cast before the gather: the wire carries the compute dtype
            source = self.shard.to(buffer.dtype)
        else:  # stages 1-2: the rank's rows, copied in from the replica
            own = buffer[self.lo : self.hi]
            own.zero_()
            for i in range(len(self.params)):
                copies.in_shard(own, self.layout, i, self.rank).copy_(self.local(i))
            # The backend's all-gather gets its own input, not an alias of its output; a p2p
            # algorithm gathers in place around its own block.
            source = own.clone() if self.algorithm == "native" else own
        self.gather_buffer = buffer
        self.sent_version = self._rows_version()
        return comm.all_gather(buffer, source, self.group, self.algorithm)

    def finish_gather(self) -> bool:
        """After the all-gather's wait: the parameters, whole, from the rank-major buffer. False,
        with nothing copied, at stages 1-2 if the rank's rows were written since they were sent:
        copying out would undo that write (the caller gathers again)."""
        buffer, self.gather_buffer = self.gather_buffer, None
        if buffer is None:
            return True
        if self.stage < 3 and self._rows_version() != self.sent_version:
            return False
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.layout.total * self.element_size)
        with torch.no_grad():
            for i, whole in enumerate(self._wholes()):
                copies.copy_out(buffer, self.layout, i, whole)
        self.seen_version = self._rows_version()
        return True

    def _rows_version(self) -> int:
        """The version counters of the DTensor shards, summed: an in-place write through one (the
        optimizer's step, a clamp) moves its counter; commlab's own copies write the local
        tensors below DTensor's dispatch, which moves none."""
        return sum(dp._version for dp in self.sharded)

    def edited(self) -> bool:
        """Stages 1-2: the rank's rows were written since the replica was last made current (by
        something other than commlab's own gathers and loads: an init, a clamp, an EMA swap)."""
        return self.stage < 3 and self._rows_version() != self.seen_version

    # --- gradients -----------------------------------------------------------------------
    def add_gradient(self, slot: int) -> None:
        """Copy parameter ``slot``'s accumulated gradient into the bucket, pre-divided by the
        data-parallel size (``divisor``) as torch's DDP does it (a multiplication by 1/N while copying: reducer.cpp's
        copy_grad_to_bucket), so that the sums are the same numbers DDP's are. Stage 1 all-reduces,
        which needs no rank-major order: its buffer is in parameter order and the full reduced
        gradient stays as the parameters' .grad (ZeRO-1); stages 2-3 copy into the rank-major
        order the reduce-scatter needs, and drop the parameter's own."""
        self._ensure_grad_buffer()
        p, grad = self.params[slot], self._gradient(slot)
        if self.stage == 1:
            o = self.layout.offsets[slot]
            view = self.grad_buffer[o : o + p.numel()].view(p.shape)
            copies.scaled_copy(view, grad, 1.0 / self.divisor)
            # Mixed precision: the reduced gradient's dtype is not the compute parameter's.
            p.grad = view if view.dtype == p.dtype else None
        else:
            copies.copy_in(self.grad_buffer, self.layout, slot, grad, 1.0 / self.divisor)
            p.grad = None

    def hold_gradient(self, slot: int) -> None:
        """Inside ``no_sync()``, where the reduction's dtype is not the computation's: parameter
        ``slot``'s gradient moves into a sum of its own in the reduction's dtype, so micro-batches
        add in fp32, not in 16 bits (fully_shard's to_accumulated_grad_if_needed and
        accumulate_unsharded_grad_if_needed, torch/distributed/fsdp/_fully_shard/_fsdp_param.py).
        Otherwise autograd's ``.grad`` accumulates, as without a wrapper."""
        p = self.params[slot]
        if p.grad is None or p.grad.dtype == self.dtypes.reduce:
            return
        with torch.no_grad():
            if slot in self.held:
                self.held[slot].add_(p.grad)
            else:
                self.held[slot] = p.grad.to(self.dtypes.reduce)
        p.grad = None

    def has_gradient(self, slot: int) -> bool:
        return self.params[slot].grad is not None or slot in self.held

    def _gradient(self, slot: int) -> torch.Tensor:
        """What the reduction of ``slot`` reads: autograd's gradient, added to no_sync()'s sum."""
        grad, held = self.params[slot].grad, self.held.pop(slot, None)
        if held is None:
            return grad
        if grad is not None:
            held.add_(grad)
        return held

    def _ensure_grad_buffer(self) -> None:
        if self.grad_buffer is None:  # every element is written (a gradient or zeros) before the reduction reads it
            size = self.layout.total if self.stage == 1 else self.layout.padded
            self.grad_buffer = torch.empty(size, dtype=self.dtypes.reduce, device=self.full.device)

    def add_zero_gradient(self, slot: int) -> None:
        """Zeros in parameter ``slot``'s place in the gradient buffer (no gradient of it here): the
        parameter's own .grad is left as it is."""
        self._ensure_grad_buffer()
        p = self.params[slot]
        if self.stage == 1:
            o = self.layout.offsets[slot]
            self.grad_buffer[o : o + p.numel()].zero_()
        else:
            zero = torch.zeros((), dtype=p.dtype, device=p.device)  # on the bucket's device: no host copy
            copies.copy_in(self.grad_buffer, self.layout, slot, zero.expand(p.shape))

    def launch_reduction(self):
        """Stage 1 all-reduces the whole buffer; stages 2-3 reduce-scatter it into a new shard;
        with a replicate group, the result's all-reduce across replicas follows (a Replication)."""
        assert self.grad_buffer is not None
        if self.stage == 1:
            target, work = self.grad_buffer, comm.all_reduce(self.grad_buffer, self.group, self.algorithm)
        else:
            target = self.reduced = torch.empty(self.layout.shard_size, dtype=self.dtypes.reduce, device=self.full.device)
            work = comm.reduce_scatter(self.reduced, self.grad_buffer, self.group, self.algorithm)
        if self.replicate_group is not None:
            self.replication = Replication(work, target, self.replicate_group, self.algorithm)
        return work

    def finish_reduction(self) -> Replication | None:
        """After the reduction's wait: each DTensor's gradient, this rank's rows of the averaged
        gradient (accumulated into one already there, as torch's .grad is); stages 2-3 drop the
        full gradient buffer. With a replicate group, the first call (after the shard group's
        reduction) drops the full buffer (stages 2-3) and returns the Replication it started,
        whose wait the second call follows."""
        if self.replication is not None:
            follow, self.replication = self.replication.start(), None
            if self.stage != 1:
                self.grad_buffer = None  # only the reduced shard travels on
            return follow
        with torch.no_grad():
            for i, (p, dp) in enumerate(zip(self.params, self.sharded)):
                if i in self.no_gradient:  # no rank had one: its .grad stays, as under fully_shard
                    continue
                if self.stage == 1:
                    o = self.layout.offsets[i]
                    piece = self._local_rows(self.grad_buffer[o : o + p.numel()], i)
                else:
                    piece = copies.in_shard(self.reduced, self.layout, i, self.rank)
                piece = piece.to(self.dtypes.master)  # a view when the reduction ran in it
                if dp.grad is None:
                    dp.grad = as_dtensor(piece, self.mesh, p)
                else:
                    dp.grad.to_local().add_(piece)
                # Autograd never accumulates into the DTensor (the forward computes on the whole
                # tensor), so its post-accumulate-grad hooks run here, on the reduced rows, as
                # fully_shard runs them after its reduce-scatter (_fsdp_collectives.py): an
                # optimizer stepped in backward sees the averaged gradient.
                for hook in (getattr(dp, "_post_accumulate_grad_hooks", None) or {}).values():
                    hook(dp)
        self.reduced = None
        if self.stage != 1:
            self.grad_buffer = None
        return None

    def drop_full_gradients(self) -> None:
        """The module's full gradients go (the shards' stay): stage 1 at the next forward, any
        stage after a backward that left the bucket incomplete."""
        for p in self.params:
            p.grad = None
        self.held.clear()
        self.grad_buffer = self.replication = None

    # --- state ---------------------------------------------------------------------------
    def write_full(self, values: list[torch.Tensor]) -> None:
        """Set every parameter of the bucket (all ranks pass the same values): the rank's rows,
        and the replica where it is gathered."""
        with torch.no_grad():
            if self.gathered:
                for whole, value in zip(self._wholes(), values):
                    whole.copy_(value)
            if self.shard is not None:
                for i, value in enumerate(values):
                    self.local(i).copy_(self._local_rows(value.detach().contiguous(), i))
        self.seen_version = self._rows_version()
