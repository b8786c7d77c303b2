"""Uneven inputs: commlab's DDP under torch's Join context manager (the Joinable protocol).

Inside ``with ddp.join():`` a rank that has run out of data keeps matching, in the same order,
every collective that the ranks still training issue in one iteration (torch's _DDPJoinHook in
torch/nn/parallel/distributed.py, and torch/distributed/algorithms/join.py):

  still training (forward/backward)               joined (Join.__exit__ loop, main_hook)
  1. all-reduce 1 (notify_join_context)            all-reduce 0: how many still train
  2. bucket rebuild broadcast, once                the same rebuild, once
  3. max-rank all-reduce, buffer broadcast         the same, with rank -1
  4. all-reduce 1 if this backward syncs           all-reduce 0, wait: sync this time?
  5. bucket all-reduces (algorithm, groups)        all-reduces of zeros, same buckets
  6. used-map all-reduce (find_unused)             all-reduce of its last own map

Gradients are divided by the initial world size (torch's default) or, with
``divide_by_initial_world_size=False``, by the number of ranks still training (from step 1).
When every rank has joined, the last joiner's parameters and buffers are broadcast to all.

These steps see the DDP only through the :class:`JoinPort` it hands over (group, device, reducer,
its flags as callables), so this module does not import the DDP that imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from commlab import collectives
from commlab.ddp import inflight
from commlab.ddp.bucket import Bucket
from commlab.ddp.reducer import Reducer
from commlab.ddp.sync import broadcast_coalesced


@dataclass(frozen=True)
class JoinPort:
    """What the join steps may see of one DDP, handed over by it (commlab/ddp/distributed.py).

    ``joinable`` is only passed on to torch's ``Join.notify_join_context``; the reducer is used
    through its public methods and attributes. The callables read the DDP's flags when called:
    ``sync_buffers()`` is what a forward would broadcast now (empty when it would not),
    ``final_state()`` what the last joiner broadcasts at the end, and
    ``set_forward_param_sync(flag)`` records whether the ranks still training synchronised.
    """

    joinable: Joinable
    group: dist.ProcessGroup
    device: torch.device
    reducer: Reducer
    divide_by_initial_world_size: bool
    sync_buffers: Callable[[], list[torch.Tensor]]
    final_state: Callable[[], list[torch.Tensor]]
    set_forward_param_sync: Callable[[bool], None]


def _ordered(port: JoinPort, issue):
    """Issue a flag collective on the group's one ordered path (commlab/collectives/worker.py):
    after the group's queued collectives, never inside another thread's p2p batch. torch's own Join loop (_get_num_nonjoined_procs) runs only once this rank's
    shadow collectives have completed, so nothing of the group is in flight then."""
    return collectives.run_ordered(port.group, issue)


def common_rank(port: JoinPort, candidate: bool) -> int:
    """The largest group rank among those passing ``candidate`` (torch's _find_common_rank)."""
    rank = torch.tensor([dist.get_rank(port.group) if candidate else -1], device=port.device)
    _ordered(port, lambda: dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=port.group))
    if rank.item() < 0:
        raise RuntimeError("join: no rank qualified as the source of the model state")
    return int(rank.item())


def notify(port: JoinPort) -> None:
    """Step 1 for a rank still training; sets this iteration's divide factor."""
    work = _ordered(port, lambda: Join.notify_join_context(port.joinable))
    reducer = port.reducer
    reducer.world_size = dist.get_world_size(port.group)
    if work is not None and not port.divide_by_initial_world_size:
        work.wait()
        reducer.world_size = int(work.get_future().value()[0].item())


def announce_sync(port: JoinPort, sync: bool) -> None:
    """Step 4 for a rank still training (torch waits on nothing here either)."""
    flag = torch.ones(1, device=port.device) if sync else torch.zeros(1, device=port.device)
    _ordered(port, lambda: dist.all_reduce(flag, group=port.group, async_op=True))


class DDPJoinHook(JoinHook):
    """What a joined rank does for each iteration the others still run, and at the end."""

    def __init__(self, port: JoinPort):
        self.port = port

    def main_hook(self) -> None:
        port, reducer = self.port, self.port.reducer
        reducer.maybe_rebuild()
        buffers = port.sync_buffers()
        if buffers:
            broadcast_coalesced(buffers, port.group, common_rank(port, False))
        flag = torch.zeros(1, device=port.device)
        _ordered(port, lambda: dist.all_reduce(flag, group=port.group))
        sync = flag.item() != 0
        port.set_forward_param_sync(sync)
        if not sync:
            return
        _shadow_buckets(reducer)
        if reducer.usage.tracking:
            # torch's joined rank reduces its own last local map, not zeros (_match_unused_params_allreduce)
            used = reducer.usage.local_used_map(port.device)
            _ordered(port, lambda: dist.all_reduce(used, group=port.group))
        reducer.complete_ready_order()

    def post_hook(self, is_last_joiner: bool) -> None:
        port = self.port
        source = common_rank(port, is_last_joiner)
        broadcast_coalesced(port.final_state(), port.group, source)


def _shadow_buckets(reducer: Reducer) -> None:
    """Step 5 for a joined rank: the reducer's all-reduces (or comm hook), on zeros."""
    last = len(reducer.buckets) - 1
    pending = [
        inflight.start(Bucket(b.position, b.param_indices, b.params), last=last, hook=reducer.comm_hook,
                       state=reducer.comm_state, groups=reducer.comm_groups, algorithm=reducer.algorithm)[0]
        for b in reducer.buckets
    ]  # fmt: skip
    for future in pending:
        future.wait()
