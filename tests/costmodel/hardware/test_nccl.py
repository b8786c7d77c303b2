"""NCCL's tuner model by hand (NCCL 2.20.3 src/graph/tuning.cc) and the placement of a group on a
machine's links. Pure: no process, no GPU."""

import math

import pytest

from commlab.costmodel.hardware import nccl
from commlab.costmodel.hardware import nccl_tuner as tuner
from commlab.runs.traffic import COLLECTIVES

A100 = nccl.Network(gpus_per_node=8, nvlink_busbw=240.0, nic_busbw=24.0, nics_per_node=8, channels=16, arch="ampere",
                    cpu="amd")


def test_every_collective_of_the_run_vocabulary_is_priced():
    assert set(nccl.COLLECTIVES) == set(COLLECTIVES)
    with pytest.raises(ValueError, match="prices"):
        nccl.collective_seconds(A100, "all_to_all", 1 << 20, nccl.Group(16, 8))


def test_ring_simple_is_priced_as_the_tuner_prices_it():
    one_node = tuner.Comm(8, 1, 240.0, 16, "ampere", "amd")
    # 8.4 us + 14 NVLink steps of 3.4 us; algbw = busbw x 8 / 14
    assert tuner.time_us(one_node, "all_reduce", "ring", "Simple", 1 << 30) == pytest.approx(
        8.4 + 14 * 3.4 + (1 << 30) / (1000 * 240.0 * 8 / 14))
    wide = tuner.Comm(256, 32, 192.0, 16, "ampere", "amd")
    steps, inter = 2 * 255, 2 * 32
    # the network's posting overhead (2 us on AMD, x 3 for Simple) beats NVLink's 3.4 us; x 1.4: the plateau
    latency = (8.4 + (steps - inter) * 6.0 + inter * 14.0) * 1.4
    assert tuner.latency_us(wide, "all_reduce", "ring", "Simple", 1 << 30) == pytest.approx(latency)
    assert tuner.latency_us(wide, "all_reduce", "ring", "Simple", 100) == pytest.approx(latency / 1.4)
    # reduce-scatter: n - 1 steps, nodes - 1 of them across; algbw = busbw x n / (n - 1)
    assert tuner.latency_us(wide, "reduce_scatter", "ring", "Simple", 1 << 30) == pytest.approx(
        8.4 + (255 - 31) * 6.0 + 31 * 14.0)
    assert tuner.algorithm_bandwidth(wide, "all_gather", "ring", "Simple", 1 << 30) == pytest.approx(192.0 * 256 / 255)


def test_tree_and_the_low_latency_protocols_are_priced_as_the_tuner_prices_them():
    wide = tuner.Comm(256, 32, 192.0, 16, "ampere", "amd")
    # tree: min(0.92 busbw, 16 channels x 17.8) / 2, then 25 MiB's correction (log2(25 MiB / 64) = 18: 0.7)
    assert tuner.algorithm_bandwidth(wide, "all_reduce", "tree", "Simple", 25 << 20) == pytest.approx(
        min(0.92 * 192, 16 * 17.8) / 2 * 0.7)
    assert tuner.latency_us(wide, "all_reduce", "tree", "Simple", 1) == pytest.approx(2 * (7 * 28.0 + 5 * 28.0))
    # LL: a quarter of the ring's busbw, capped at AMD's 19 GB/s beyond two nodes
    assert tuner.bus_bandwidth(wide, "all_reduce", "ring", "LL") == pytest.approx(19.0)
    # LL128: 0.92 of it, capped at 20 GB/s a channel
    assert tuner.bus_bandwidth(wide, "all_reduce", "ring", "LL128") == pytest.approx(min(0.92 * 192, 16 * 20.0))
    one_node = tuner.Comm(8, 1, 240.0, 16, "ampere", "amd")
    # within a node an all-gather's LL moves a third, an all-reduce's a quarter
    assert tuner.bus_bandwidth(one_node, "all_gather", "ring", "LL") == pytest.approx(80.0)
    assert tuner.bus_bandwidth(one_node, "all_reduce", "ring", "LL") == pytest.approx(60.0)
    assert not tuner.enabled(one_node, "all_gather", "tree", "Simple")
    assert not tuner.enabled(tuner.Comm(8, 1, 24.0, 2, nvlink=False), "all_reduce", "ring", "LL128")


def test_the_tuner_picks_ll_for_small_calls_ll128_for_medium_and_simple_for_large():
    group = nccl.Group(16, 8)
    protocols = [nccl.choice(A100, "all_reduce", s, group)[1] for s in (1 << 10, 4 << 20, 8 << 30)]
    assert protocols == ["LL", "LL128", "Simple"]
    t = nccl.collective_seconds(A100, "all_reduce", 1 << 30, group)
    comm = nccl.communicator(A100, group)
    assert t == pytest.approx(min(tuner.time_us(comm, "all_reduce", a, p, 1 << 30) for a in tuner.ALGORITHMS
                                  for p in tuner.PROTOCOLS if tuner.enabled(comm, "all_reduce", a, p)) * 1e-6)


def test_a_group_uses_nvlink_inside_a_node_and_its_share_of_the_nics_across():
    tp = nccl.communicator(A100, nccl.Group(8, 8))
    assert (tp.nodes, tp.busbw) == (1, 240.0)
    # 8 DP groups of one GPU a node share the node's 8 NICs: one each
    dp = nccl.communicator(A100, nccl.Group(32, 1, sharing=8))
    assert (dp.nodes, dp.busbw, dp.channels) == (32, 24.0, 2)
    # alone, a one-GPU-a-node group still reaches only its own GPU's NIC
    assert nccl.communicator(A100, nccl.Group(32, 1)).busbw == 24.0
    # a full node's group uses all 8
    assert nccl.communicator(A100, nccl.Group(256, 8)).busbw == 192.0
    # 4 NICs for 8 GPUs: a 4-GPU group gets 2 of them
    four = nccl.Network(8, 240.0, 24.0, 4, cpu="amd")
    assert nccl.communicator(four, nccl.Group(16, 4)).busbw == 48.0
    shared = nccl.bus_bandwidth(A100, "all_reduce", 1 << 30, nccl.Group(32, 1, sharing=8))
    alone = nccl.bus_bandwidth(A100, "all_reduce", 1 << 30, nccl.Group(32, 8))
    assert shared < alone / 4


def test_groups_are_validated():
    for bad in ((0, 1), (4, 8), (8, 8, 0), (8.0, 8)):
        with pytest.raises(ValueError):
            nccl.Group(*bad)
    with pytest.raises(ValueError, match="do not fit"):
        nccl.collective_seconds(A100, "all_reduce", 1 << 20, nccl.Group(16, 4, sharing=4))
    assert nccl.Group(24, 8).nodes == 3
    assert nccl.collective_seconds(A100, "all_gather", 1 << 20, nccl.Group(1, 1)) == 0.0
    with pytest.raises(ValueError, match="arch"):
        nccl.Network(8, 240.0, 24.0, 8, arch="pascal")


def test_bus_bandwidth_is_nccl_tests_factor_over_the_time():
    group = nccl.Group(16, 8)
    for op in nccl.COLLECTIVES:
        t = nccl.collective_seconds(A100, op, 1 << 28, group)
        factor = {"all_reduce": 2 * 15 / 16, "reduce_scatter": 15 / 16, "all_gather": 15 / 16}.get(op, 1.0)
        assert nccl.bus_bandwidth(A100, op, 1 << 28, group) == pytest.approx((1 << 28) / t * factor / 1e9)
        assert math.isfinite(t) and t > 0


def test_the_all_reduce_callable_keeps_its_old_shape():
    wide = nccl.NCCLAllReduce(A100, 256)
    assert wide(1 << 30) == nccl.collective_seconds(A100, "all_reduce", 1 << 30, nccl.Group(256, 8))
    assert wide.algorithm(25 << 20) == "tree" and wide.algorithm(8 << 30) == "ring"
    assert nccl.NCCLAllReduce(A100, 1)(1 << 20) == 0.0


H100 = nccl.Network(8, 370.8, 48.0, 8, 16, "hopper", "intel", nvls=True)


def test_nvls_channels_run_at_the_fastest_speed_a_head_and_seven_others_leave_on_nvlink():
    # 8 channels, one headed by each GPU: (2 + 7) x speed <= 370.8 GB/s -> 40 GB/s (41.2 is not in the table)
    assert nccl.communicator(H100, nccl.Group(8, 8)).nvls_busbw == 8 * 40.0
    # two nodes: each head's NIC (48 GB/s) does not bind; beyond two, half of it (24) does
    assert nccl.communicator(H100, nccl.Group(16, 8)).nvls_busbw == 8 * 40.0
    assert nccl.communicator(H100, nccl.Group(32, 8)).nvls_busbw == 8 * 24.0
    assert nccl.communicator(A100, nccl.Group(8, 8)).nvls_busbw == 0.0
    one_node = nccl.communicator(H100, nccl.Group(8, 8))
    # algbw = 5/6 of the graph's; latency 23 us (hwLat NVLINK NVLS)
    assert tuner.time_us(one_node, "all_reduce", "nvls", "Simple", 1 << 30) == pytest.approx(
        23.0 + (1 << 30) / (1000 * 320.0 * 5 / 6))
    assert not tuner.enabled(one_node, "all_reduce", "nvls", "LL128")
    assert not tuner.enabled(one_node, "all_reduce", "nvls_tree", "Simple")
    assert nccl.choice(H100, "all_reduce", 1 << 30, nccl.Group(8, 8)) == ("nvls", "Simple")
    assert nccl.choice(H100, "all_reduce", 1 << 30, nccl.Group(16, 8)) == ("nvls_tree", "Simple")
    # at 4 nodes the ring's 8 NICs beat NVLS-tree's halved heads for large calls
    assert nccl.choice(H100, "all_reduce", 8 << 30, nccl.Group(32, 8)) == ("ring", "Simple")
