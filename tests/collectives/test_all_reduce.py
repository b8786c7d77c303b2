"""All-reduce algorithms against dist.all_reduce on Gloo: the correctness matrix in a few spawns.

Each spawned function runs many cases and returns a dict of failures; the parent asserts. The
same code paths run on NCCL with CUDA tensors (see test_nccl_matches_native_on_gpus).
"""

import dataclasses
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

import commlab
from commlab import collectives as C
from commlab.collectives.p2p import Comm, release_group_state
from commlab.collectives.ring import all_reduce_ring
from commlab.collectives.tree import all_reduce_tree

from tests.support.helpers import error_of

ALGOS = ["ring", "tree", "halving_doubling", "native"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
_DIST_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _input(rank, numel, dtype, salt=0, device="cpu"):
    g = torch.Generator().manual_seed(1000 * rank + numel + salt)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 4).to(dtype).to(device)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype).to(device)


def _reference(x, op, group=None):
    ref = x.clone()
    dist.all_reduce(ref, _DIST_OP[op], group=group)
    if op == "avg":
        n = dist.get_world_size(group)
        ref = ref / n if ref.is_floating_point() else torch.div(ref, n, rounding_mode="floor")
    return ref


def _same(got, ref, op, world):
    if got.dtype != ref.dtype or got.shape != ref.shape:
        return False
    if not got.is_floating_point() or op in ("max", "min"):
        return torch.equal(got, ref)
    # Low-precision sums round once per received contribution, in an order that differs from
    # Gloo's: allow a few units in the last place of the largest partial sum.
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}.get(got.dtype, 1e-6) * world
    return torch.allclose(got.double(), ref.double(), rtol=tol, atol=tol * 8)


def _matrix(numels, group=None, salt=0, dtypes=DTYPES):
    """Every algorithm x dtype x op x numel, each algorithm both synchronously and asynchronously
    (alternating per case); returns the failing cases, and any algorithm not run both ways."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    bad = []
    covered = set()
    case = 0
    for numel in numels:
        for dtype in dtypes:
            for op in ("sum", "avg", "max", "min"):
                x = _input(rank, numel, dtype, salt)
                ref = _reference(x, op, group)
                case += 1
                for i, algo in enumerate(ALGOS):
                    got = x.clone()
                    async_op = (case + i) % 2 == 1  # alternate per case: every algorithm both ways
                    covered.add((algo, async_op))
                    if async_op:
                        handle = C.all_reduce(got, op, algorithm=algo, group=group, async_op=True)
                        out = handle.get_future().wait()
                        handle.wait()
                        if out is not got:
                            bad.append(("future value", algo))
                    else:
                        assert C.all_reduce(got, op, algorithm=algo, group=group) is None
                    if not _same(got, ref, op, world):
                        bad.append((algo, str(dtype), op, numel, "async" if async_op else "sync"))
    bad += [("not run", algo, mode) for algo in ALGOS for mode in (False, True) if (algo, mode) not in covered]
    return bad


def _world3():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"matrix": _matrix([0, 1, 2, 7, 1000, 4099])}
    comm = Comm.of(None)
    # Comm.of asks torch once per group (a collective's Comm differs only in its tag), and
    # release_group_state forgets the group, so a re-created group is asked again.
    cached = Comm.of(None) is comm and Comm.of(None, 9) == dataclasses.replace(comm, tag=9)
    release_group_state([dist.group.WORLD])
    again = Comm.of(None)
    out["comm_cache"] = (cached, again is not comm and again == comm)
    # Tiny pieces so pipelining crosses step boundaries and blocks have different piece counts.
    pieces_bad = []
    for numel in [1, 5, 13, 100]:
        for fn in (all_reduce_ring, all_reduce_tree):
            for piece_bytes in (8, 24):
                x = _input(rank, numel, torch.int64, 7)
                ref = _reference(x, "sum")
                fn(x, "sum", comm, piece_bytes=piece_bytes)
                pieces_bad += [] if torch.equal(x, ref) else [(fn.__name__, numel, piece_bytes)]
    out["pieces"] = pieces_bad
    # DDP's sparse gradient all-reduce queues behind a p2p bucket still on the worker instead of
    # waiting for it on the autograd thread (commlab.ddp.sparse.start_all_reduce).
    from commlab.collectives.worker import worker_for
    from commlab.ddp.sparse import start_all_reduce

    grad = torch.sparse_coo_tensor([[rank]], [float(rank + 1)], (4,))
    gate = threading.Event()
    blocker = worker_for(None).submit(lambda: gate.wait(20))
    t0 = time.monotonic()
    future = start_all_reduce(grad, None)
    returned = time.monotonic() - t0
    gate.set()
    blocker.wait()
    reduced = C.wait_future(future, 30.0, "sparse all-reduce")[0].to_dense()
    out["sparse_queued"] = (returned < 5.0, reduced.tolist())
    # Non-contiguous and multi-dimensional tensors are reduced in place through a copy.
    base = _input(rank, 60, torch.float64).view(6, 10)
    nc = base.t()
    ref = _reference(nc.contiguous(), "sum").view(10, 6)
    C.all_reduce(nc, "sum", algorithm="ring")
    out["noncontiguous"] = torch.allclose(base.t(), ref) and torch.allclose(nc, ref)
    # Building blocks against dist.all_reduce.
    x = _input(rank, 1001, torch.int64, 3)
    full = _reference(x, "sum")
    lo, hi = C.chunk_bounds(1001, world)[rank]
    mine = C.reduce_scatter(x, "sum")
    out["reduce_scatter"] = torch.equal(mine, full[lo:hi]) and mine.data_ptr() == x[lo:].data_ptr()
    y = torch.full((1001,), -1, dtype=torch.int64)
    y[lo:hi] = full[lo:hi]
    C.all_gather(y)
    out["all_gather"] = torch.equal(y, full)
    # Fewer elements than ranks: some ranks receive nothing but must still send their block.
    tiny_ok = []
    for numel in (1, 2):
        x = _input(rank, numel, torch.int64, 5)
        full = _reference(x, "sum")
        lo, hi = C.chunk_bounds(numel, world)[rank]
        tiny_ok.append(torch.equal(C.reduce_scatter(x, "sum"), full[lo:hi]))
        y = torch.full((numel,), -1, dtype=torch.int64)
        y[lo:hi] = full[lo:hi]
        C.all_gather(y)
        tiny_ok.append(torch.equal(y, full))
    out["fewer_elements_than_ranks"] = all(tiny_ok)
    roots_ok = []
    for root in range(world):
        z = _input(rank, 257, torch.float32, root)
        zref = _reference(z, "max")
        C.reduce(z, root, "max")
        b = torch.full((257,), float(rank))
        C.broadcast(b, root)
        roots_ok.append((rank != root or torch.equal(z, zref)) and bool((b == root).all()))
    out["reduce_broadcast_roots"] = all(roots_ok)
    # Many async collectives in flight from two threads' worth of submissions stay in order.
    tensors = [_input(rank, n, torch.int64, 11) for n in (3, 5000, 1, 70000, 0, 999)]
    refs = [_reference(t, "sum") for t in tensors]
    handles = [C.all_reduce(t, "sum", algorithm=ALGOS[i % 3], async_op=True) for i, t in enumerate(tensors)]
    C.all_reduce(torch.zeros(4), "sum", algorithm="tree")  # a blocking call queues behind them
    out["fifo"] = all(h.is_completed() for h in handles) and all(torch.equal(t, r) for t, r in zip(tensors, refs))
    out["worker_thread_daemon"] = all(t.daemon for t in threading.enumerate() if t.name.startswith("commlab-comm"))
    # Bad input: a clear ValueError before any message is sent.
    errors = {}
    for label, call in {
        "bool": lambda: C.all_reduce(torch.ones(3, dtype=torch.bool)),
        "complex": lambda: C.all_reduce(torch.ones(3, dtype=torch.complex64), algorithm="tree"),
        "op": lambda: C.all_reduce(torch.ones(3), "prod", algorithm="halving_doubling"),
        "algorithm": lambda: C.all_reduce(torch.ones(3), algorithm="butterfly"),
        "root": lambda: C.broadcast(torch.ones(3), src=world),
        "sparse": lambda: C.all_reduce(torch.ones(3).to_sparse()),
    }.items():
        try:
            call()
            errors[label] = "no error"
        except ValueError as e:
            errors[label] = str(e)
    out["errors"] = errors
    # A peer that never joins: the waiter gets the group's timeout error through the future (no
    # hang), and the broken group fails fast afterwards. Rank 1 of this group stays away.
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if rank == 0:
        handle = C.all_reduce(torch.ones(100), algorithm="ring", group=short, async_op=True)
        out["timeout"] = error_of(handle.wait)
        out["after_timeout"] = error_of(lambda: C.all_reduce(torch.ones(100), algorithm="tree", group=short))
    dist.barrier()  # on the world group: rank 1 stays alive (its pair open) until rank 0 is done
    return out


@pytest.mark.slow
def test_world_three_matrix_building_blocks_async_and_errors():
    results = commlab.launch(_world3, world_size=3, backend="gloo", timeout=180)
    for rank, out in enumerate(results):
        assert out["matrix"] == [], f"rank {rank}"
        assert out["pieces"] == []
        assert out["comm_cache"] == (True, True)
        assert out["sparse_queued"] == (True, [1.0, 2.0, 3.0, 0.0])
        assert out["noncontiguous"] and out["reduce_scatter"] and out["all_gather"] and out["fewer_elements_than_ranks"]
        assert out["reduce_broadcast_roots"] and out["fifo"] and out["worker_thread_daemon"]
        errors = out["errors"]
        assert "dtype torch.bool is not supported" in errors["bool"]
        assert "complex64" in errors["complex"]
        assert "unknown reduce op 'prod'" in errors["op"]
        assert "unknown all-reduce algorithm 'butterfly'" in errors["algorithm"]
        assert "src must be a group rank in [0, 3)" in errors["root"]
        assert "dense" in errors["sparse"]
    assert "Timed out" in results[0]["timeout"] and results[0]["after_timeout"] != "no error"


def _subgroup_and_large():
    rank = dist.get_rank()
    sub = dist.new_group([1, 2, 3])  # group ranks 0..2 are global ranks 1..3
    out = {}
    if rank != 0:
        out["sub_matrix"] = _matrix([0, 5, 1031], group=sub, salt=5)
        x = torch.full((10,), float(rank))
        C.broadcast(x, src=0, group=sub)  # group rank 0 is global rank 1
        out["sub_broadcast"] = bool((x == 1.0).all())
    else:
        try:
            C.all_reduce(torch.ones(3), group=sub)
            out["not_member"] = "no error"
        except ValueError as e:
            out["not_member"] = str(e)
    # >= 64 MB on the whole (power-of-two) world, against native.
    big = []
    x = _input(rank, 16 * 2**20 + 3, torch.float32, 9)  # 64 MB + 12 B
    ref = _reference(x, "sum")
    for algo in ("ring", "tree", "halving_doubling"):
        got = x.clone()
        C.all_reduce(got, "sum", algorithm=algo)
        big += [] if torch.allclose(got, ref, rtol=1e-5, atol=1e-4) else [algo]
    out["large"] = big
    return out


@pytest.mark.slow
def test_world_four_subgroup_and_64mb_messages():
    results = commlab.launch(_subgroup_and_large, world_size=4, backend="gloo", timeout=240)
    assert "not a member" in results[0]["not_member"]
    for rank, out in enumerate(results):
        assert out["large"] == [], f"rank {rank}"
        if rank:
            assert out["sub_matrix"] == [] and out["sub_broadcast"]


def _small_matrix():
    # Every dtype's full matrix runs at world 3; here the shapes of larger worlds: numel below the
    # world size (empty blocks) and not divisible by it, each op, each algorithm. A world of 8
    # also checks a 6-rank subgroup (a non-power of two, folded twice) without another spawn.
    world = dist.get_world_size()
    out = {"world": world, "matrix": _matrix([5, 1001], dtypes=[torch.int64])}
    if world == 8:
        sub = dist.new_group(list(range(2, 8)))
        out["sub6"] = _matrix([5, 1001], group=sub, dtypes=[torch.int64]) if dist.get_rank() >= 2 else []
    return out


@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.slow
def test_other_world_sizes(world):
    results = commlab.launch(_small_matrix, world_size=world, backend="gloo", timeout=240)
    assert [out["world"] for out in results] == [world] * world
    assert all(out["matrix"] == [] for out in results)
    if world == 8:
        assert all(out["sub6"] == [] for out in results)


def _nccl_matrix():
    rank = dist.get_rank()
    bad = []
    for algo in ALGOS:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = _input(rank, 1 << 20, dtype, device=f"cuda:{rank}")
            ref = _reference(x, "sum")
            C.all_reduce(x, "sum", algorithm=algo, async_op=True).wait()
            bad += [] if _same(x, ref, "sum", dist.get_world_size()) else [(algo, str(dtype))]
    return bad


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL path needs 2 CUDA devices")
@pytest.mark.slow
def test_nccl_matches_native_on_gpus():
    assert commlab.launch(_nccl_matrix, world_size=2, backend="nccl", timeout=180) == [[], []]
