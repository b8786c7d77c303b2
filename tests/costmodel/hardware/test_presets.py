"""What-if on hardware presets: datasheet inputs only, every collective the lowerings read, the
compute from FLOPs, and predictions labelled with their assumptions. Pure: no process, no GPU."""

import pytest

from commlab.costmodel.hardware import flops, nccl
from commlab.costmodel.hardware.presets import (assumptions, collective_cost, compute_from_flops, load_preset, network,
                                                preset_names, system_on)
from commlab.costmodel.terms.costs import Overheads

@pytest.mark.parametrize("name", preset_names())
def test_presets_take_no_measured_figure_as_input(name):
    preset = load_preset(name)
    assert "published" not in preset  # measurements are held out (commlab/validation/published)
    assert 0 <= float(preset["overlap_slowdown"]) < 1 and preset["source"]


def test_a_presets_system_prices_every_collective_the_lowerings_read_and_slows_compute_beside_them():
    preset = load_preset("dgx-a100-hdr200")
    system = system_on(preset, Overheads(), 64)
    net = network(preset)
    for key, op in (("allreduce", "all_reduce"), ("reduce_scatter", "reduce_scatter"), ("all_gather", "all_gather")):
        assert system.collective(key, "native", 64)(1 << 26) == nccl.collective_seconds(
            net, op, 1 << 26, nccl.Group(64, 8))
    assert system.contention_of("native").kc == pytest.approx(0.189) and system.contention_of("native").km == 0
    assert "19% slower" in assumptions(preset, "compute from FLOPs")
    with pytest.raises(ValueError, match="do not fit"):
        collective_cost(preset, "all_gather", nccl.Group(16, 4, sharing=4))


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
