"""The 3D lowering of a GPT: operator FLOPs against Narayanan et al.'s count, recomputation,
placement of the groups, the schedule's effect, and the errors a bad layout raises."""

import pytest

from commlab.costmodel.hardware.presets import load_preset
from commlab.costmodel.lowering import transformer as tf
from commlab.costmodel.lowering.layout3d import (Layout, data_parallel_group, machine_on, parameters_per_rank, predict,
                                                  stage_profile)

SMALL = tf.GPT(layers=8, hidden=1024, heads=16, seq=512, vocab=4096)
MACHINE = machine_on(load_preset("dgx-a100-hdr200"), 0.5)


def test_operator_flops_add_up_to_narayanans_count():
    b, t = 4, 2
    for gpt in (SMALL, tf.GPT(96, 12288, 96)):
        s, h = gpt.seq, gpt.hidden
        layer = sum(o.flops for o in tf.layer_ops(gpt, b, t))
        assert layer == pytest.approx(24 * b * s * h * h * (1 + s / (6 * h)) / t)  # section 3.3's per-layer forward
        logits = sum(o.flops for o in tf.logits_ops(gpt, b, t))
        # equation 3: forward, recomputed forward and a backward of twice the forward, per layer; logits without recompute
        whole = gpt.layers * 4 * layer * t + 3 * logits * t
        assert whole == pytest.approx(tf.model_flops(gpt, b))
        assert tf.model_flops(gpt, b, recompute=False) == pytest.approx(gpt.layers * 3 * layer * t + 3 * logits * t)


def test_recomputation_adds_a_forward_or_the_attention_core():
    ops = tf.layer_ops(SMALL, 2, 1)
    dev = MACHINE.device
    assert tf.recompute_seconds(ops, dev, "full") == pytest.approx(tf.forward_seconds(ops, dev))
    core = tf.recompute_seconds(ops, dev, "selective")
    assert 0 < core < tf.forward_seconds(ops, dev)
    assert core == pytest.approx(tf.forward_seconds(tuple(o for o in ops if o.attention_core), dev))
    base = Layout(1, 1, 1, 2, 2, recompute="none")
    for mode in ("full", "selective"):
        more = stage_profile(SMALL, Layout(1, 1, 1, 2, 2, recompute=mode), MACHINE).backward[0]
        less = stage_profile(SMALL, base, MACHINE).backward[0]
        assert more - less == pytest.approx(SMALL.layers * tf.recompute_seconds(ops, dev, mode))


def test_a_narrow_model_runs_fewer_flops_per_second_than_a_wide_one():
    # the same device, the same efficiency: the softmax over b a s^2 scores is bandwidth-bound
    dev = MACHINE.device

    def rate(gpt):
        ops = tf.layer_ops(gpt, 1, 1)
        return sum(o.flops for o in ops) / tf.forward_seconds(ops, dev)

    assert rate(tf.GPT(24, 2304, 24, 2048)) < 0.9 * rate(tf.GPT(128, 25600, 160, 2048))


def test_one_stage_one_replica_is_the_sum_of_its_parts():
    layout = Layout(1, 1, 1, 2, 8, recompute="full")
    profile = stage_profile(SMALL, layout, MACHINE)
    it = predict(SMALL, layout, MACHINE)
    (params,) = parameters_per_rank(SMALL, layout)
    assert params == pytest.approx(SMALL.parameters(), rel=0.01)  # section 5.1's count, biases aside
    adam = MACHINE.device.seconds(0.0, 7 * 4 * params)  # no data parallelism: no all-reduce before it
    assert it.seconds == pytest.approx(4 * (profile.forward[0] + profile.backward[0]) + adam)


def test_interleaving_shrinks_the_bubble():
    gpt = tf.GPT(layers=16, hidden=2048, heads=16, seq=1024, vocab=8192)
    plain = predict(gpt, Layout(8, 4, 1, 1, 8, "1f1b", 1), MACHINE)
    interleaved = predict(gpt, Layout(8, 4, 1, 1, 8, "interleaved", 2), MACHINE)
    assert interleaved.seconds < plain.seconds
    assert plain.tflops_per_gpu * plain.seconds == pytest.approx(interleaved.tflops_per_gpu * interleaved.seconds)


def test_data_parallel_groups_share_the_nics_of_a_node():
    net = MACHINE.network
    across = data_parallel_group(Layout(8, 64, 6, 1, 3072), net)
    assert (across.size, across.per_node, across.sharing) == (6, 1, 8)
    packed = data_parallel_group(Layout(1, 1, 32, 16, 512), net)
    assert (packed.size, packed.per_node, packed.sharing) == (32, 8, 1)
    half = data_parallel_group(Layout(2, 1, 32, 16, 512), net)
    assert (half.per_node, half.sharing) == (4, 2)


@pytest.mark.parametrize("layout, gpus, match", [
    (Layout(3, 1, 1, 1, 1), None, "divide the 16 attention heads"),
    (Layout(2, 2, 2, 1, 8), 16, "= 8, not the 16 GPUs"),
    (Layout(1, 3, 1, 1, 3), None, "do not split"),
    (Layout(1, 1, 2, 2, 6), None, "whole number of micro-batches"),
    (Layout(1, 2, 1, 1, 3, "interleaved", 2), None, "multiple of pp"),
    (Layout(1, 2, 1, 1, 4, "1f1b", 2), None, "one stage per rank"),
    (Layout(1, 1, 1, 1, 1, recompute="most"), None, "recompute"),
])
def test_bad_layouts_raise_before_anything_is_priced(layout, gpus, match):
    with pytest.raises(ValueError, match=match):
        predict(SMALL, layout, MACHINE, gpus)


def test_bad_shapes_and_devices():
    with pytest.raises(ValueError, match="multiple of heads"):
        tf.GPT(4, 1000, 16)
    with pytest.raises(ValueError, match="efficiency"):
        tf.Device(1e12, 1e9, 1.5)
