"""The planner's per-stage profile: which stages are timed, that their times replace the per-layer sums."""

import pytest
import torch
import torch.nn.functional as F

from commlab.costmodel.planner.plan import LayerProfile, candidates
from commlab.costmodel.planner.stages import StageTimes, profile_stages, stage_ranges, with_stages
from commlab.models import mlp


def test_stage_ranges_are_every_stage_a_candidate_plan_can_have():
    # 6 equal layers on 2 ranks: 2 stages of 3 (v=1), 4 stages 1,1,2,2 (v=2: the later stages get the extra layer).
    ranges = stage_ranges([1.0] * 6, 2, [1, 2], ["1f1b"], "uniform")
    assert ranges == {(0, 3), (3, 3)}  # 1f1b is one stage per rank whatever --virtual says
    ranges = stage_ranges([1.0] * 6, 2, [1, 2], ["1f1b", "interleaved"], "uniform")
    assert ranges == {(0, 3), (3, 3), (0, 1), (1, 1), (2, 2), (4, 2)}
    # zb-v always has two stages per rank; by time, a slow first layer stands alone.
    assert stage_ranges([4.0, 1.0, 1.0, 1.0, 1.0], 2, [1], ["zb-v"], "time") == {(0, 1), (1, 1), (2, 1), (3, 2)}


def test_whole_stage_times_replace_the_per_layer_sums():
    layer = LayerProfile(seconds=[3.0, 3.0, 3.0], saved=[0.0] * 3, output=[8.0] * 3, params=[0.0] * 3, input_bytes=8.0,
                         forward=[1.0] * 3, input_grad=[1.0] * 3, weight_grad=[1.0] * 3)  # fmt: skip
    timed = with_stages({4: layer}, {4: {(0, 1): StageTimes(1.5, 2.0, 2.5, 3.0, 1.0),
                                        (1, 2): StageTimes(2.5, 3.0, 5.0, 4.0, 4.0)}})[4]  # fmt: skip
    plain, split = timed.stage_profile([1, 2], split=False), timed.stage_profile([1, 2], split=True)
    assert plain.forward == (1.5, 2.5) and plain.backward == (2.5, 5.0)
    assert split.forward == (2.0, 3.0) and split.backward == (4.0, 8.0) and split.weight_share == pytest.approx(5 / 12)
    assert plain.message_bytes == (8.0,)
    # A balance with a stage never timed falls back to the per-layer sums.
    assert timed.stage_profile([2, 1], split=False).forward == (2.0, 1.0)
    # The planner reads them: the stage-timed plan is slower here, as its stages are.
    (fast,) = candidates({4: layer}, 2, [1], ["never"], ["1f1b"], balance_mode="uniform")
    assert fast.balance == (1, 2)
    (slow,) = candidates({4: timed}, 2, [1], ["never"], ["1f1b"], balance_mode="uniform")
    assert slow.step_time > fast.step_time


def test_stages_are_timed_with_the_executors_compute_and_leave_no_gradients():
    torch.manual_seed(0)
    model = mlp(2, 16)
    x, t = torch.randn(4, 16), torch.randint(0, 10, (4,))
    times = profile_stages(list(model), x, {(0, 2), (2, 3)}, lambda y: F.cross_entropy(y, t), repeat=2)
    assert set(times) == {(0, 2), (2, 3)}
    for s in times.values():
        assert min(s.forward, s.split_forward, s.backward, s.weight_grad) > 0
    assert times[(2, 3)].input_grad > 0  # the first stage has no input gradient to make
    assert all(p.grad is None for p in model.parameters())
    plain = profile_stages(list(model), x, {(0, 5)}, lambda y: F.cross_entropy(y, t), split=False, repeat=1)[(0, 5)]
    assert plain.input_grad == plain.weight_grad == 0.0 and plain.split_forward == plain.forward


def test_the_calibration_count_is_one_no_plan_uses_and_every_schedule_accepts():
    from commlab.costmodel.planner.offgrid import calibration_count

    # 3 and 5 are odd (interleaved needs a multiple of 2 ranks), 4 is a plan's: 6.
    assert calibration_count([("1f1b", 1), ("interleaved", 2)], 2, [2, 4, 8, 16], 64) == 6
    assert calibration_count([("1f1b", 1), ("zb-v", 2)], 2, [2, 4, 8, 16], 64) == 3
    assert calibration_count([("interleaved", 2)], 2, [2, 4], 5) is None  # no count up to the batch


def test_calibration_runs_cut_the_model_as_the_plans_do_and_hold_it_against_its_profile():
    from commlab.costmodel.planner.offgrid import calibration_runs, profiled_runs

    layer = LayerProfile(seconds=[3.0, 3.0, 6.0, 6.0], saved=[0.0] * 4, output=[8.0] * 4, params=[0.0] * 4, input_bytes=8.0,
                         forward=[1.0, 1.0, 2.0, 2.0])  # fmt: skip
    spec = calibration_runs(layer, 6, 2, [("1f1b", 1), ("zb-v", 2), ("interleaved", 4)], "uniform", {"depth": 4}, 60)
    alone = profiled_runs(layer, spec, 2)
    # interleaved v=4 needs 8 stages of 4 layers: not run.
    assert spec == {"depth": 4, "batch": 60, "microbatches": 6, "runs": [("1f1b", [2, 2]), ("zb-v", [1, 1, 1, 1])]}
    assert set(alone) == {("1f1b", 1), ("zb-v", 2)}
    profile, nograd = alone[("1f1b", 1)]
    assert list(profile.forward) == [2.0, 4.0] and list(nograd) == [2.0, 4.0]  # no stage timed whole: the per-layer sums


def test_per_schedule_overheads_price_only_their_own_plans():
    from commlab.costmodel.planner.calibrate import measured

    layer = LayerProfile(seconds=[3.0, 3.0], saved=[0.0] * 2, output=[0.0] * 2, params=[0.0] * 2, input_bytes=0.0,
                         forward=[1.0] * 2)  # fmt: skip
    system = measured(overhead=0.1)
    base = {p.schedule: p.step_time for p in candidates({4: layer}, 2, [1], ["never"], ["1f1b", "gpipe"], system)}
    priced = candidates({4: layer}, 2, [1], ["never"], ["1f1b", "gpipe"], system, overheads={("1f1b", 1): {"never": (0.5, 1.0)}})
    got = {p.schedule: p.step_time for p in priced}
    assert got["gpipe"] == base["gpipe"] and got["1f1b"] > base["1f1b"]
    # A stretch of 2 doubles every action's compute: 1F1B on 2 ranks, 4 micro-batches, no overhead.
    alone = candidates({4: layer}, 2, [1], ["never"], ["1f1b"])[0].step_time
    stretched = candidates({4: layer}, 2, [1], ["never"], ["1f1b"], overheads={("1f1b", 1): {"never": (0.0, 2.0)}})[0].step_time
    assert stretched == pytest.approx(2 * alone)


def test_offgrid_costs_are_the_stretch_against_the_profile_and_the_overhead_the_core_needs():
    from commlab.costmodel.terms.costs import StageProfile
    from commlab.costmodel.planner.calibrate import measured
    from commlab.costmodel.planner.offgrid import schedule_costs

    # 1F1B, 2 ranks, 1 micro-batch: F0 [0, 1] -> F1 [1.5, 2.5] -> B1 [2.6, 4.6] -> B0 [5.1, 7.1].
    # Profiled alone the stages took F 0.5, B 1.0: the pipeline's 6 s of compute is twice that.
    run = {"origins": [0.0], "timelines": [[]]}
    timelines = {0: [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 5.1, 7.1)], 1: [(1, "F", 0, 1.5, 2.5), (1, "B", 0, 2.6, 4.6)]}
    per_rank = [{"rank": r, "offgrid": {("1f1b", 1): {mode: {**run, "timelines": [timelines[r]]} for mode in ("never", "always")}}}
                for r in (0, 1)]  # fmt: skip
    alone = {("1f1b", 1): (StageProfile((0.5, 0.5), (1.0, 1.0)), (0.4, 0.4))}
    ((costs),) = schedule_costs(per_rank, 2, alone, 1, measured()).values()
    # The chain's 6 s of stretched compute, free messages: the 7.1 s step leaves 1.1 s over 4 actions.
    overhead, stretch = costs["never"]
    assert stretch == pytest.approx(2.0) and overhead == pytest.approx(1.1 / 4, rel=1e-6)
    # Checkpointed, the same timeline: alone F 0.4 (no grad), B 1.0 + 0.5 (recomputed): 3.8 s, 6 / 3.8 in the pipeline.
    overhead, stretch = costs["always"]
    assert stretch == pytest.approx(6 / 3.8) and overhead == pytest.approx(1.1 / 4, rel=1e-6)

def test_co_run_stage_times_are_the_median_over_ranks():
    from commlab.costmodel.planner.stages import StageTimes, co_run

    def times(f):
        return StageTimes(f, f, 2 * f, f, f, f / 2).__dict__

    per_rank = [{4: {(0, 2): times(1.0)}}, {4: {(0, 2): times(3.0)}}, {4: {(0, 2): times(2.5)}}]
    assert co_run(per_rank) == {4: {(0, 2): StageTimes(2.5, 2.5, 5.0, 2.5, 2.5, 1.25)}}
