"""Collectives as benchmark plug-ins: a collective defined here only runs in the shared driver."""

import pandas as pd
import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.bench import collectives_plugins as plugins
from commlab.costmodel.terms.alpha_beta import busbw_factor
from commlab.bench.collectives_bench import choose
from commlab.bench.collectives_report import combine_ranks, fit_table, footer_lines, format_table
from commlab.bench.collectives_run import run_rank


# -- a reduce to rank 0, the whole plug-in in this file ----------------------------------------

def _reduce_algorithms():
    return ["native", "forgetful"]  # forgetful never communicates: the check must catch it


def _reduce_factor(n):
    return 1.0


def _reduce_expected(rank, world, count, dtype, op, device):
    return plugins.reduced(world, count, dtype, op, device) if rank == 0 else torch.empty(0, dtype=dtype, device=device)


def _reduce_result(buf, rank, world):
    return buf if rank == 0 else buf[:0]  # only the root's buffer is defined


def _reduce_run(algorithm, source, buf, op, placement):
    if placement == "out-of-place":
        buf.copy_(source)
    if algorithm == "native":
        dist.reduce(buf, dst=0, op=dist.ReduceOp.SUM)


REDUCE = plugins.Collective("test_reduce", _reduce_algorithms, _reduce_factor, plugins.rank_data,
                            _reduce_expected, _reduce_run, result=_reduce_result, root=0)


def _rank_rows(config):
    return run_rank(config)


@pytest.mark.slow
def test_a_collective_registered_here_runs_in_the_driver_and_its_check_can_fail():
    plugins.register(REDUCE)
    try:
        with pytest.raises(ValueError, match="registered twice"):
            plugins.register(REDUCE)
        picked = choose(["test_reduce", "broadcast"], "native,forgetful")
        assert [(c.name, algs) for c, algs in picked] == [("test_reduce", ["native", "forgetful"]), ("broadcast", ["native"])]
        config = {"sizes": [64, 1000], "collectives": picked, "dtype": "float32", "op": "sum",
                  "iters": 2, "warmup": 1, "check": True}
        per_rank = commlab.launch(_rank_rows, config, world_size=2, backend="gloo", timeout=120)
    finally:
        plugins._REGISTRY.pop("test_reduce", None)
    assert "test_reduce" not in plugins.collective_names()
    df = combine_ranks(per_rank, {"dtype": "float32", "op": "sum", "backend": "gloo"})
    mine = df[df["collective"] == "test_reduce"]
    assert len(mine) == 2 * 2 * 2 and set(mine["root"]) == {0} and set(mine["size_bytes"]) == {64, 1000}
    assert (mine[mine["algorithm"] == "native"]["wrong"] == 0).all()
    # forgetful leaves the root's own input: 16 and 250 elements differ from the sum, per placement
    assert sorted(mine[mine["algorithm"] == "forgetful"]["wrong"]) == [16, 16, 250, 250]
    assert (mine["busbw_gbps"] - mine["algbw_gbps"]).abs().max() < 1e-12  # factor 1
    bcast = df[df["collective"] == "broadcast"]
    assert len(bcast) == 4 and (bcast["wrong"] == 0).all() and set(bcast["op"]) == {"none"}
    assert any("(test_reduce forgetful)" in line for line in footer_lines(df))
    assert "Out of bounds values : 532 FAILED" in footer_lines(df)[-1]
    assert set(fit_table(df)["collective"]) == {"test_reduce", "broadcast"}
    assert "none" in format_table(bcast)


def test_built_in_factors_are_nccl_tests_and_counts_split_into_blocks():
    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        for n in (1, 2, 3, 8):
            assert plugins.get_collective(name).busbw_factor(n) == busbw_factor(name, n)
    rs = plugins.get_collective("reduce_scatter")
    assert rs.count(1024, 4, 3) == 255 and rs.count(4, 4, 3) == 3  # whole blocks, at least one each
    assert plugins.get_collective("all_reduce").count(1024, 4, 3) == 256
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        plugins.get_collective("gather")


def test_choosing_algorithms_per_collective():
    assert [a for _, a in choose(["all_reduce"], "all")] == [commlab.collectives.algorithm_names()]
    assert [a for _, a in choose(["reduce_scatter", "all_gather"], "ring")] == [["ring"], ["ring"]]
    with pytest.raises(ValueError, match="broadcast has none of ring"):
        choose(["all_gather", "broadcast"], "ring")
    with pytest.raises(ValueError, match="unknown algorithm"):
        choose(["broadcast"], "butterfly")


def test_rows_without_a_collective_are_all_reduce():
    per_rank = [[{"size_bytes": 8, "count": 2, "algorithm": "ring", "mean_s": 1e-3, "wrong": 0}]] * 4
    df = combine_ranks(per_rank, {"dtype": "float32", "op": "sum", "backend": "gloo"})
    assert df["collective"].tolist() == ["all_reduce"] and df["busbw_gbps"].iloc[0] == pytest.approx(df["algbw_gbps"].iloc[0] * 1.5)
    assert isinstance(df, pd.DataFrame)
