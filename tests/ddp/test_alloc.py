"""No bucket-sized allocation in a steady-state DDP iteration, against torch's DDP.

One spawn (world 2, Gloo) runs every configuration after the bucket rebuild and returns the
allocations above the largest gradient (anything that big is bucket-sized: every bucket holds
several gradients) plus the data pointers of bucket buffers and gradients per iteration.
Rank-side code: tests/support/ddp_alloc_cases.py.
"""

import pytest

import commlab
from tests.support import ddp_alloc_cases

pytestmark = pytest.mark.slow  # every test here starts processes

VIEWS = (True, False)


@pytest.fixture(scope="module")
def world2():
    results = commlab.launch(ddp_alloc_cases.run, world_size=2, backend="gloo", timeout=240)
    return results[0], results[1]


def _configs(impl):
    plain = [(impl, stn, view, "native", None) for stn in (True, False) for view in VIEWS]
    hooked = [(impl, True, view, "native", hook) for hook in ("allreduce", "fp16") for view in VIEWS]
    return plain + hooked


COMMLAB = _configs("commlab") + [("commlab", stn, view, "ring", None) for stn in (True, False) for view in VIEWS]


@pytest.mark.parametrize("config", COMMLAB, ids=lambda c: "-".join(map(str, c[1:])))
def test_steady_iterations_allocate_nothing_bucket_sized_beyond_torch(world2, config):
    for rank in world2:
        ours = rank[config]
        assert all(size <= max(ours["sizes"]) // 2 for size in ours["big"]), ours  # at most a fp16 copy
        torch_same = rank[("torch", *config[1:])] if config[3] == "native" else {"big": []}
        # Only the hook's own allocations (fp16_compress_hook's half-size copy), as in torch.
        assert sorted(ours["big"]) == sorted(torch_same["big"]), (ours["big"], torch_same["big"])
        if config[4] != "fp16":
            assert ours["big"] == []


@pytest.mark.parametrize("config", COMMLAB, ids=lambda c: "-".join(map(str, c[1:])))
def test_bucket_buffers_and_bucket_view_grads_keep_their_storage(world2, config):
    _, set_to_none, as_view, _, _ = config
    for rank in world2:
        pointers = rank[config]["pointers"]
        buffers, grads = pointers[0]
        assert len(pointers) == ddp_alloc_cases.MEASURED and len(buffers) == 2
        assert all(b == buffers for b, _ in pointers)  # the same bucket storage every iteration
        if as_view or not set_to_none:  # grads live in the buckets / are written back in place
            assert all(g == grads for _, g in pointers)
        if as_view:
            assert set(grads) & set(buffers)  # the first gradient of each bucket starts it


def test_the_threshold_sees_the_fp16_hooks_own_copies(world2):
    """The count is not vacuous: torch's fp16 hook allocates a half-bucket per bucket and call."""
    for rank in world2:
        big = rank[("torch", True, True, "native", "fp16")]["big"]
        assert len(big) == 2 * ddp_alloc_cases.MEASURED


@pytest.mark.parametrize("algorithm", ["ring", "tree", "halving_doubling", "native"])
def test_repeated_all_reduces_reuse_their_scratch(world2, algorithm):
    for rank in world2:
        result = rank[("collective", algorithm)]
        assert result["correct"] and result["big"] == [], result
