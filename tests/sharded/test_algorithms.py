"""ShardedDataParallel on commlab's p2p collectives (``algorithm="ring"``) against torch's DDP: one spawn.

World size 3, so that the 134-parameter test model is padded and the ring takes two steps. The
ring sums each block in its own order (rank r's block arrives as ((x_{r+1} + x_{r+2}) + x_r)),
Gloo's all-reduce in another, so the last bits differ: the parameters and the gathered optimizer
state are compared, as the world-size-3 tests against the backend's collectives are, to within
1e-6 of each tensor's largest value and 1e-5 element-wise.
"""

import pytest

import commlab
from tests.support import sharded_cases


@pytest.fixture(scope="module")
def ring3():
    return commlab.launch(sharded_cases.run_ring, world_size=3, backend="gloo", timeout=300)


@pytest.mark.slow
def test_ring_stages_1_to_3_give_torch_ddps_parameters_and_optimizer_state(ring3):
    cases = [(rank, name, r) for rank, result in enumerate(ring3) for name, r in result["cases"].items()]
    assert len(cases) == 3 * 8
    for rank, name, r in cases:
        assert r["scaled"] <= 1e-6 and r["rel"] <= 1e-5, (rank, name, r["scaled"], r["rel"])
        o = r["optimizer_state"]
        assert o["scaled"] <= 1e-6 and o["groups_equal"] and o["loaded_equal"], (rank, name, o["scaled"])
        assert r["finite_times"], (rank, name)


@pytest.mark.slow
def test_halving_doubling_on_three_ranks_is_refused_before_any_collective(ring3):
    for result in ring3:  # the ring cases that follow it in the same processes passed above
        message = result["halving_doubling"]
        assert message.startswith("ValueError") and "power-of-two world size, got 3" in message and "'ring'" in message


def test_auto_picks_the_ring_for_cpu_tensors_on_gloo_and_the_backends_own_otherwise():
    from commlab.sharded.comm import resolve_algorithm

    assert resolve_algorithm("auto", "gloo") == "ring"
    assert resolve_algorithm("auto", "gloo", "cuda") == "native"  # Gloo has no CUDA send/recv
    assert resolve_algorithm("auto", "nccl", "cuda") == "native"
    assert resolve_algorithm("halving_doubling", "nccl", "cuda") == "halving_doubling"
    with pytest.raises(ValueError, match="Gloo has for CPU tensors only"):
        resolve_algorithm("ring", "gloo", "cuda")
