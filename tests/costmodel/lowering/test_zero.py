"""The sharded lowering (ZeRO stages 1-3) against timelines computed by hand; its memory, bytes and search.

No processes, no calibration: costs are written by hand.
"""

import dataclasses

import pytest

from commlab.costmodel.lowering.ddp import DDPSetting, StepCosts, breakdown, simulate_step
from commlab.costmodel.search.predict import ddp_columns
from commlab.costmodel.lowering.zero import (
    ShardedCosts,
    ShardedSetting,
    comm_bytes,
    padded_bytes,
    sharded_breakdown,
    sharded_buckets,
    simulate_sharded,
)
from commlab.costmodel.search.tune_sharded import ShardedCandidate, parse_stages, pick

MIB = 1 << 20


def step(**over) -> StepCosts:
    # Four 1 MiB parameters, ready in reverse module order, 0.1 s of backward each.
    base = dict(forward_s=0.2, ready_s=(0.1, 0.2, 0.3, 0.4), ready_order=(3, 2, 1, 0), param_nbytes=(MIB,) * 4,
                optimizer_s=0.04, nosync_s=0.4, writeback_s_per_byte=0.0, bucket_fixed_s=0.0, corun=1.0, kc=0.0,
                km=0.0, allreduce=lambda n: 0.05 * n / MIB)
    return StepCosts(**{**base, **over})


def costs(world=2, half=0.025, **over) -> ShardedCosts:
    return ShardedCosts(step(**over), lambda n: half * n / MIB, lambda n: half * n / MIB, world)


def run(c: ShardedCosts, **setting):
    s = ShardedSetting(bucket_cap_mb=1, **setting)
    result, buckets = simulate_sharded(c, s)
    return result, buckets, *sharded_breakdown(result, buckets, c, s)


def test_stage3_without_prefetch_waits_for_every_gather_on_the_critical_path():
    result, buckets, row, rows = run(costs(), stage=3, prefetch=0)
    assert buckets == [[0], [1], [2], [3]]  # forward order, one 1 MiB parameter each
    # forward: gather j (.025) then fwd j (.05), in turn: .3. Backward: regather3 .3-.325, grad3
    # -.425, RS3 -.45, regather2 (queued behind RS3) -.475, grad2 -.575, ... grad0 .775-.875, RS0
    # -.9, optimizer (.04 / 2 ranks) -.92
    assert row["forward"] == pytest.approx(0.3) and row["step"] == pytest.approx(0.92)
    assert row["exposed_allgather"] == pytest.approx(4 * 0.025 + 0.025 + 3 * 0.05)
    assert row["exposed_reducescatter"] == pytest.approx(0.025) and row["optimizer"] == pytest.approx(0.02)
    assert [r["done"] for r in rows] == pytest.approx([0.9, 0.75, 0.6, 0.45])
    gathers = [result.spans[f"gather{j}"] for j in range(4)]
    assert all(g.start == pytest.approx(result.spans[f"fwd{j - 1}"].end if j else 0.0) for j, g in enumerate(gathers))


def test_more_prefetch_never_lengthens_the_step_and_hides_gathers():
    steps = [run(costs(), stage=3, prefetch=p)[2] for p in (0, 1, 2, 3)]
    for a, b in zip(steps, steps[1:]):
        assert b["step"] <= a["step"] + 1e-12 and b["exposed_allgather"] <= a["exposed_allgather"] + 1e-12
    assert steps[1]["step"] < steps[0]["step"]
    # without reshard backward gathers nothing: never slower than resharding with the same prefetch
    kept = run(costs(), stage=3, prefetch=1, reshard=False)[2]
    assert kept["step"] <= steps[1]["step"] + 1e-12 and kept["comm_bytes"] < steps[1]["comm_bytes"]


def test_stage2_costs_as_ddp_when_reduce_scatter_plus_all_gather_is_the_all_reduce():
    # One rank (no padding, the whole optimizer): RS + AG = AR. DDP exposes the last all-reduce
    # (.05) after backward; stage 2 the first gather (.025) before forward and the last RS (.025).
    c = costs(world=1)
    _, _, row, _ = run(c, stage=2)
    result, buckets = simulate_step(c.step, DDPSetting(bucket_cap_mb=1, first_bucket_mb=1))
    ddp = breakdown(result, buckets, c.step)[0]
    assert row["step"] == pytest.approx(ddp["step"], rel=1e-9)
    assert row["exposed_allgather"] == pytest.approx(0.025) and row["exposed_reducescatter"] == pytest.approx(0.025)
    # stage 1 reduces with the all-reduce (.05 exposed) and gathers too: slower than stage 2 by a gather
    assert run(c, stage=1)[2]["step"] == pytest.approx(ddp["step"] + 0.025)


def test_peak_bytes_fall_with_the_stage_and_comm_bytes_follow_the_standard_accounting():
    c = costs(world=4)
    total = 4 * MIB
    peaks = {s: run(c, stage=s, prefetch=0, optimizer_bytes=8)[2]["peak_bytes"] for s in (1, 2, 3)}
    ddp = ddp_columns(c.step, 4)["peak_bytes"] + 2 * total  # + Adam's 8 bytes per 4-byte parameter
    assert ddp > peaks[1] > peaks[2] > peaks[3]
    # stage 3, prefetch 0: p+g+K sharded (16 / 4 bytes per parameter) + one gathered bucket + two
    # full gradient buckets (one reduce-scatter in flight while the last bucket fills), when the
    # gradient shards of the other three exist but not the last one's (1/4 MiB less than held) +
    # autograd's gradient of the largest parameter before its copy into the bucket (the copy-out's
    # rank-major buffer is gone by then)
    assert peaks[3] == 4 * MIB + MIB + 2 * MIB - MIB // 4 + MIB
    # Gloo's all-gather stages each bucket in flight through a copy of its own: one bucket more
    # with a gather ahead, none without (the bucket in use is gathered before its gradients come)
    staged = dataclasses.replace(c, staged_gather=True)
    assert run(staged, stage=3, prefetch=0, optimizer_bytes=8)[2]["peak_bytes"] == peaks[3]
    assert run(staged, stage=3, prefetch=1, optimizer_bytes=8)[2]["peak_bytes"] == peaks[3] + 2 * MIB
    assert run(c, stage=3, prefetch=2, optimizer_bytes=8)[2]["peak_bytes"] == peaks[3] + 2 * MIB
    sent = {s: run(c, stage=s)[2]["comm_bytes"] for s in (1, 2, 3)}
    assert sent == {1: 3 * total * 3 // 4, 2: 2 * total * 3 // 4, 3: 3 * total * 3 // 4}
    assert ddp_columns(c.step, 4)["comm_bytes"] == 2 * total * 3 // 4


def test_buckets_are_padded_to_the_world_size_and_settings_are_checked():
    c = costs(world=3, param_nbytes=(40, 4, 4, 4))  # 10 + 1 + 1 + 1 elements
    assert padded_bytes(c, [[0], [1, 2, 3]]) == [12 * 4, 3 * 4]  # rows unknown: each bucket as one vector
    # With the rows, every parameter's rows are padded as the wrapper's layout pads them: the
    # layout itself is the oracle (shapes (5, 2), (1,), (1,), (1,) at world size 3: 6 + 3 x 3 rows)
    from commlab.sharded.layout import shard_layout

    shapes = [(5, 2), (1,), (1,), (1,)]
    rows = dataclasses.replace(c, rows=tuple(sh[0] for sh in shapes))
    want = [shard_layout([shapes[p] for p in b], 3).padded * 4 for b in ([0], [1, 2, 3])]
    assert padded_bytes(rows, [[0], [1, 2, 3]]) == want == [12 * 4, 9 * 4]
    for bad in (dict(stage=0), dict(stage=4), dict(prefetch=-1), dict(bucket_cap_mb=0)):
        with pytest.raises(ValueError):
            ShardedSetting(**bad)
    assert comm_bytes(costs(world=1), ShardedSetting(stage=2), [[0, 1, 2, 3]]) == 0


def test_the_search_picks_the_fastest_that_fits_and_names_the_smallest_peak_otherwise():
    fast = ShardedCandidate(0, "native", 25, 0, True, 1.0, 100)
    slow = ShardedCandidate(3, "native", 25, 1, True, 2.0, 10)
    assert pick([fast, slow], None) is fast and pick([fast, slow], 50) is slow
    with pytest.raises(ValueError, match=r"smallest predicted peak is .*\(10 bytes; stage 3"):
        pick([fast, slow], 5)
    assert parse_stages("auto") == (0, 1, 2, 3) and parse_stages("2") == (2,)
    for bad in ("4", "x", -1):
        with pytest.raises(ValueError, match="stage"):
            parse_stages(bad)


@pytest.mark.parametrize("cap_mb", [0.01, 0.02, 0.05, 25.0])
def test_predicted_buckets_are_the_sharded_wrappers_own(cap_mb):
    """The lowering's buckets are those ShardedDataParallel makes (commlab/sharded/buckets.py)."""
    from commlab.models import build_workload
    from commlab.ddp.policy import make_policy
    from commlab.sharded.buckets import plan_buckets

    model = build_workload("mlp", depth=3, width=64).model
    nbytes = tuple(p.numel() * p.element_size() for p in model.parameters())
    c = costs(param_nbytes=nbytes, ready_s=tuple(0.01 * (j + 1) for j in range(len(nbytes))),
              ready_order=tuple(reversed(range(len(nbytes)))))
    assert sharded_buckets(c, ShardedSetting(bucket_cap_mb=cap_mb)) == plan_buckets(model, make_policy("size_cap", bucket_cap_mb=cap_mb), None).buckets


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_copies_around_the_collectives_and_fresh_gather_buffers_are_priced(stage):
    plain = costs()
    copying = dataclasses.replace(costs(writeback_s_per_byte=1e-8), fresh=lambda n: 0.01 * n / MIB)
    a, buckets, row_a, _ = run(plain, stage=stage, prefetch=0)
    b, _, row_b, _ = run(copying, stage=stage, prefetch=0)
    full = padded_bytes(plain, buckets)
    for j, size in enumerate(full):
        # the gather's buffer is allocated anew at every stage (stages 1-2 fault their own block while
        # copying it in, on the training thread); the copy-out runs on the training thread
        received = 0.01 * size / MIB * (0.5 if stage < 3 else 1.0)
        assert b.spans[f"gather{j}"].length == pytest.approx(a.spans[f"gather{j}"].length + received)
        refill = 0.01 * size / MIB if stage == 3 else 0.0  # stage 3's parameters' storage, fresh again
        assert b.spans[f"fwd{j}"].length == pytest.approx(a.spans[f"fwd{j}"].length + 1e-8 * size + refill)
    copy_in = (1e-8 + 0.01 / MIB) * sum(full) / 2 if stage < 3 else 0.0  # stages 1-2: the new rows in
    assert b.spans["optimizer"].length == pytest.approx(a.spans["optimizer"].length + copy_in)
    assert row_b["step"] > row_a["step"]


def test_activations_are_freed_as_gradients_are_made_in_backward():
    # Stage 1, four 1 MiB buckets of equal backward time, SGD (no optimizer state): held are the
    # replica and the full gradients (8 MiB); autograd's largest gradient 1 MiB on top.
    def peak(activations):
        c = dataclasses.replace(costs(world=2), activation_bytes=activations)
        return run(c, stage=1, prefetch=0)[2]["peak_bytes"]

    held = 8 * MIB
    # The activations are largest as backward starts, before any of the step's gradients exist
    # (zero_grad dropped the last ones): A - 4 MiB over the held bytes, not A (both maxima added)
    assert peak(8 * MIB) == held + 8 * MIB - 4 * MIB + MIB
    assert peak(16 * MIB) == held + 16 * MIB - 4 * MIB + MIB
    # small activations: the gradients, made one bucket at a time, never exceed what is held, and
    # the all-gather after the step is the largest moment
    assert peak(2 * MIB) == peak(0) < held + 2 * MIB
