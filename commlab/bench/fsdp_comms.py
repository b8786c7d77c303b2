"""torch's ``fully_shard`` on commlab's p2p collectives: its custom reduce-scatter and all-gather.

FSDP2 lets a module swap the two collectives it issues (``FSDPModule.set_custom_reduce_scatter``
and ``set_custom_all_gather``, torch/distributed/fsdp/_fully_shard/_fsdp_api.py): an object with
``allocate(size, dtype=, device=)`` for the flat buffer and ``__call__`` that fills the output the
way ``dist.reduce_scatter_single`` / ``dist.all_gather_single`` would. Here ``__call__`` runs
one of commlab's algorithms that provide both (commlab/collectives/scatter_gather.py), so that
``commlab bench sharded`` can put commlab's stage 3 and ``fully_shard`` on the same ring.

Both run the algorithm in place on a flat buffer, as commlab's stage 3 does
(commlab/sharded/comm.py): the reduce-scatter reduces into FSDP2's input (which FSDP2 does not
read again) and copies this rank's block out; the all-gather writes this rank's input into its
block of the output and gathers the rest around it.

Blocking calls (what FSDP2 issues on CPU: its reduce-scatter always, its all-gathers unless
``_set_unshard_async_op``) run on the calling thread, after whatever commlab queued on the group
before (commlab/collectives/worker.py ``run_collective``). An asynchronous call runs on the group's
worker and returns a torch ``Work`` made from its future, since FSDP2 waits only on that type.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
# The protocol classes are not exported by torch.distributed.fsdp in torch 2.13; _fully_shard.py
# types its setters with these.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from commlab.collectives import all_gather_body, check_scatter_gather, reduce_scatter_body, run_collective
from commlab.collectives.p2p import Comm

# torch's reduce op -> commlab's name; FSDP2 asks for AVG (fp32, bf16) or SUM (fp16, with its own
# pre- and post-division). PREMUL_SUM (a gradient divide factor) has no commlab counterpart.
_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def _op_name(op) -> str:
    for torch_op, name in _OPS.items():
        try:
            if op == torch_op:
                return name
        except TypeError:  # a PREMUL_SUM ReduceOp object does not compare with the plain kinds
            break
    raise ValueError(f"commlab's p2p reduce-scatter runs sum, avg, max and min, not {op!r}")


def _run(body, buffer: torch.Tensor, group, async_op: bool, what: str):
    handle = run_collective(body, buffer, group, async_op, what)
    if handle is None:
        return None
    return torch._C._distributed_c10d._create_work_from_future(handle.get_future())


class _Alloc:
    def __init__(self, algorithm: str):
        check_scatter_gather(algorithm)
        self.algorithm = algorithm

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class P2PReduceScatter(_Alloc, ReduceScatter):
    """``fully_shard``'s reduce-scatter as commlab's ``algorithm`` ("ring", "halving_doubling")."""

    def __call__(self, output_tensor, input_tensor, group, op=dist.ReduceOp.SUM, async_op=False):
        name, world = _op_name(op), group.size()
        if input_tensor.numel() != output_tensor.numel() * world:
            raise ValueError(f"reduce-scatter input of {input_tensor.numel()} elements for an output of "
                             f"{output_tensor.numel()} x {world} ranks")
        body, rank, n = reduce_scatter_body(self.algorithm), group.rank(), output_tensor.numel()

        def reduce(flat: torch.Tensor, tag: int) -> None:
            body(flat, name, Comm.of(group, tag))
            output_tensor.copy_(flat[rank * n : (rank + 1) * n])

        return _run(reduce, input_tensor, group, async_op,
                    f"{self.algorithm} reduce-scatter of {input_tensor.numel()} x {input_tensor.dtype}")


class P2PAllGather(_Alloc, AllGather):
    """``fully_shard``'s all-gather as commlab's ``algorithm`` ("ring", "halving_doubling")."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        world, n = group.size(), input_tensor.numel()
        if output_tensor.numel() != n * world:
            raise ValueError(f"all-gather output of {output_tensor.numel()} elements for an input of {n} x {world} ranks")
        own = output_tensor.view(-1)[group.rank() * n : (group.rank() + 1) * n]
        if own.data_ptr() != input_tensor.data_ptr():  # FSDP2 copies its input into the output's block
            own.copy_(input_tensor.view(-1))
        body = all_gather_body(self.algorithm)
        return _run(lambda flat, tag: body(flat, Comm.of(group, tag)), output_tensor, group, async_op,
                    f"{self.algorithm} all-gather of {output_tensor.numel()} x {output_tensor.dtype}")


def use_p2p_collectives(module, algorithm: str) -> None:
    """Every FSDP unit under ``module`` (itself included) issues ``algorithm``'s collectives."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_reduce_scatter(P2PReduceScatter(algorithm))
            unit.set_custom_all_gather(P2PAllGather(algorithm))
