"""Published DDP step times on V100 against the model on the V100 preset (commlab/validation/
published/ddp_paper.py). Pure: FLOPs counted on the meta device, no process, no GPU; the rows are
the real held-out data, so these fail if the model drifts."""

import pytest

from commlab.costmodel.hardware.presets import allreduce_cost, load_preset
from commlab.validation.published import ddp_paper

BAR = 0.20  # the DDP paper's bar: per-iteration latency at 8-256 GPUs within 20%
BAR_MODELS = ("resnet50", "bert")
# Bucket rows whose published 1 MB penalty the model does not reproduce in sign. None since the
# presets price compute slowed beside NCCL (overlap_slowdown): without it ~100 overlapped 1 MB
# all-reduces cost nothing and ResNet50 at 16 GPUs flipped (docs/measurements.md, 2026-11-27).
KNOWN_ORDER_MISSES: set = set()
NOISE = 0.01  # a throughput change under 1% is within the source's p50-p95 spread


def test_the_v100_preset_loads_and_its_all_reduce_picks_plausible_algorithms():
    preset = load_preset("dgx1-v100-edr100")
    assert (preset["device"], preset["arch"], preset["gpus_per_node"]) == ("V100", "volta", 8)
    one_node, two_nodes, many = (allreduce_cost(preset, n) for n in (8, 16, 256))
    # NVLink inside a node: rings, approaching the links' bus bandwidth at large sizes
    assert one_node.algorithm(1 << 30) == "ring"
    assert 0.9 * 120 < one_node.bus_bandwidth(1 << 30) <= 120
    # across nodes the four 100 Gb/s NICs bound it, whichever algorithm NCCL's model picks
    assert two_nodes.bus_bandwidth(1 << 30) <= 4 * 12.0 < one_node.bus_bandwidth(1 << 30)
    assert two_nodes.algorithm(100 << 20) == "ring"
    # at 32 nodes a ring's 2 (n - 1) steps cost more than the tree's log2 hops for small buckets
    assert many.algorithm(1 << 20) == "tree"
    assert many(1 << 20) > two_nodes(1 << 20) > one_node(1 << 20) > 0


@pytest.mark.slow  # seconds of FLOP counting per model: outside the quick run
def test_rows_have_the_registry_keys_and_their_error_is_predicted_over_published():
    rows = ddp_paper.rows()
    keys = {"table", "case", "metric", "published", "predicted", "error", "source"}
    assert rows and all(set(r) == keys for r in rows)
    for r in rows:
        assert r["published"] > 0 and r["predicted"] > 0 and r["source"]
        assert r["error"] == pytest.approx(r["predicted"] / r["published"] - 1)


@pytest.mark.slow  # seconds of FLOP counting: outside the quick run
def test_one_efficiency_from_one_row_reproduces_that_row_which_is_left_out():
    eff = ddp_paper.efficiency()
    assert 0.05 < eff < 1.0
    row = ddp_paper.load()["efficiency_row"]
    case = (row["model"], row["gpus"], 25.0)
    published = next(r["seconds"] for r in ddp_paper.load()["latency"] if (r["model"], r["gpus"]) == case[:2])
    assert ddp_paper.predict([case], eff)[case] == pytest.approx(published, rel=1e-6)
    assert f"{row['model']} {row['gpus']} GPUs 25 MB" not in {r["case"] for r in ddp_paper.rows()}


def test_latency_at_8_gpus_and_more_is_within_the_bar():
    checked = []
    for r in ddp_paper.load()["latency"]:
        if r["model"] in BAR_MODELS and r["gpus"] >= 8:
            row = next(x for x in ddp_paper.rows() if x["case"] == f"{r['model']} {r['gpus']} GPUs 25 MB")
            assert abs(row["error"]) <= BAR, row
            checked.append(row)
    assert checked, "no held-out row at 8 GPUs or more to hold the bar against"


@pytest.mark.slow  # seconds of FLOP counting per model: outside the quick run
def test_the_bucket_ordering_is_kept_where_the_source_tells_the_sizes_apart():
    misses, checked = set(), 0
    for r in ddp_paper.load()["bucket"]:
        if abs(r["change"]) < NOISE:
            continue
        checked += 1
        if ddp_paper.bucket_ordering(r["model"], r["gpus"]) != ddp_paper.published_ordering(r):
            misses.add((r["model"], r["gpus"]))
    assert checked >= 10
    assert misses == KNOWN_ORDER_MISSES


def test_the_orderings_are_what_they_say():
    assert ddp_paper.published_ordering({"change": -0.02}) == [25.0, 1.0]
    assert ddp_paper.published_ordering({"change": 0.02}) == [1.0, 25.0]
    ordering = ddp_paper.bucket_ordering("resnet50", 8, sizes=(1.0, 25.0, 100.0))
    assert sorted(ordering) == [1.0, 25.0, 100.0]
    times = ddp_paper.predict([("resnet50", 8, s) for s in ordering], ddp_paper.efficiency())
    assert [times[("resnet50", 8, s)] for s in ordering] == sorted(times.values())
