"""commlab.memtrack on known allocations, and the memory acceptance of sharded data parallelism
(one world-size-2 spawn: what the tracker sees inside collectives and autograd, and the measured
peak of a step by stage)."""

import gc
import sys

import pytest
import torch

import commlab
from commlab.memtrack import live_bytes, replay, track_peak
from commlab.sharded.memory_model import bucket_memory, zero_memory

MB = 2**20


@pytest.fixture
def no_traces_left():
    """Let go of the fake tensors an earlier test's torch.export left reachable: torch keeps its last
    trace in a module-level map and its shape environments in lru caches, and live_bytes, which
    walks every reachable tensor, cannot read a fake tensor's storage."""
    proxy_tensor = sys.modules.get("torch.fx.experimental.proxy_tensor")
    getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()
    symbolic_shapes = sys.modules.get("torch.fx.experimental.symbolic_shapes")
    for attr in vars(getattr(symbolic_shapes, "ShapeEnv", object)).values():
        if hasattr(attr, "cache_clear"):
            attr.cache_clear()
    gc.collect()


def test_peak_and_net_of_known_allocations_frees_backward_and_resizes(no_traces_left):
    with track_peak("cpu") as freed_first:  # 1 MB freed before 2 MB is allocated: peak 2 MB
        a = torch.empty(MB // 4)
        del a
        b = torch.empty(MB // 2)
    assert (freed_first.peak_bytes, freed_first.net_bytes) == (2 * MB, 2 * MB)
    with track_peak("cpu") as both:  # both alive at once: peak 3 MB, 2 MB left
        a = torch.empty(MB // 4)
        c = torch.empty(MB // 2)
        del a
    assert (both.peak_bytes, both.net_bytes) == (3 * MB, 2 * MB)
    w = torch.randn(512, 512, requires_grad=True)
    with track_peak("cpu") as backward:  # autograd allocates the 1 MB gradient inside backward
        (w * 2).sum().backward()
    assert MB <= backward.peak_bytes < MB + 4096 and backward.net_bytes == MB
    storage = c.untyped_storage()
    with track_peak("cpu") as resized:  # stage 3 frees and re-gathers by resizing storages in place
        storage.resize_(0)
        storage.resize_(4 * MB)
    assert (resized.peak_bytes, resized.net_bytes) == (2 * MB, 2 * MB)
    before = live_bytes("cpu")
    d = torch.empty(MB // 4)
    assert live_bytes("cpu") - before == MB
    del b, c, d


def test_replay_and_bad_device():
    assert replay([(2, -5), (0, 10), (1, 3)]) == (13, 8)  # in time order, whatever the input's
    assert replay([(0, -4)]) == (0, -4)  # never above the start: peak 0
    with pytest.raises(ValueError, match="meta"):
        with track_peak("meta"):
            pass


@pytest.fixture(scope="module")
def world2():
    from tests.support import memtrack_cases

    return commlab.launch(memtrack_cases.run_world2, world_size=2, backend="gloo", timeout=300)


@pytest.mark.slow
def test_the_tracker_sees_collective_outputs_and_backward_in_ranks(world2):
    for rank in world2:
        # The functional all-gather allocates its 2 x 256 KiB output inside the op.
        assert rank["seen"]["gathered"] >= 2**18 * 4 * 2 // 2  # at least the 512 KiB output
        assert rank["seen"]["backward"] >= MB
        for stage in rank["stages"][1:]:
            assert stage["untracked"] is None  # ShardedMemory.peak only inside track_memory


@pytest.mark.slow
def test_sharding_lowers_the_measured_peak_below_ddp(world2):
    for rank in world2:
        peaks = {s["stage"]: s["peak"] for s in rank["stages"]}
        assert all(peaks[0] > peaks[s] for s in (1, 2, 3)), peaks


# ProcessGroupGloo's default worker threads (torch/csrc/distributed/c10d/ProcessGroupGloo.hpp,
# Options::threads; dist.ProcessGroupGloo._Options()._threads).
GLOO_THREADS = 2


def _stage3_bound(s) -> float:
    """Stage 3's bound: the ZeRO model (fp32 Adam: 16 bytes per parameter over N ranks) plus the
    bucket terms (prefetch + 1 gathered buckets, one full gradient bucket, padding) plus
    activations (the batch through every layer, input and output saved: 2 x batch x width x
    (depth + 1) x 4 bytes), one parameter's own gradient before it is copied into its bucket, two
    shard-sized Adam temporaries (torch's single-tensor Adam: the square root, then its quotient)
    and what the native Gloo collectives allocate beside their outputs: a flat staging buffer of
    the full bucket per all-gather in flight (ProcessGroupGloo gathers into a new flat tensor, then
    copies it out: prefetch + 1 of them, the gathered term again), and the clone Gloo's list
    reduce-scatter makes of its inputs (a full bucket). The clone lives as long as Gloo's work
    object, and a worker thread drops a finished work only after the waiting rank has gone on:
    under load the clones of up to one earlier reduction per worker thread are still alive when
    the next reduction clones its own (the profiler saw 1 to 4 chunk-sized clones at the peak;
    one reduce-scatter in flight at a time, commlab/sharded/backward.py). The measured peak is the
    lowest of three steps (tests/support/memtrack_cases.py: why identical steps measure apart)."""
    from tests.support import memtrack_cases as c

    model = zero_memory(s["params"], 2, 3, "fp32").total
    buckets = bucket_memory(s["padded"], 2, 3, prefetch=1, element_size=4, optimizer_bytes=8, unpadded_numels=s["numels"])
    activations = 2 * c.BATCH * c.WIDTH * (c.DEPTH + 1) * 4
    clones = (GLOO_THREADS + 1) * max(s["padded"]) * 4
    return (model + 2 * buckets.gathered + buckets.reduce_scatter + buckets.padding + activations + s["largest_param"]
            + 2 * s["largest_shard"] + clones)


@pytest.mark.slow
def test_the_peak_falls_stage_by_stage_and_stage3_stays_under_its_bound(world2):
    for rank in world2:
        peaks = {s["stage"]: s["peak"] for s in rank["stages"]}
        assert peaks[0] > peaks[1] > peaks[2] > peaks[3], peaks
        assert peaks[3] <= _stage3_bound(rank["stages"][3]), (peaks[3], _stage3_bound(rank["stages"][3]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.py on a GPU machine)")
def test_the_cuda_allocator_counts_the_same_window():
    with track_peak("cuda") as both:
        a = torch.empty(MB // 4, device="cuda")
        c = torch.empty(MB // 2, device="cuda")
        del a
    assert (both.peak_bytes, both.net_bytes) == (3 * MB, 2 * MB)
    assert live_bytes("cuda") >= 2 * MB
    del c
