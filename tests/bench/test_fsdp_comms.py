"""fully_shard's custom reduce-scatter and all-gather on commlab's ring (commlab/bench/fsdp_comms.py)
give Gloo's results: single calls at world sizes 2 and 3, and a training run at world size 3.

At world size 2 a sum of two terms is the same in any order, so the ring equals Gloo bit for bit;
at 3 the ring adds each block in its own order, so the results agree to rounding (1e-6 of the
largest value)."""

import pytest

import commlab
from commlab.bench.fsdp_comms import P2PReduceScatter, _op_name
from tests.support import fsdp_comm_cases


def test_an_unknown_algorithm_and_a_reduce_op_commlab_lacks_are_refused():
    import torch.distributed as dist

    with pytest.raises(ValueError, match="tree"):
        P2PReduceScatter("tree")
    assert _op_name(dist.ReduceOp.AVG) == "avg"
    with pytest.raises(ValueError, match="sum, avg, max and min"):
        _op_name(dist._make_nccl_premul_sum(0.5))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_ring_collectives_give_gloos_results_and_refuse_bad_calls(world):
    for rank, r in enumerate(commlab.launch(fsdp_comm_cases.single_calls, world_size=world, backend="gloo",
                                            timeout=240)):
        gathers = {k: v for k, v in r.items() if k.startswith("ag-")}
        reductions = {k: v for k, v in r.items() if k.startswith("rs-")}
        assert len(gathers) == 6 and all(gathers.values()), (rank, gathers)
        assert len(reductions) == 12, reductions
        limit = 0.0 if world == 2 else 1e-6
        assert all(v <= limit for v in reductions.values()), (rank, reductions)
        assert r["bad_size"].startswith("ValueError: reduce-scatter input of")
        assert r["bad_op"].startswith("ValueError: commlab's p2p reduce-scatter runs")
        assert r["bad_gather"].startswith("ValueError: all-gather output of")


@pytest.mark.slow
def test_fully_shard_trains_on_the_ring_as_on_gloos_collectives():
    for r in commlab.launch(fsdp_comm_cases.training, world_size=3, backend="gloo", timeout=240):
        assert r["params"] == 6 and r["scaled"] <= 1e-6, r
