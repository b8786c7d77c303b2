"""commlab's DDP against torch's on the edges users hit, world sizes 2 and 3.

One spawn per world size runs every edge on both DDPs (tests/support/ddp_parity_cases.py); the
tests compare final parameters and buffers, which gradients are None, state_dict keys, bucket layouts, and
where both raise. The constructor's keywords are checked without processes.
"""

import inspect

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import commlab
from tests.support import ddp_parity_cases

EXACT = 1e-6  # same pre-division and reduction order as torch: in practice identical


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world(request):
    n = request.param
    return commlab.launch(ddp_parity_cases.cases, n, world_size=n, backend="gloo", timeout=300)


TRAINED = [
    "unused_output", "unused_output_view", "unused_output_tiny", "structure_tensor", "structure_list",
    "structure_dict", "structure_namedtuple", "structure_dataclass", "structure_dataclass_none",
    "structure_nested", "ring_unused", "tree_unused", "static_dead", "static_dead_tiny", "static_no_sync",
    "ignored", "init_sync_off", "check_reduction", "forward_sync_off", "no_grad_between", "checkpoint",
    "checkpoint_unused", "fp16", "fp16_ring", "bf16", "int_buffers", "join", "join_effective_world", "join_unused", "join_ring",
    "sparse", "sparse_bag_tiny", "sparse_ring", "sparse_find_unused", "sparse_static", "sparse_hook", "sparse_hook_unused",
    "sparse_all", "sparse_all_unused_hook",
]  # fmt: skip
RAISING = ["unused_output_noflag", "static_unused_output", "static_changed", "dynamic_changed", "sparse_noflag_unused_raises"]
# A sparse parameter that torch's find_unused_parameters / static_graph finds unused.
SPARSE_RAISING = {"sparse_unused_raises": 1, "sparse_static_unused_raises": 0}


def _same_as_torch(r, case, rank):
    assert r["params"] <= EXACT and r["buffers"] <= EXACT and r["grads"] <= EXACT, (case, rank, r)
    assert r["grads_none"] == r["torch_grads_none"], (case, rank)
    assert r["sparse_grads"] == r["torch_sparse_grads"], (case, rank)
    assert r["state_dict"], (case, rank)
    assert r["buckets"] == r["torch_buckets"], (case, rank)


@pytest.mark.parametrize("case", TRAINED)
@pytest.mark.slow
def test_trains_as_torch_ddp(world, case):
    for rank, result in enumerate(world):
        r = result[case]
        assert r["errors"] == {}, (case, rank, r["errors"])
        assert r["finite"], (case, rank)
        _same_as_torch(r, case, rank)


@pytest.mark.parametrize("case", RAISING)
@pytest.mark.slow
def test_raises_where_torch_raises(world, case):
    for rank, result in enumerate(world):
        r = result[case]
        assert set(r["errors"]) == {"ours", "torch"}, (case, rank, r["errors"])
        assert r["errors"]["ours"] == r["errors"]["torch"], (case, rank)  # same step, same sentence
        assert r["errors"]["ours"][1].startswith("Expected to have finished reduction in the prior iteration")
        _same_as_torch(r, case, rank)  # and the state before the error is the same


@pytest.mark.parametrize("case", SPARSE_RAISING)
@pytest.mark.slow
def test_unused_sparse_parameter_raises_where_torch_raises(world, case):
    for rank, result in enumerate(world):
        r = result[case]
        assert r["errors"]["ours"] == r["errors"]["torch"] == (SPARSE_RAISING[case], "Expected sparse gradient to be defined."), (case, rank)
        _same_as_torch(r, case, rank)


@pytest.mark.slow
def test_join_throws_as_torch_on_every_rank(world):
    # Rank r has 2 + 2r batches: rank 0 runs out first and says so; the others are told.
    for rank, result in enumerate(world):
        errors = result["join_throw"]["errors"]
        assert errors["ours"] == errors["torch"], rank
        expected = "Rank 0 exhausted all inputs." if rank == 0 else "Detected at least one rank that exhausted inputs"
        assert errors["ours"][1] == expected, rank
    # divide_by_initial_world_size=False divides by the ranks still training: other gradients.
    assert world[-1]["join"]["first_grad"] != world[-1]["join_effective_world"]["first_grad"]


@pytest.mark.slow
def test_sparse_gradients_stay_sparse_and_fall_back_to_native(world):
    for result in world:
        for case in ("sparse", "sparse_bag_tiny", "sparse_ring", "sparse_hook"):
            assert result[case]["sparse_grads"] == [True, False, False], case  # emb.weight, fc.w, fc.b
        for case in ("sparse_find_unused", "sparse_static", "sparse_hook_unused"):  # + dead.w, dead.b: None
            assert result[case]["sparse_grads"] == [True, False, False, False, False], case
            assert result[case]["grads_none"] == [False, False, False, True, True], case
            assert result[case]["buckets"] is None  # torch cannot list a sparse bucket to compare
        assert "'ring' reduces dense buffers" in result["sparse_fallback"] and "emb.weight" in result["sparse_fallback"]
        for case in ("sparse_all", "sparse_all_unused_hook"):  # no dense parameter at all, as torch takes it
            assert result[case]["sparse_grads"] == [True] and not result[case]["errors"], case


@pytest.mark.slow
def test_unused_heads_keep_none_grads(world):
    # Heads: trunk.w/b, main.w/b, aux.w/b, dead.w/b. An output the loss ignores leaves aux's
    # gradients None (not zeros), so weight decay and momentum leave aux alone.
    for result in world:
        assert result["unused_output"]["grads_none"] == [False] * 4 + [True] * 4
        # A dataclass output whose aux takes part in the loss: aux gets gradients, dead none.
        assert result["structure_dataclass"]["grads_none"] == [False] * 6 + [True] * 2
        # Static graph: the dead layer is found in the first iteration and left alone after.
        assert result["static_dead"]["grads_none"] == [False] * 4 + [True, True, False, False]


@pytest.mark.slow
def test_ignored_parameters_stay_rank_local(world):
    # Different initial values per rank; ign.* neither broadcast nor reduced: it stays per rank,
    # equal to torch's on the same rank (checked above), and differs across ranks.
    assert world[0]["ignored_values"] != world[1]["ignored_values"]
    assert world[0]["synced_values"] == world[1]["synced_values"]


@pytest.mark.slow
def test_integer_buffers_are_broadcast_bit_exactly(world):
    for result in world:
        assert result["int_buffer_values"] == world[0]["int_buffer_values"]
    i64, i32, flag = world[0]["int_buffer_values"]
    assert i64 == [2**62 + 12345, -(2**62 + 12345)] and i32 == [2**31 - 1] and flag == [True]


@pytest.mark.slow
def test_fp16_average_does_not_overflow(world):
    # Every rank's gradient element is 40000: the sum overflows fp16 at world >= 2, the average
    # (divided before summing, as torch) is 40000.
    for result in world:
        assert result["fp16_grad"] == 40000.0 and result["fp16_ring_grad"] == 40000.0


@pytest.mark.parametrize("case", ddp_parity_cases.DEVICE_KEYWORDS)
@pytest.mark.slow
def test_device_keywords_on_cpu_as_torch(world, case):
    # torch keeps device_ids/output_device only for a CUDA module (tests/test_gpu.py runs that).
    for result in world:
        got = result["device_keywords"][case]
        assert got["ours"] == got["torch"], (case, got)
    accepted = world[0]["device_keywords"]
    assert accepted["cpu_empty_ids_dim"]["ours"] == (None, None, 1)
    assert accepted["cpu_device_ids"]["ours"][0] == "ValueError"


# -- the constructor, without processes ------------------------------------------------------------
def test_constructor_takes_torchs_keywords_in_torchs_order():
    ours = inspect.signature(commlab.DistributedDataParallel.__init__).parameters
    theirs = inspect.signature(TorchDDP.__init__).parameters
    positional = [p for p in ours.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == list(theirs)
    assert [p.default for p in positional] == [p.default for p in theirs.values()]
    own = [p.name for p in ours.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert own == ["algorithm", "overlap", "first_bucket_mb", "round_robin_groups", "bucket_policy"]


@pytest.mark.parametrize(
    "keyword, value",
    [
        ("mixed_precision", object()),
        ("skip_all_reduce_unused_params", True),
        ("bucket_cap_mb_list", [1, 25]),
    ],
)
def test_unhonoured_keywords_raise_naming_the_keyword(keyword, value):
    with pytest.raises(NotImplementedError, match=keyword):
        commlab.DistributedDataParallel(nn.Linear(2, 2), **{keyword: value})


def test_delay_all_reduce_keywords_pair_up_as_in_torch():
    with pytest.raises(ValueError, match="at the same time"):
        commlab.DistributedDataParallel(nn.Linear(2, 2), delay_all_reduce_named_params=[])
    with pytest.raises(NotImplementedError, match="delay_all_reduce_named_params"):
        commlab.DistributedDataParallel(nn.Linear(2, 2), delay_all_reduce_named_params=[], param_to_hook_all_reduce=torch.zeros(1))
