"""Tensor and sequence parallelism's collectives per GPT layer: counts, bytes, and their time."""

import pytest

from commlab.costmodel.hardware.presets import load_preset, network
from commlab.costmodel.lowering import tensor
from commlab.costmodel.hardware.nccl import Group, collective_seconds
from commlab.costmodel.lowering.transformer import GPT
from commlab.runs.traffic import bus_factor

GPT3 = GPT(layers=96, hidden=12288, heads=96)
X = 1 * 2048 * 12288 * 2  # one micro-batch's activation, b s h 2-byte elements


def ops(collectives):
    return [(c.op, c.nbytes, c.overlapped) for c in collectives]


def test_tensor_parallel_all_reduces_twice_each_way_and_again_when_recomputed():
    full = tensor.layer(GPT3, 1, 8, recompute="full")
    assert ops(full["forward"]) == [("all_reduce", X, False)] * 2
    assert ops(full["backward"]) == [("all_reduce", X, False)] * 2
    assert ops(full["recompute"]) == ops(full["forward"])
    assert tensor.layer(GPT3, 1, 8, recompute="selective")["recompute"] == ()  # the attention core has none
    assert tensor.layer(GPT3, 1, 8, recompute="none")["recompute"] == ()


def test_sequence_parallelism_gathers_and_scatters_the_same_bytes():
    sp = tensor.layer(GPT3, 1, 8, sequence_parallel=True, recompute="full")
    assert ops(sp["forward"]) == [("all_gather", X, False), ("reduce_scatter", X, False)] * 2
    assert sorted(ops(sp["backward"])) == sorted([("all_gather", X, False), ("all_gather", X, True),
                                                 ("reduce_scatter", X, False)] * 2)
    plain = tensor.layer(GPT3, 1, 8, recompute="full")

    def ring_bytes(collectives):
        return sum(bus_factor(c.op, 8) * c.nbytes for c in collectives if not c.overlapped)

    for phase in ("forward", "backward", "recompute"):
        assert ring_bytes(sp[phase]) == pytest.approx(ring_bytes(plain[phase]))


def test_one_rank_and_a_bad_split():
    assert tensor.layer(GPT3, 1, 1) == {"forward": (), "backward": (), "recompute": ()}
    assert tensor.seconds(tensor.layer(GPT3, 1, 8)["forward"], network(load_preset("dgx-a100-hdr200")), 1) == 0.0
    with pytest.raises(ValueError, match="divide the 96 attention heads"):
        tensor.layer(GPT3, 1, 5)


def test_a_gather_and_a_scatter_take_about_one_all_reduce_on_nvlink():
    net = network(load_preset("dgx-a100-hdr200"))
    group = tensor.group(net, 8)
    assert group == Group(8, 8)
    pair = collective_seconds(net, "all_gather", X, group) + collective_seconds(net, "reduce_scatter", X, group)
    assert pair == pytest.approx(collective_seconds(net, "all_reduce", X, group), rel=0.1)
    overlapped = tensor.layer(GPT3, 1, 8, sequence_parallel=True)["backward"]
    assert tensor.seconds(overlapped, net, 8) == pytest.approx(
        sum(collective_seconds(net, c.op, c.nbytes, group) for c in overlapped if not c.overlapped))
