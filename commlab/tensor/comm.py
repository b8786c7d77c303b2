"""The tensor-parallel group and its three collectives along a tensor dimension.

All-reduce runs any algorithm of commlab's registry (``"native"`` is the backend's own call).
All-gather and reduce-scatter work on flat buffers whose rank-r block is rank r's piece
(commlab/sharded/comm.py, which ZeRO issues too); here the piece is a block of one dimension
(the sequence, or the features), so that dimension is moved to the front, where the blocks are
contiguous. An all-reduce-only algorithm (the tree), or halving-doubling on a group that is not
a power of two, gathers and scatters on the ring: the only p2p algorithms that provide both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from commlab import collectives
from commlab.sharded import comm as flat
from commlab.tensor.shards import check_divides


@dataclass(frozen=True)
class TPGroup:
    """A process group (None: the world), its size and this rank's place, and the algorithm; ``site``
    and ``recorder``: the module whose collectives these are and where their stamps go (timing.py)."""

    group: object
    size: int
    rank: int
    algorithm: str = "native"
    site: str = ""
    recorder: object = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, group=None, algorithm: str = "native") -> TPGroup:
        collectives.get_algorithm(algorithm)  # ValueError naming the registered ones
        if not dist.is_initialized():
            raise RuntimeError("tensor parallelism needs an initialised process group (use commlab.launch)")
        return cls(group, dist.get_world_size(group), dist.get_rank(group), algorithm)

    def at(self, site: str, recorder=None) -> TPGroup:
        """The same group, its collectives stamped as ``site``'s in ``recorder`` (None: not stamped)."""
        return replace(self, site=site, recorder=recorder)

    def _run(self, kind: str, tensor: torch.Tensor, call):
        if self.recorder is None:
            return call()
        return self.recorder.timed(self.site, kind, tensor.nbytes, call)

    @property
    def scatter_gather(self) -> str:
        """The algorithm that gathers and scatters: this one where it provides both, else the ring."""
        return self.algorithm if self.algorithm in flat.algorithms_for(self.size) else "ring"

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place over the group ("sum" or "max"); returns it."""
        if self.size > 1:
            self._run("all_reduce", tensor,
                      lambda: collectives.all_reduce(tensor, op, algorithm=self.algorithm, group=self.group))
        return tensor

    def all_gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``local`` concatenated along ``dim``, rank 0's first."""
        if self.size == 1:
            return local
        dim %= local.dim()
        blocks = local.new_empty((self.size, *local.shape))
        blocks[self.rank].copy_(local)
        self._run("all_gather", local, lambda: flat.all_gather(blocks.view(-1), blocks[self.rank].view(-1), self.group,
                                                               self.scatter_gather).wait())
        return blocks.movedim(0, dim).flatten(dim, dim + 1)

    def reduce_scatter(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's block along ``dim`` of the sum over the group of ``full``."""
        if self.size == 1:
            return full
        dim %= full.dim()
        check_divides(self.size, full.shape[dim], f"the length of dimension {dim} of a {tuple(full.shape)} activation")
        blocks = full.unflatten(dim, (self.size, -1)).movedim(dim, 0).contiguous()
        mine = blocks.new_empty(blocks.shape[1:])
        self._run("reduce_scatter", full,
                  lambda: flat.reduce_scatter(mine.view(-1), blocks.view(-1), self.group, self.scatter_gather).wait())
        return mine

    def own_block(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's block along ``dim`` (a copy: the caller may free ``full``)."""
        if self.size == 1:
            return full
        check_divides(self.size, full.shape[dim], f"the length of dimension {dim % full.dim()} of a "
                      f"{tuple(full.shape)} activation")
        return full.chunk(self.size, dim)[self.rank].contiguous()
