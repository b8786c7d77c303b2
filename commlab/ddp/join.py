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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from commlab import collectives
from commlab.ddp import inflight
from commlab.ddp.bucket import Bucket
from commlab.ddp.sync import broadcast_coalesced

if TYPE_CHECKING:
    from commlab.ddp.distributed import DistributedDataParallel


def _ordered(ddp: DistributedDataParallel, issue):
    """Issue a flag collective on the group's one ordered path (commlab/collectives/worker.py):
    after the group's queued collectives, never inside another thread's p2p batch. torch's own Join loop (_get_num_nonjoined_procs) runs only once this rank's
    shadow collectives have completed, so nothing of the group is in flight then."""
    return collectives.run_ordered(ddp.process_group, issue)


def common_rank(ddp: DistributedDataParallel, candidate: bool) -> int:
    """The largest group rank among those passing ``candidate`` (torch's _find_common_rank)."""
    rank = torch.tensor([dist.get_rank(ddp.process_group) if candidate else -1], device=ddp.device)
    _ordered(ddp, lambda: dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=ddp.process_group))
    if rank.item() < 0:
        raise RuntimeError("join: no rank qualified as the source of the model state")
    return int(rank.item())


def notify(ddp: DistributedDataParallel) -> None:
    """Step 1 for a rank still training; sets this iteration's divide factor."""
    work = _ordered(ddp, lambda: Join.notify_join_context(ddp))
    reducer = ddp.reducer
    reducer.world_size = dist.get_world_size(ddp.process_group)
    if work is not None and not ddp._divide_by_initial_world_size:
        work.wait()
        reducer.world_size = int(work.get_future().value()[0].item())


def announce_sync(ddp: DistributedDataParallel, sync: bool) -> None:
    """Step 4 for a rank still training (torch waits on nothing here either)."""
    flag = torch.ones(1, device=ddp.device) if sync else torch.zeros(1, device=ddp.device)
    _ordered(ddp, lambda: dist.all_reduce(flag, group=ddp.process_group, async_op=True))


class DDPJoinHook(JoinHook):
    """What a joined rank does for each iteration the others still run, and at the end."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp, reducer = self.ddp, self.ddp.reducer
        reducer.maybe_rebuild()
        if ddp.forward_sync_buffers and ddp.require_forward_param_sync and ddp._module_buffers:
            broadcast_coalesced(ddp._module_buffers, ddp.process_group, common_rank(ddp, False))
        flag = torch.zeros(1, device=ddp.device)
        _ordered(ddp, lambda: dist.all_reduce(flag, group=ddp.process_group))
        ddp.require_forward_param_sync = sync = flag.item() != 0
        if not sync:
            return
        _shadow_buckets(ddp)
        if reducer.usage.tracking:
            # torch's joined rank reduces its own last local map, not zeros (_match_unused_params_allreduce)
            used = reducer.usage.local_used_map(ddp.device)
            _ordered(ddp, lambda: dist.all_reduce(used, group=ddp.process_group))
        if reducer.rebuild_pending and len(reducer._ready_order) != len(reducer.params):
            reducer._ready_order = list(range(len(reducer.params)))  # torch's _push_all_rebuilt_params

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        source = common_rank(ddp, is_last_joiner)
        state = [p.data for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
        broadcast_coalesced(state + (ddp._module_buffers if ddp.forward_sync_buffers else []), ddp.process_group, source)


def _shadow_buckets(ddp: DistributedDataParallel) -> None:
    """Step 5 for a joined rank: the reducer's all-reduces (or comm hook), on zeros."""
    reducer = ddp.reducer
    last = len(reducer.buckets) - 1
    pending = [
        inflight.start(Bucket(b.position, b.param_indices, b.params), last=last, hook=reducer.comm_hook,
                       state=reducer.comm_state, groups=reducer.comm_groups, algorithm=reducer.algorithm)[0]
        for b in reducer.buckets
    ]  # fmt: skip
    for future in pending:
        future.wait()
