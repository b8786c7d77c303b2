"""Robustness of the collectives and DDP, and the timing definitions.

Pure checks run in-process; the rest share one world-2 Gloo spawn (``_ranks``) that returns what
it saw. Each check names the point it holds and fails without that point's fix: without the
ordered path (10) the unused-parameter all-reduce runs while ring buckets are on the worker;
without tags (11) the collective after a failed one reads the failed one's message and hangs or
gets wrong data; without re-entrance (12) the callback waits for the worker it runs on; without
chunks (13) one broadcast carries every tensor; without the worker's start stamp (17) a queued
bucket is "launched" before the one ahead of it is done.
"""

from __future__ import annotations

import copy
import datetime
import gc
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import commlab
from commlab import collectives as C
from commlab.collectives import wait_future
from commlab.collectives import worker as W
from commlab.collectives.p2p import Comm
from commlab.ddp import sync
from commlab.ddp.timing import CpuClock, RawIteration, resolve
from commlab.models import mlp

from tests.support.helpers import error_of


# -- pure ------------------------------------------------------------------------------------
def test_broadcast_chunks_cap_each_flat_copy_and_keep_kinds_apart():  # point 13
    f, d = torch.float32, torch.float64
    ts = [torch.zeros(10, dtype=f), torch.zeros(20, dtype=f), torch.zeros(5, dtype=d), torch.zeros(30, dtype=f),
          torch.zeros(100, dtype=f), torch.zeros(1, dtype=d)]  # fmt: skip
    # 100 bytes: 40 + 80 > 100 closes the first float chunk; the 400-byte tensor is alone.
    assert sync.broadcast_chunks(ts, 100) == [[0], [1], [2, 5], [3], [4]]
    assert sync.broadcast_chunks(ts, 10**9) == [[0, 1, 3, 4], [2, 5]]
    assert sync.BROADCAST_CHUNK_BYTES == 250 * 1024 * 1024  # torch's _sync_module_states bucket
    with pytest.raises(ValueError, match="positive"):
        sync.broadcast_chunks(ts, 0)


def test_timing_columns_follow_their_definitions():  # point 17
    # Stamps are seconds on a CPU clock; t0 = 10.
    raw = RawIteration(
        start=10.0, forward_end=11.0, end=20.0,
        buckets=[(100, 2, 12.0, 12.5, 14.0, 12.2), (50, 1, 13.0, 14.0, 17.0)],
        backward_end=15.0, unused=(17.0, 17.5), write_back=[(17.5, 18.0), (18.0, 19.0)],
    )  # fmt: skip
    t = resolve(CpuClock(), raw)
    assert (t.forward, t.backward_compute, t.comm, t.total) == (1.0, 4.0, 4.5, 10.0)
    assert t.exposed_comm == 2.0  # backward end (15) -> last done (17)
    assert (t.unused_allreduce, t.write_back) == (0.5, 1.5)
    assert [(b.ready, b.launched, b.done) for b in t.buckets] == [(2.0, 2.5, 4.0), (3.0, 4.0, 7.0)]
    assert t.buckets[0].queued == pytest.approx(2.2) and t.buckets[1].queued != t.buckets[1].queued  # NaN: not given
    # Every bucket done before backward ends: nothing exposed (not negative).
    early = RawIteration(10.0, 11.0, 20.0, [(8, 1, 12.0, 12.0, 13.0)], backward_end=15.0)
    assert resolve(CpuClock(), early).exposed_comm == 0.0
    row = t.as_row()
    for column in ("forward", "backward_compute", "comm", "exposed_comm", "total", "write_back", "unused_allreduce"):
        assert column in row  # the sweep's CSV columns keep their names; two are new


def test_a_job_queued_from_a_callback_on_the_worker_runs_inline():  # point 12, no processes
    worker = W.CommWorker("test-worker", timeout=5.0)
    seen = []
    try:
        gate = threading.Event()
        first = worker.submit(lambda: gate.wait(5))
        # Registered before the job completes, so it runs on the worker thread.
        chained = first.then(lambda _: (worker.run_inline(lambda: seen.append("blocking")),
                                        worker.submit(lambda: seen.append("async")).wait()))  # fmt: skip
        gate.set()
        wait_future(chained, 10.0, "chained callback")
        assert seen == ["blocking", "async"]
        # The chained future completes inside the first job's set_result, on the worker thread,
        # a moment before that thread marks itself inactive: wait (bounded) for it to get there.
        deadline = time.monotonic() + 5.0
        while not worker.idle() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert worker.idle()
    finally:
        worker.stop()
    assert not worker.alive()


# -- world of two -----------------------------------------------------------------------------
class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.dead, self.b = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _data(step):
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)


def _train(ddp, steps=3):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def _ordered_path():
    """Point 10: every collective DDP issues on its group waits for the group's worker."""
    violations = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}

    def spy(name):
        def call(tensor, *args, group=None, **kwargs):
            w = W._WORKERS.get(dist.group.WORLD if group is None else group)
            if w is not None and not w.on_worker() and not w.idle():
                violations.append(name)
            return real[name](tensor, *args, group=group, **kwargs)

        return call

    torch.manual_seed(0)
    ddp = commlab.DistributedDataParallel(_Branchy(), bucket_cap_mb=0.1, find_unused_parameters=True,
                                          algorithm="ring", overlap=False)  # fmt: skip
    for name in real:
        setattr(dist, name, spy(name))
    try:
        _train(ddp, 2)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    t = ddp.iteration_timings[-1]
    return {"violations": violations, "unused_allreduce": t.unused_allreduce, "buckets": len(t.buckets),
            "grads_none": [p.grad is None for p in ddp.module.dead.parameters()]}  # fmt: skip


def _join_flags_ordered():
    """Point 10 for join(): every flag collective goes through the group's ordered path (on the
    worker or in run_ordered), except torch's own Join loop count, issued when nothing is in flight."""
    local = threading.local()
    real_inline = W.CommWorker.run_inline

    def inline(self, job):
        def flagged():
            local.on = True
            try:
                return job()
            finally:
                local.on = False

        return real_inline(self, flagged)

    calls, real = [], dist.all_reduce

    def spy(tensor, *args, **kwargs):
        ordered = getattr(local, "on", False) or any(w.on_worker() for w in list(W._WORKERS.values()))
        calls.append((sys._getframe(1).f_code.co_name, ordered))
        return real(tensor, *args, **kwargs)

    torch.manual_seed(0)
    ddp = commlab.DistributedDataParallel(_Branchy(), bucket_cap_mb=0.1, find_unused_parameters=True, algorithm="ring")
    W.CommWorker.run_inline, dist.all_reduce = inline, spy
    try:
        with ddp.join():
            _train(ddp, 1 + 2 * dist.get_rank())  # rank 0 joins early, shadows rank 1's steps
    finally:
        W.CommWorker.run_inline, dist.all_reduce = real_inline, real
    return {"unordered": sorted({name for name, ordered in calls if not ordered}), "calls": len(calls)}


def _timing_and_bounds():
    """Point 17: launched is when the worker starts a bucket; the history is bounded."""
    import commlab.ddp.reducer as reducer_module

    saved = reducer_module.MAX_ITERATIONS
    reducer_module.MAX_ITERATIONS = 3
    try:
        torch.manual_seed(0)
        ddp = commlab.DistributedDataParallel(mlp(4, 256, in_features=64, classes=4), bucket_cap_mb=0.2,
                                              algorithm="ring", overlap=False)  # fmt: skip
        _train(ddp, 5)
    finally:
        reducer_module.MAX_ITERATIONS = saved
    timings = ddp.iteration_timings
    t = timings[-1]
    b = t.buckets
    return {
        "kept": len(timings),
        "buckets": len(b),
        # overlap=False queues every bucket at once: each starts after the one before is done.
        "serial": all(b[k].launched >= b[k - 1].done for k in range(1, len(b))),
        "ordered": all(x.ready <= x.queued <= x.launched <= x.done for x in b),
        "write_back": t.write_back,
        "exposed": t.exposed_comm,
        "backward_end": t.forward + t.backward_compute,
        "last_done": max(x.done for x in b),
    }


def _stale_message_after_failure():
    """Point 11: a collective that failed with receives posted leaves nothing for the next one."""
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=5))
    rank, peer = dist.get_rank(), 1 - dist.get_rank()

    def fail(flat, tag):  # posts a receive, then fails on both ranks (e.g. a bad reduction)
        Comm.of(short, tag).post(recvs=[(torch.empty(4), peer)])
        raise RuntimeError("injected failure")

    first = error_of(lambda: W.run_collective(fail, torch.zeros(8), short, False))
    x = torch.arange(8, dtype=torch.float32) + 10 * rank
    then = error_of(lambda: C.all_reduce(x, "sum", algorithm="ring", group=short))
    return {"first": first, "then": then, "value": x.tolist()}


def _reentrant_callbacks():
    """Point 12: blocking and async collectives from future callbacks on the worker thread."""
    rank = dist.get_rank()
    gate = W.worker_for(None).submit(lambda: time.sleep(0.3))  # keeps the next job queued
    x, y, z = torch.full((5,), 1.0 + rank), torch.full((3,), 2.0 + rank), torch.full((7,), 3.0 + rank)

    def callback(fut):
        C.all_reduce(y, "sum", algorithm="tree")  # blocking, from the worker thread
        C.all_reduce(z, "max", algorithm="halving_doubling", async_op=True).wait()
        return fut.value()

    chained = C.all_reduce(x, "sum", algorithm="ring", async_op=True).get_future().then(callback)
    outcome = error_of(lambda: wait_future(chained, 30.0, "chained callback"))
    gate.wait()
    return {"outcome": outcome, "x": x.tolist(), "y": y.tolist(), "z": z.tolist()}


def _hook_with_blocking_callback():
    """Point 12 inside DDP: a comm hook whose callback runs a blocking collective; same result as
    torch's DDP with its default averaging."""
    def hook(_state, bucket):
        def finish(fut):
            flag = torch.ones(1)
            C.all_reduce(flag, "sum", algorithm="tree")  # e.g. a norm or a flag, blocking
            return fut.value().div_(flag.item())  # the flag sums to the world size

        return C.all_reduce(bucket.buffer(), "sum", algorithm="ring", async_op=True).get_future().then(finish)

    def blocking_hook(_state, bucket):  # blocking in the hook itself, behind async buckets
        flag = torch.ones(1)
        C.all_reduce(flag, "sum", algorithm="halving_doubling")
        return C.all_reduce(bucket.buffer().div_(flag.item()), "sum", algorithm="ring", async_op=True).get_future()

    torch.manual_seed(0)
    model = mlp(3, 64, in_features=64, classes=4)
    theirs = TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.02)
    _train(theirs, 3)
    diffs = []
    for h in (hook, blocking_hook):
        ours = commlab.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.02)
        ours.register_comm_hook(None, h)
        _train(ours, 3)
        diffs.append(max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters())))
    return max(diffs)


def _chunked_broadcast():
    """Point 13: each broadcast carries one chunk, and rank 0's values arrive."""
    rank = dist.get_rank()
    ts = [torch.full((n,), float(rank)) for n in (10, 20, 30, 100)] + [torch.full((3,), rank, dtype=torch.int64)]
    sizes = []
    real = dist.broadcast

    def spy(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    dist.broadcast = spy
    try:
        sync.broadcast_coalesced(ts, None, limit=128)
    finally:
        dist.broadcast = real
    return {"sizes": sizes, "synced": all(bool((t == 0).all()) for t in ts)}


def _failure_names_bucket_and_algorithm():
    """Point 11: a collective that fails on one rank raises on every rank, naming the bucket and
    the algorithm (rank 1's reduction fails; rank 0 then times out on the group)."""
    import commlab.collectives.ring as ring

    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    torch.manual_seed(0)
    ddp = commlab.DistributedDataParallel(mlp(2, 32, in_features=64, classes=4), process_group=short,
                                          algorithm="ring")  # fmt: skip
    real = ring.combine_
    if dist.get_rank() == 1:
        ring.combine_ = lambda *a: (_ for _ in ()).throw(RuntimeError("injected reduction failure"))
    try:
        x, y = _data(0)
        return error_of(lambda: nn.functional.cross_entropy(ddp(x), y).backward())
    finally:
        ring.combine_ = real


def _release_on_delete():
    """Point 11: a dropped DDP stops the workers of the groups it created."""
    torch.manual_seed(0)
    ddp = commlab.DistributedDataParallel(mlp(3, 64, in_features=64, classes=4), bucket_cap_mb=0.02,
                                          algorithm="ring", round_robin_groups=2)  # fmt: skip
    _train(ddp, 2)
    groups = list(ddp.comm_groups)
    workers = [W._WORKERS[g] for g in groups]
    before = [w.alive() for w in workers]
    del ddp
    gc.collect()
    for w in workers:
        w._thread.join(5)
    pg_map = dist.distributed_c10d._world.pg_map
    return {"before": before, "after": [w.alive() for w in workers], "groups_left": [g in pg_map for g in groups],
            "in_table": [g in W._WORKERS for g in groups]}  # fmt: skip


def _ranks():
    out = {
        "ordered": _ordered_path(),
        "join": _join_flags_ordered(),
        "timing": _timing_and_bounds(),
        "reentrant": _reentrant_callbacks(),
        "hook": _hook_with_blocking_callback(),
        "chunks": _chunked_broadcast(),
        "release": _release_on_delete(),
        "stale": _stale_message_after_failure(),
    }
    out["failure"] = _failure_names_bucket_and_algorithm()  # breaks its group: last
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def world2():
    return commlab.launch(_ranks, world_size=2, backend="gloo", timeout=150)


@pytest.mark.slow
def test_ddp_collectives_wait_for_the_groups_worker(world2):  # point 10
    for out in world2:
        r = out["ordered"]
        assert r["violations"] == [] and r["buckets"] > 1
        assert r["unused_allreduce"] > 0 and r["grads_none"] == [True, True]


@pytest.mark.slow
def test_join_flag_collectives_take_the_ordered_path(world2):  # point 10, join()
    for out in world2:
        assert out["join"]["unordered"] in ([], ["_get_num_nonjoined_procs"]), out["join"]
        assert out["join"]["calls"] > 5


@pytest.mark.slow
def test_launched_is_the_real_start_and_history_is_bounded(world2):  # point 17
    for out in world2:
        r = out["timing"]
        assert r["kept"] == 3 and r["buckets"] > 1
        assert r["serial"] and r["ordered"] and r["write_back"] > 0
        assert r["exposed"] == pytest.approx(max(0.0, r["last_done"] - r["backward_end"]))


@pytest.mark.slow
def test_no_stale_message_reaches_the_collective_after_a_failure(world2):  # point 11
    for rank, out in enumerate(world2):
        r = out["stale"]
        assert "injected failure" in r["first"]
        assert r["then"] == "no error", rank
        assert r["value"] == [10.0 + 2 * i for i in range(8)]


@pytest.mark.slow
def test_a_failed_bucket_raises_on_every_rank_naming_bucket_and_algorithm(world2):  # point 11
    for rank, out in enumerate(world2):
        message = out["failure"]
        assert "bucket 0 of 1" in message and "'ring'" in message and f"on rank {rank}" in message, message
    assert "injected reduction failure" in world2[1]["failure"]


@pytest.mark.slow
def test_a_dropped_ddp_releases_its_workers_and_groups(world2):  # point 11
    for out in world2:
        r = out["release"]
        assert r["before"] == [True, True]
        # Workers stop; the groups stay (destroying them would let torch reuse their names, see distributed.py).
        assert r["after"] == [False, False] and r["groups_left"] == [True, True] and r["in_table"] == [False, False]


@pytest.mark.slow
def test_collectives_from_callbacks_do_not_deadlock_the_worker(world2):  # point 12
    for out in world2:
        r = out["reentrant"]
        assert r["outcome"] == "no error"
        assert r["x"] == [3.0] * 5 and r["y"] == [5.0] * 3 and r["z"] == [4.0] * 7
        assert out["hook"] < 1e-6


@pytest.mark.slow
def test_construction_broadcast_goes_in_chunks(world2):  # point 13
    for out in world2:
        r = out["chunks"]
        # floats 40+80 B, 120 B, 400 B alone, int64 24 B: four broadcasts, none over 128 B but the lone tensor
        assert r["sizes"] == [120, 120, 400, 24] and r["synced"]
