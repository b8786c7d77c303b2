"""Reduce-scatter and all-gather by recursive halving and doubling, beside the ring; one bucket
policy for DDP and sharded data parallelism.

The index maths is checked without processes at world sizes 1-16 by playing every rank's steps on
plain tensors; one spawn at world size 2 checks the real collectives against torch's
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` (synchronous and async), and
ShardedDataParallel with ``algorithm="halving_doubling"`` and with a bucket policy registered in
this file against torch's DDP (exact at world size 2: a sum of two numbers has one order).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from click.testing import CliRunner

import commlab
from commlab.collectives.scatter_gather import check_scatter_gather, scatter_gather_names
from commlab.collectives.schedules import chunk_bounds, hd_element_steps
from commlab.ddp.assignment import TensorSpec
from commlab.ddp.policy import BucketPolicy, make_policy, register
from commlab.sharded.buckets import policy_buckets
from commlab.sharded.comm import ALGORITHMS, algorithms_for, check_algorithm, resolve_algorithm


@register
class EveryOther(BucketPolicy):
    """Parameters alternate between two buckets, whatever their sizes (no size policy does that)."""

    name = "test_every_other"

    def initial(self, params, rebuild_follows):
        return self.rebuild(params, list(reversed(range(len(params)))))

    def rebuild(self, params, ready_order):
        order = list(ready_order)
        return [b for b in (order[0::2], order[1::2]) if b]


# --- the index maths, played out without processes -------------------------------------------


def _play_reduce_scatter(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's halving steps, step by step, on copies of ``inputs`` (one per rank)."""
    world, n = len(inputs), inputs[0].numel()
    bufs = [t.clone() for t in inputs]
    plans = [hd_element_steps(n, world, r) for r in range(world)]
    for k in range(len(plans[0])):
        sent = {}
        for r in range(world):
            (sa, sb), _, peer = plans[r][k]
            sent[(r, peer)] = bufs[r][sa:sb].clone()
        for r in range(world):
            _, (ra, rb), peer = plans[r][k]
            got = sent[(peer, r)]
            assert got.numel() == rb - ra  # the peer sends exactly what this rank receives
            bufs[r][ra:rb] += got
    return bufs


def _play_all_gather(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    world, n = len(inputs), inputs[0].numel()
    bufs = [t.clone() for t in inputs]
    plans = [hd_element_steps(n, world, r, all_gather=True) for r in range(world)]
    for k in range(len(plans[0])):
        sent = {(r, plans[r][k][2]): bufs[r][slice(*plans[r][k][0])].clone() for r in range(world)}
        for r in range(world):
            _, (ra, rb), peer = plans[r][k]
            bufs[r][ra:rb] = sent[(peer, r)]
    return bufs


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("numel", [0, 1, 3, 16, 37, 1000])
def test_halving_leaves_rank_r_the_sum_of_block_r_and_doubling_gathers_every_block(world, numel):
    g = torch.Generator().manual_seed(world * 1000 + numel)
    inputs = [torch.randint(-50, 50, (numel,), generator=g, dtype=torch.int64) for _ in range(world)]
    total = sum(inputs)
    bounds = chunk_bounds(numel, world)
    for r, buf in enumerate(_play_reduce_scatter(inputs)):
        lo, hi = bounds[r]
        assert torch.equal(buf[lo:hi], total[lo:hi]), (world, numel, r)
    # All-gather: rank r holds only its block (zeros elsewhere) and must end with everyone's.
    own = []
    for r in range(world):
        t = torch.zeros(numel, dtype=torch.int64)
        t[slice(*bounds[r])] = inputs[r][slice(*bounds[r])]
        own.append(t)
    expected = torch.cat([inputs[r][slice(*bounds[r])] for r in range(world)])
    for r, buf in enumerate(_play_all_gather(own)):
        assert torch.equal(buf, expected), (world, numel, r)


def test_world_4_steps_halve_then_double_the_range():
    # 16 elements, 4 ranks: blocks of 4. Rank 1 (binary 01) keeps the lower half at distance 2
    # (peer 3), then the upper quarter at distance 1 (peer 0); the all-gather reverses it.
    assert hd_element_steps(16, 4, 1) == (((8, 16), (0, 8), 3), ((0, 4), (4, 8), 0))
    assert hd_element_steps(16, 4, 1, all_gather=True) == (((4, 8), (0, 4), 0), ((0, 8), (8, 16), 3))
    for r in range(4):  # each rank sends (p-1)/p of the vector in all, as the ring does
        assert sum(b - a for (a, b), _, _ in hd_element_steps(16, 4, r)) == 12


@pytest.mark.parametrize("world", [3, 5, 6, 12])
def test_other_world_sizes_are_refused_naming_the_ring(world):
    for check in (lambda: hd_element_steps(16, world, 0), lambda: check_scatter_gather("halving_doubling", world),
                  lambda: check_algorithm("halving_doubling", world)):
        with pytest.raises(ValueError, match="power-of-two world size.*'ring'"):
            check()
    check_scatter_gather("ring", world)
    assert algorithms_for(world) == ["native", "ring"]


def test_auto_is_the_ring_on_gloo_and_the_backends_own_elsewhere():
    assert resolve_algorithm("auto", "gloo") == "ring" and resolve_algorithm("auto", "nccl") == "native"
    assert resolve_algorithm("native", "gloo") == "native" and resolve_algorithm("halving_doubling", "nccl") == "halving_doubling"
    with pytest.raises(ValueError, match="not available"):
        resolve_algorithm("tree", "gloo")


def test_sharded_algorithms_are_named_in_one_place():
    assert ALGORITHMS == ("native", "ring", "halving_doubling") and scatter_gather_names() == ["ring", "halving_doubling"]
    assert algorithms_for(4) == list(ALGORITHMS)
    with pytest.raises(ValueError, match="all-reduce only"):
        check_algorithm("tree", 4)


# --- the bucket policy, without processes ------------------------------------------------------


def _specs(nbytes):
    return [TensorSpec(n, torch.float32, torch.device("cpu")) for n in nbytes]


def test_sharded_buckets_are_the_policys_rebuild_for_backward_order_in_forward_order():
    from commlab.costmodel.lowering.buckets import assign

    nbytes = [12, 216, 36, 180, 20, 60, 12]
    policy = make_policy("size_cap", bucket_cap_mb=200 / (1 << 20))
    # Backward order: 12 + 60 + 20 + 180 >= 200 closes the first bucket, 36 + 216 the second.
    assert policy_buckets(_specs(nbytes), policy) == [[0], [1, 2], [3, 4, 5, 6]]
    # The predictor's assign(), asked the same question, gives the same buckets (reduction order).
    predicted = assign(nbytes, list(reversed(range(7))), bucket_cap_mb=200 / (1 << 20))
    assert sorted(sorted(b) for b in predicted) == policy_buckets(_specs(nbytes), policy)
    assert policy_buckets(_specs(nbytes), make_policy("test_every_other")) == [[0, 2, 4, 6], [1, 3, 5]]


def test_a_policy_that_loses_a_parameter_or_mixes_dtypes_is_refused():
    class Lossy(BucketPolicy):
        def rebuild(self, params, ready_order):
            return [list(ready_order)[1:]]

    class OneBucket(BucketPolicy):
        def rebuild(self, params, ready_order):
            return [list(ready_order)]

    with pytest.raises(ValueError, match="exactly one"):
        policy_buckets(_specs([4, 4]), Lossy())
    mixed = [TensorSpec(4, torch.float32, torch.device("cpu")), TensorSpec(2, torch.float16, torch.device("cpu"))]
    assert policy_buckets(mixed, make_policy("test_every_other")) == [[0], [1]]
    with pytest.raises(ValueError, match="several dtypes or devices in one bucket"):
        policy_buckets(mixed, OneBucket())


# --- one spawn at world size 2 -----------------------------------------------------------------

SIZES = (2, 10, 1000, 3 * (1 << 20) + 2)  # the last: blocks of 6 MiB, cut into 2 MiB pieces


def _collectives_against_torch() -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in ("ring", "halving_doubling"):
        for n in SIZES:
            g = torch.Generator().manual_seed(7 * n + rank)
            x = torch.randn(n, generator=g)
            want = torch.empty(n // world)
            dist.reduce_scatter_tensor(want, x.clone())
            gathered = torch.empty(n)
            dist.all_gather_into_tensor(gathered, want)
            for async_op in (False, True):
                buf = x.clone()
                got = commlab.collectives.reduce_scatter(buf, algorithm=algorithm, async_op=async_op)
                if async_op:
                    got.wait()
                    got = buf[rank * (n // world) : (rank + 1) * (n // world)]
                full = torch.zeros(n)
                full[rank * (n // world) : (rank + 1) * (n // world)] = want
                handle = commlab.collectives.all_gather(full, algorithm=algorithm, async_op=async_op)
                if async_op:
                    handle.wait()
                out[(algorithm, n, async_op)] = (torch.equal(got, want), torch.equal(full, gathered))
    return out


def _sharded_against_ddp() -> dict:
    from tests.support import sharded_cases

    cases = {}
    for stage in (1, 2, 3):
        cases[f"hd-s{stage}"] = sharded_cases.against_ddp(stage, bucket_cap_mb=sharded_cases.SPLIT_MB,
                                                          algorithm="halving_doubling")
        cases[f"policy-s{stage}"] = sharded_cases.against_ddp(stage, "sgd", bucket_policy="test_every_other")
    cases["hd-s3-units"] = sharded_cases.against_ddp(3, "adamw", units=True, prefetch=2, algorithm="halving_doubling")
    # The backend's own collectives, no longer the default on Gloo (tests/sharded/test_sharded.py runs "auto": the ring).
    for stage in (1, 2, 3):
        cases[f"native-s{stage}"] = sharded_cases.against_ddp(stage, bucket_cap_mb=sharded_cases.SPLIT_MB,
                                                              algorithm="native")
    cases["native-s3-units"] = sharded_cases.against_ddp(3, "adamw", units=True, algorithm="native")
    from commlab.sharded import ShardedDataParallel
    from tests.support.sharded_models import Net

    out = {name: {"exact": r["exact"], "buckets": r["buckets"], "optimizer_exact": r["optimizer_state"]["exact"]}
           for name, r in cases.items()}
    return {"cases": out, "default_algorithm": ShardedDataParallel(Net(), stage=2).algorithm}


def _rank() -> dict:
    warnings.simplefilter("ignore", FutureWarning)
    return {"collectives": _collectives_against_torch(), "sharded": _sharded_against_ddp()}


@pytest.fixture(scope="module")
def world2():
    return commlab.launch(_rank, world_size=2, backend="gloo", timeout=300)


@pytest.mark.slow
def test_halving_doubling_and_ring_equal_torchs_reduce_scatter_and_all_gather(world2):
    for result in world2:
        assert len(result["collectives"]) == 2 * len(SIZES) * 2
        for key, (rs, ag) in result["collectives"].items():
            assert rs and ag, key


@pytest.mark.slow
def test_sharded_halving_doubling_and_a_registered_policy_give_torch_ddps_parameters(world2):
    names = ["scale", "a.weight", "a.bias", "b.weight", "b.bias", "head.weight", "head.bias"]
    for result in world2:
        assert result["sharded"]["default_algorithm"] == "ring"  # "auto" on Gloo
        sharded = result["sharded"]["cases"]
        for name, r in sharded.items():
            assert r["exact"] and r["optimizer_exact"], name
        for stage in (1, 2, 3):  # the policy of this file, not a size cap, made the buckets
            assert sharded[f"policy-s{stage}"]["buckets"] == [names[0::2], names[1::2]]
            assert sharded[f"hd-s{stage}"]["buckets"] == [names[:1], names[1:3], names[3:]]


@pytest.mark.slow
def test_bench_collectives_runs_halving_doubling_and_refuses_it_on_three_ranks(tmp_path):
    from commlab.cli.bench import bench_collectives

    base = ["--collective", "reduce_scatter,all_gather", "--algorithm", "halving_doubling", "-n", "1", "-w", "0",
            "--out", str(tmp_path)]
    refused = CliRunner().invoke(bench_collectives, [*base, "--world-size", "2,3"])
    assert refused.exit_code == 2 and "power-of-two" in refused.output and "'ring'" in refused.output
    ran = CliRunner().invoke(bench_collectives, [*base, "-b", "64", "-e", "4K", "-f", "64"])
    assert ran.exit_code == 0, ran.output
    assert ran.output.count("halving_doubling") >= 4 and "FAILED" not in ran.output


# --- bad input before any collective -------------------------------------------------------------


def test_bad_bucket_policies_are_refused_before_any_process_group_is_needed():
    from commlab.sharded import ShardedDataParallel
    from tests.support.sharded_models import Net

    with pytest.raises(ValueError, match="unknown bucket policy 'nope'"):
        ShardedDataParallel(Net(), bucket_policy="nope")

    class Lossy(BucketPolicy):
        def rebuild(self, params, ready_order):
            return [list(ready_order)[1:]]

    with pytest.raises(ValueError, match="exactly one"):
        ShardedDataParallel(Net(), bucket_policy=Lossy())
    # With units the policy is not asked: a policy that would fail does not matter.
    net = Net()
    with pytest.raises(RuntimeError, match="initialised process group"):
        ShardedDataParallel(net, units=[net.a, net.b], bucket_policy=copy.copy(Lossy()))


def test_bench_with_all_algorithms_leaves_halving_doubling_out_where_it_cannot_run():
    from commlab.bench.collectives_bench import choose, for_world

    picked = choose(["reduce_scatter", "all_gather", "all_reduce"], "all")
    kept, skipped = for_world(picked, 3)
    assert [(c.name, algs) for c, algs in kept][:2] == [("reduce_scatter", ["native", "ring"]),
                                                       ("all_gather", ["native", "ring"])]
    assert "halving_doubling" in kept[2][1]  # the all-reduce folds: any world size
    assert len(skipped) == 2 and all("power-of-two" in line for line in skipped)
    assert for_world(picked, 4) == (picked, [])
