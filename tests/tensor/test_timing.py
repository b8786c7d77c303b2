"""Per-layer timings of tensor parallelism: one entry per iteration, each layer's collectives
counted as the plan places them, stamps consistent with the iteration's; no time is asserted.

One spawn at world size 2 trains commlab's GPT (2 blocks) under ``gpt_plan()`` with and without
sequence parallelism (rank side: tests/support/tensor_timing_cases.py).
"""

import pytest
from torch import nn

import commlab
from commlab.tensor import record_timings, timings
from tests.support import tensor_timing_cases as cases

BLOCKS = ("layers.0", "layers.1")
ACTIVATION_BYTES = cases.BATCH * cases.SEQ * cases.D_MODEL * 4  # (batch, seq, d_model) float32


@pytest.fixture(scope="module")
def world2():
    return commlab.launch(cases.run, world_size=2, backend="gloo", timeout=300)


def _counts(iteration: dict, prefix: str) -> dict[str, int]:
    """Collectives per "phase kind" summed over the layers whose names start with ``prefix``."""
    total: dict[str, int] = {}
    for name, layer in iteration["layers"].items():
        if name == prefix or name.startswith(prefix + "."):
            for key, n in layer["counts"].items():
                total[key] = total.get(key, 0) + n
    return total


def test_a_module_parallelize_did_not_return_is_refused():
    with pytest.raises(ValueError, match="not returned by commlab.tensor.parallelize"):
        timings(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not returned by commlab.tensor.parallelize"):
        record_timings(nn.Linear(2, 2))


@pytest.mark.slow
def test_only_recorded_iterations_are_kept_and_recording_changes_no_result(world2):
    for result in world2:
        for setting in ("plain", "sp"):
            got = result[setting]
            assert got["before"] == 0 and len(got["iterations"]) == 2, setting
            assert got["same_losses"], setting


@pytest.mark.slow
def test_the_plain_plan_runs_two_all_reduces_per_block_each_way(world2):
    for result in world2:
        for it in result["plain"]["iterations"]:
            for block in BLOCKS:
                assert _counts(it, block) == {"forward all_reduce": 2, "backward all_reduce": 2}, block
                # forward: after the row layers; backward: before q (its input shared by k and v) and fc
                assert it["layers"][f"{block}.proj"]["counts"] == {"forward all_reduce": 1}
                assert it["layers"][f"{block}.out"]["counts"] == {"forward all_reduce": 1}
                assert it["layers"][f"{block}.q"]["counts"] == {"backward all_reduce": 1}
                assert it["layers"][f"{block}.fc"]["counts"] == {"backward all_reduce": 1}
            assert set(it["layers"]) == {f"{b}.{n}" for b in BLOCKS for n in ("q", "proj", "fc", "out")}
            assert {c[3] for c in it["collectives"]} == {ACTIVATION_BYTES}


@pytest.mark.slow
def test_sequence_parallelism_moves_them_to_gathers_and_scatters(world2):
    for result in world2:
        for it in result["sp"]["iterations"]:
            for block in BLOCKS:
                layers = it["layers"]
                for name in ("q", "fc"):
                    assert layers[f"{block}.{name}"]["counts"] == {"forward all_gather": 1, "backward reduce_scatter": 1}
                for name in ("proj", "out"):  # and the row bias's gradient summed
                    assert layers[f"{block}.{name}"]["counts"] == {
                        "forward reduce_scatter": 1, "backward all_gather": 1, "backward all_reduce": 1}
                for name in ("ln1", "ln2"):  # weight and bias gradients summed
                    assert layers[f"{block}.{name}"]["counts"] == {"backward all_reduce": 2}
            assert it["layers"]["layers.0"]["counts"] == {"backward all_gather": 1}  # split_sequence
            assert it["layers"]["head"]["counts"] == {"forward all_gather": 1}  # gather_sequence
            assert it["layers"]["norm"]["counts"] == {"backward all_reduce": 2}


@pytest.mark.slow
def test_stamps_are_consistent_with_the_iteration_and_the_layer_sums(world2):
    for result in world2:
        for setting in ("plain", "sp"):
            for it in result[setting]["iterations"]:
                assert 0 <= it["forward"] <= it["total"] and it["backward"] >= 0
                assert it["forward"] + it["backward"] == pytest.approx(it["total"])
                durations = 0.0
                for layer, phase, _kind, _nbytes, start, end in it["collectives"]:
                    assert 0 <= start <= end <= it["total"]
                    # forward collectives end before the forward does; backward ones start after it
                    assert end <= it["forward"] if phase == "forward" else start >= it["forward"]
                    durations += end - start
                assert it["exposed"] == pytest.approx(durations)
                assert sum(l["forward"] + l["backward"] for l in it["layers"].values()) == pytest.approx(durations)
