"""What-if on hardware presets: NCCL's tuning model against published nccl-tests figures, the
compute from FLOPs, and predictions labelled with their assumptions. Pure: no process, no GPU."""

import pytest

from commlab.costmodel.hardware import flops, nccl
from commlab.costmodel.hardware.presets import allreduce_cost, compute_from_flops, load_preset, preset_names

A100 = nccl.Network(gpus_per_node=8, nvlink_busbw=240.0, nic_busbw=24.0, nics_per_node=8, channels=16, arch="ampere",
                    net_overhead_us=2.0)


@pytest.mark.parametrize("name", preset_names())
def test_presets_bus_bandwidth_is_within_15_percent_of_every_published_figure_they_cite(name):
    preset = load_preset(name)
    assert preset["published"], f"{name} cites no published figure to be checked against"
    for fig in preset["published"]:
        assert 8 <= fig["gpus"] <= 256 and fig["source"]
        predicted = allreduce_cost(preset, fig["gpus"]).bus_bandwidth(fig["bytes"])
        assert predicted == pytest.approx(fig["busbw_gbps"], rel=0.15), (fig, predicted)


def test_ring_and_tree_are_priced_as_nccls_tuning_model_prices_them():
    """tuning.cc (NCCL 2.19) by hand, Simple protocol."""
    one_node = nccl.NCCLAllReduce(A100, 8)
    # ring inside a node: 8.4 us + 14 NVLink steps of 3.4 us; algbw = busbw x 8 / 14
    assert one_node.ring_s(1 << 30) == pytest.approx((8.4 + 14 * 3.4) * 1e-6 + (1 << 30) / (240e9 * 8 / 14))
    # tree: min(0.92 busbw, 16 channels x 24.0) / 2; 1 GiB is past the correction table
    assert one_node.tree_s(1 << 30) == pytest.approx(2 * 7 * 28e-6 + (1 << 30) / (0.92 * 240e9 / 2))
    wide = nccl.NCCLAllReduce(A100, 256)  # 32 nodes
    assert wide.nodes() == 32 and wide.busbw() == 8 * 24.0
    steps, inter = 2 * 255, 2 * 32
    ring_latency = (8.4 + (steps - inter) * max(3.4, 3 * 2.0) + inter * 14.0) * 1.4 * 1e-6  # x 1.4: the plateau
    assert wide.ring_s(1 << 30) == pytest.approx(ring_latency + (1 << 30) / (192e9 * 256 / steps))
    # tree at 32 nodes: capped at 16 x 17.8 GB/s only if 0.92 x 192 exceeded it (it does not);
    # 25 MiB is size class log2(25 MiB / 64) = 18: corrected by 0.7
    tree = 2 * (7 * 28.0 + 5 * 28.0) * 1e-6 + (25 << 20) / (0.92 * 192e9 / 2 * 0.7)
    assert wide.tree_s(25 << 20) == pytest.approx(tree)
    assert wide(1 << 30) == min(wide.ring_s(1 << 30), wide.tree_s(1 << 30))
    with pytest.raises(ValueError, match="arch"):
        nccl.Network(8, 240.0, 24.0, 8, arch="pascal")


def test_nccl_switches_to_tree_at_scale_and_keeps_ring_where_its_bandwidth_pays():
    wide = nccl.NCCLAllReduce(A100, 256)
    assert wide.algorithm(25 << 20) == "tree"  # the ring's 2 (n - 1) steps of latency dominate
    assert wide.algorithm(1 << 30) == "tree"  # ... still: 5 ms of ring latency against 1.1 ms of tree bandwidth
    assert wide.algorithm(8 << 30) == "ring"  # the ring's busbw x n / (2 (n - 1)) beats the tree's 0.92 busbw / 2
    assert nccl.NCCLAllReduce(A100, 16).algorithm(25 << 20) == "ring"
    assert nccl.NCCLAllReduce(A100, 8).algorithm(25 << 20) == "ring"
    assert nccl.NCCLAllReduce(A100, 1)(1 << 20) == 0.0


def test_flops_are_counted_on_the_meta_device_and_shared_between_parameters():
    counted = flops.count("mlp", {"depth": 2, "width": 64}, 8)
    # Linear(64, 64) x 2 and the classifier (64 -> 10): 2 x batch x in x out each, forward
    assert counted.forward == 2 * 8 * (64 * 64 * 2 + 64 * 10)
    # backward: every weight's gradient (as much as forward) and the inputs' gradients of all but the first layer
    assert counted.backward == counted.forward + 2 * 8 * (64 * 64 + 64 * 10)
    assert sum(counted.share) == pytest.approx(1.0) and len(counted.share) == 6
    weights = counted.share[0::2]
    assert weights[0] == pytest.approx(weights[1]) and weights[2] < weights[0]  # by each layer's FLOPs
    profile = flops.profile(counted, 1e12)
    assert profile.forward_s == pytest.approx(counted.forward / 1e12)
    assert profile.ready_order == (5, 4, 3, 2, 1, 0) and profile.ready_s[-1] == pytest.approx(counted.backward / 1e12)
    assert all(b > a for a, b in zip(profile.ready_s, profile.ready_s[1:]))
    with pytest.raises(ValueError):
        flops.profile(counted, 0.0)


def test_a_presets_compute_from_flops_runs_at_the_stated_fraction_of_peak():
    preset = load_preset("dgx-a100-hdr200")
    counted = flops.count("mlp", {"depth": 2, "width": 64}, 8)
    profile, overheads = compute_from_flops(preset, counted)
    assert profile.forward_s == pytest.approx(counted.forward / (312e12 * 0.4))
    assert overheads.writeback_s_per_byte == pytest.approx(2 / 2039e9)
