"""Parameters unused on some ranks or on every rank, and uneven inputs under join(): one spawn per
world size (tests/support/sharded_unused_cases.py), and the pure rules (commlab/sharded/ordering.py,
commlab/sharded/join.py).

The spawns run with a 60 s limit (the process group's timeout and the launch's): a case that
hung, as these did before the agreement at the start of backward, fails the launch instead of
giving the error text every rank must return. Parameters against torch's fully_shard: exact at
world size 2, within the tolerance of tests/sharded/test_sharded.py at 3 (its docstring says why).
"""

import pytest

import commlab
from commlab.sharded.join import uneven_message
from commlab.sharded.ordering import in_order, partial_message, verdict
from tests.support import sharded_unused_cases as cases


@pytest.fixture(scope="module")
def worlds():
    return {w: commlab.launch(cases.run, world_size=w, backend="gloo", timeout=60) for w in (2, 3)}


@pytest.mark.slow
def test_a_parameter_used_on_some_ranks_only_is_an_error_on_every_rank(worlds):
    for world, results in worlds.items():
        for rank, result in enumerate(results):
            for case, error in result["partial"].items():
                # Rank 0 alone reads side, or alone skips mid.
                output = case.endswith("output")
                names = ("side.weight", "side.bias") if output else ("mid.weight", "mid.bias")
                used = 1 if output else world - 1
                assert error.startswith("RuntimeError: parameters used in this backward on some ranks only"), (
                    world, rank, case, error)
                assert all(f"{n} ({used} of {world})" in error for n in names), (world, rank, case, error)


@pytest.mark.slow
def test_unused_outputs_and_skipped_modules_train_as_fully_shard(worlds):
    for world, results in worlds.items():
        for rank, result in enumerate(results):
            for stage, r in result["fully_shard"].items():
                # Which .grad is None at each step: side's always, mid's at the skipped steps.
                assert r["grads_ours"] == r["grads_torch"], (world, rank, stage)
                assert not any(step["side.weight"] for step in r["grads_ours"])
                assert [step["mid.weight"] for step in r["grads_ours"]] == [
                    s not in cases.SKIPPED_AT for s in range(cases.STEPS)]
                assert r["side_untouched"] and r["mid_moved"], (world, rank, stage)  # momentum skips a None
                if world == 2:
                    assert r["exact"], (rank, stage, r["scaled"])
                else:
                    assert r["scaled"] <= 1e-6, (rank, stage, r["scaled"])


@pytest.mark.slow
def test_join_trains_as_without_it_and_raises_on_every_rank_for_uneven_inputs(worlds):
    for world, results in worlds.items():
        for rank, result in enumerate(results):
            for stage in (1, 2, 3):
                even, uneven = result["join"][f"s{stage}-even"], result["join"][f"s{stage}-uneven"]
                assert even == {"error": "no error", "same": True}, (world, rank, stage, even)
                error = uneven["error"]
                assert error.startswith("ValueError: uneven inputs") and "at iteration 2" in error, (world, rank, error)
                assert f"ranks [0] had no more batches while ranks {list(range(1, world))}" in error
                assert "drop_last=True" in error


def test_reductions_launch_in_descending_bucket_order():
    assert in_order(3, [True, True, True, True]) == ([3, 2, 1, 0], -1)
    assert in_order(3, [True, False, True, True]) == ([3, 2], 1)  # 0 waits for 1
    assert in_order(3, [True, True, True, False]) == ([], 3)  # 3 not in yet: nothing launches
    assert in_order(1, [True, True, False, False]) == ([1, 0], -1)
    assert in_order(-1, [True]) == ([], -1)


def test_usage_counts_split_into_unused_and_partial():
    assert verdict([2, 0, 1, 2, 0], 2) == ([1, 4], [2])
    assert verdict([3, 3], 3) == ([], [])
    message = partial_message(["mid.weight"], [1], 3)
    assert "mid.weight (1 of 3)" in message and "requires_grad=False" in message


def test_uneven_message_names_the_ranks_and_the_iteration():
    assert uneven_message({0: 1, 1: 1, 2: 1}, 4) is None  # every rank runs
    assert uneven_message({4: 0, 6: 0}, 4) is None  # every rank left
    message = uneven_message({0: 1, 1: 0, 2: 1, 3: 0}, 7)
    assert "iteration 7" in message and "ranks [1, 3] had no more batches while ranks [0, 2]" in message
