"""The join steps (commlab/ddp/join.py) see a DDP only through the JoinPort it hands over.

A fake port (a recording reducer, buffers, a state, a joinable that refuses to be read) drives
the joined rank's hooks on 2 Gloo ranks, while the other rank issues by hand what a DDP still
training issues; torch DDP's own join behaviour is held by tests/ddp/test_parity.py's join cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.ddp import join
from tests.support.import_graph import import_graph


class _Opaque:
    """A joinable the hooks may hand to torch but never read."""

    def __getattr__(self, name):
        raise AssertionError(f"the join steps read joinable.{name}")


class _Usage:
    def __init__(self, used: torch.Tensor):
        self.tracking, self.used = True, used

    def local_used_map(self, device):
        return self.used


class _Reducer:
    """The reducer's public face that the joined rank uses, recording what it was asked."""

    def __init__(self, rank: int):
        self.calls: list[str] = []
        self.buckets, self.comm_hook, self.comm_state, self.comm_groups, self.algorithm = [], None, None, [], "native"
        self.usage = _Usage(torch.tensor([1.0 - rank, float(rank)]))

    def maybe_rebuild(self):
        self.calls.append("maybe_rebuild")

    def complete_ready_order(self):
        self.calls.append("complete_ready_order")


def _rank() -> dict:
    rank = dist.get_rank()
    reducer, flags = _Reducer(rank), []
    buffers, state = [torch.full((3,), float(rank))], [torch.full((2,), 10.0 + rank)]
    port = join.JoinPort(_Opaque(), dist.group.WORLD, torch.device("cpu"), reducer, True,
                         sync_buffers=lambda: buffers, final_state=lambda: state, set_forward_param_sync=flags.append)
    hook = join.DDPJoinHook(port)
    if rank == 0:  # joined: shadows one synchronised iteration of rank 1, then the end
        hook.main_hook()
        hook.post_hook(is_last_joiner=False)
    else:  # still training: what DDP's forward and backward issue, in their order
        source = join.common_rank(port, True)
        from commlab.ddp.sync import broadcast_coalesced

        broadcast_coalesced(buffers, port.group, source)
        join.announce_sync(port, True)
        dist.all_reduce(reducer.usage.used)  # the used map of find_unused_parameters
        hook.post_hook(is_last_joiner=True)
    return {"calls": reducer.calls, "flags": flags, "buffers": buffers[0].tolist(), "state": state[0].tolist(),
            "used": reducer.usage.used.tolist()}


@pytest.mark.slow
def test_the_joined_rank_matches_a_training_rank_through_the_port_alone():
    joined, training = commlab.launch(_rank, world_size=2, backend="gloo", timeout=120)
    assert joined["calls"] == ["maybe_rebuild", "complete_ready_order"] and joined["flags"] == [True]
    assert joined["buffers"] == training["buffers"] == [1.0] * 3  # the training rank's buffers
    assert joined["state"] == training["state"] == [11.0] * 2  # the last joiner's state
    assert joined["used"] == training["used"] == [1.0, 1.0]  # its own map reduced with the other's


def test_join_does_not_import_the_ddp_that_imports_it():
    assert "commlab.ddp.distributed" not in import_graph()["commlab.ddp.join"]
    fields = [f for f in join.JoinPort.__dataclass_fields__]
    assert fields == ["joinable", "group", "device", "reducer", "divide_by_initial_world_size", "sync_buffers",
                      "final_state", "set_forward_param_sync"]
