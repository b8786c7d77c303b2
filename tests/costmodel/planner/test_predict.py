"""Predicted step time on the shared core, and the planner: pure, worked by hand where possible."""

from dataclasses import replace

import pytest
from click.testing import CliRunner

from commlab.cli import main
from commlab.pipeline import build, simulate
from commlab.costmodel.planner.plan import (
    LayerProfile,
    best,
    candidates,
    param_copies,
    peak_bytes,
    temporaries,
)
from commlab.costmodel.terms.costs import CollectiveCost, Overheads, PointToPoint, StageProfile, SystemCosts
from commlab.costmodel.lowering.pipeline import DataParallel, lower, predict
from commlab.costmodel.planner.calibrate import measured as calibration


def Costs(forward, backward, weight_share=0.5, message_bytes=(), alpha=0.0, beta=0.0, overhead=0.0, optimizer=0.0):
    """The (system, stage profile) pair the lowering reads, from the terms these tests state."""
    system = SystemCosts(p2p=PointToPoint(alpha, beta), overheads=Overheads(action_s=overhead))
    return system, StageProfile(tuple(forward), tuple(backward), weight_share, tuple(message_bytes), optimizer_s=optimizer)


def test_predict_adds_what_the_executor_does_to_the_schedule():
    gp = build("gpipe", 2, 1)
    # One micro-batch: F0 (1) -> message (alpha 0.5 + 100 bytes * 0.01) -> F1 (1) -> B1 (2) -> message -> B0 (2).
    costs = Costs([1, 1], [2, 2], message_bytes=[100], alpha=0.5, beta=0.01)
    assert predict(gp, *costs).step_time == pytest.approx(6 + 2 * 1.5)
    # Per-action overhead: four actions in a chain.
    assert predict(gp, *Costs([1, 1], [2, 2], overhead=0.25)).step_time == pytest.approx(6 + 4 * 0.25)
    # Recomputation: a checkpointed micro-batch's backward pays its forward again.
    assert predict(gp, *Costs([1, 1], [2, 2]), checkpointed=[0]).step_time == pytest.approx(6 + 2)
    # Data-parallel all-reduce tail and optimizer: each stage's one bucket after its last
    # backward (rank 0's B0 ends at 6, rank 1's B1 at 4), then the optimizer.
    system, stage = Costs([1, 1], [2, 2], optimizer=0.25)
    system = replace(system, collectives={("allreduce", "native", 2): CollectiveCost((100, 300), (0.5, 3.0))})
    tail = replace(stage, param_nbytes=((100,), (300,)))
    assert predict(gp, system, tail, dp=DataParallel(2)).step_time == pytest.approx(max(6 + 0.5, 4 + 3.0) + 0.25)
    assert predict(gp, system, tail).step_time == pytest.approx(6 + 0.25)  # no data parallelism: the optimizer alone


def test_a_send_completes_only_once_the_receive_is_posted():
    # NCCL: rank 1 posts the receive for 1F1 only after 1B0 (with 1B0's sends); with a slow 1B0,
    # 0F1's message waits and so does rank 0's wait on that send before 0B0 (torch's Schedule1F1B
    # pattern). Gloo: the receive goes out after the previous receiving action, 1F0.
    one_f = build("1f1b", 2, 2)
    nccl = {t.name: t for t in lower(one_f, *Costs([1, 1], [2, 2]), lookahead=False)}
    assert "1B0" in nccl["msg 0F1>1F1"].deps and "msg 0F1>1F1" in nccl["0B0"].deps
    gloo = {t.name: t for t in lower(one_f, *Costs([1, 1], [2, 2]))}
    assert "1F0" in gloo["msg 0F1>1F1"].deps and "1B0" not in gloo["msg 0F1>1F1"].deps
    # zb-v runs W's and same-rank hand-overs between receives: posting late costs it time.
    zbv, costs = build("zb-v", 2, 8, 2), Costs([1.0] * 4, [2.0] * 4, alpha=0.3)
    assert predict(zbv, *costs).step_time < 0.95 * predict(zbv, *costs, lookahead=False).step_time
    # Without posting and waits the core gives exactly the schedule-only simulation.
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)):
        actions = build(name, 3, 6, v)
        alone = lower(actions, *Costs([1.0] * 3 * v, [2.0] * 3 * v), posting=False, waits=False, contention=False)
        from commlab.sim import simulate as core

        assert core(alone).makespan == pytest.approx(simulate(actions, 1.0, 2.0).step_time)
        # The executor's extra waits can only delay.
        assert predict(actions, *Costs([1.0] * 3 * v, [2.0] * 3 * v)).step_time >= simulate(actions, 1.0, 2.0).step_time - 1e-9


def test_zero_bubble_predicted_faster_than_1f1b():
    costs = Costs([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], alpha=0.05)
    assert predict(build("zb-h1", 3, 8), *costs).step_time < predict(build("1f1b", 3, 8), *costs).step_time


def test_peak_bytes_follow_the_schedule():
    # Two stages, 1 byte saved and 1 byte of input per micro-batch, no params.
    g, f = build("gpipe", 2, 4), build("1f1b", 2, 4)
    args = ((0, 1), [1.0, 1.0], [1.0, 1.0], [0.0, 0.0])
    assert peak_bytes(g, *args, ()) == (8 + 2, 8 + 2)  # 4 micro-batches x 2 bytes + boundary buffers
    assert peak_bytes(f, *args, ()) == (4 + 2, 2 + 2)  # 1F1B: p - r micro-batches
    assert peak_bytes(g, *args, range(4))[0] == 4 + 1 + 2  # inputs only, one recomputed at a time


def test_memory_model_counts_optimizer_state_and_bucket_buffers():
    assert param_copies() == 2.0  # parameters and gradients
    assert param_copies(optimizer="momentum") == 3.0 and param_copies(optimizer="adam") == 4.0
    assert param_copies(dp=2, optimizer="adam") == 5.0  # DDP's flat bucket buffers
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        param_copies(optimizer="lion")
    layer = LayerProfile(seconds=[1.0] * 4, saved=[0.0] * 4, output=[0.0] * 4, params=[100.0] * 4, input_bytes=0.0)
    (plain,) = candidates({2: layer}, 2, [1], ["never"], ["1f1b"])
    (adam,) = candidates({2: layer}, 2, [1], ["never"], ["1f1b"], optimizer="adam")
    assert [a - p for a, p in zip(adam.peak_bytes, plain.peak_bytes)] == [2 * 200.0, 2 * 200.0]  # two states per byte
    # Equal layer counts, as the bench's --balance uniform, even where the times are not equal.
    skewed = LayerProfile(seconds=[1.0, 1.0, 1.0, 9.0], saved=[0.0] * 4, output=[0.0] * 4, params=[0.0] * 4, input_bytes=0.0)
    assert candidates({2: skewed}, 2, [1], ["never"], ["1f1b"])[0].balance == (3, 1)
    assert candidates({2: skewed}, 2, [1], ["never"], ["1f1b"], balance_mode="uniform")[0].balance == (2, 2)


def test_planner_picks_the_fastest_plan_that_fits():
    layer = LayerProfile(seconds=[1.0] * 8, saved=[100.0] * 8, output=[10.0] * 8, params=[1.0] * 8, input_bytes=10.0)
    plans = candidates({2: layer, 8: layer}, 2, [1, 2], ["never", "always"])
    assert plans == sorted(plans, key=lambda p: (p.step_time, max(p.peak_bytes)))
    assert {p.schedule for p in plans} >= {"gpipe", "1f1b", "zb-h1", "zb-v", "interleaved"}
    roomy, tight = best(plans, 1e9), best(plans, 700.0)
    assert roomy == plans[0]
    # The budget binds (the fastest plan needs more), so the pick below is a real choice ...
    assert max(roomy.peak_bytes) > 700.0 and tight != roomy
    # ... and it is the fastest that fits: it fits, and every faster plan does not.
    assert max(tight.peak_bytes) <= 700.0
    assert all(max(p.peak_bytes) > 700.0 for p in plans if p.step_time < tight.step_time)
    assert best(plans, 1.0) is None


@pytest.mark.slow
def test_plan_command_prints_the_plan():
    result = CliRunner().invoke(main, ["pipeline", "plan", "--depth", "2", "--width", "16", "--batch", "8",
                                       "-m", "2,4", "--budget-mb", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "plan: " in result.output and "predicted" in result.output
    assert "calibrated on 2 Gloo ranks: executor overhead" in result.output  # before any plan is priced
    result = CliRunner().invoke(main, ["pipeline", "plan", "--depth", "2", "--width", "16", "--batch", "8", "--budget-mb", "0.0001",
                                       "--no-calibrate"])  # fmt: skip
    assert result.exit_code != 0 and "no plan fits" in result.output and "calibrated" not in result.output
    # It says what the smallest plan needs, and a budget that fits it.
    need = float(result.output.split("the smallest peak any plan needs is ")[1].split()[0])
    suggested = float(result.output.split("try --budget-mb ")[1].split()[0])
    assert need <= suggested <= need + 1
    peaks = [float(line.split()[5]) for line in result.output.splitlines()[1:] if "over budget" in line]
    assert min(peaks) == pytest.approx(need, abs=0.01)


@pytest.mark.slow
def test_plan_validate_measures_the_grid_and_the_predicted_peaks_come_close():
    # A small grid on 2 Gloo ranks: the table, the verdict line, and each plan's peak as the
    # allocator saw it against the prediction (time is not asserted: the machine is shared).
    # Not a bound: the model misses what zb-h1's held-back W's keep beyond the output gradients
    # (docs/measurements.md), and tens of KiB the step allocates besides.
    result = CliRunner().invoke(main, ["pipeline", "plan", "--depth", "2", "--width", "256", "--batch", "16", "-m", "2,4",
                                       "--schedules", "gpipe,1f1b,zb-h1", "--checkpoint", "never,always", "--validate",
                                       "--iters", "2", "--warmup", "1"], catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
    table = [ln for ln in result.output.split("validating:")[1].splitlines()[2:] if ln.split()[:1] in (["gpipe"], ["1f1b"], ["zb-h1"])]
    rows = [ln.replace("<- pick", "").split() for ln in table]
    assert len(rows) == 12 and sum("<- pick" in line for line in table) == 1, table
    for row in rows:
        predicted, measured = float(row[-3]), float(row[-2])
        assert measured > 0 and abs(predicted - measured) <= 0.15 * measured, row
    assert "pick measured / best measured = " in result.output and "every plan and rank:" in result.output
    assert "(24 comparisons): median |error|" in result.output  # 12 plans, forward and reverse rounds


def test_profiled_forward_and_split_backward_set_the_planner_costs():
    layer = LayerProfile(seconds=[3.0, 6.0], saved=[0.0] * 2, output=[0.0] * 2, params=[0.0] * 2, input_bytes=0.0,
                         forward=[1.0, 1.0], input_grad=[1.5, 2.5], weight_grad=[1.0, 3.0])  # fmt: skip
    plain, split = layer.stage_profile([1, 1], split=False), layer.stage_profile([1, 1], split=True)
    assert list(plain.forward) == [1.0, 1.0] and list(plain.backward) == [2.0, 5.0]  # F + B minus F
    assert list(split.backward) == [2.5, 5.5] and split.weight_share == pytest.approx(4.0 / 8.0)  # I + W > B
    unknown = LayerProfile(seconds=[3.0], saved=[0.0], output=[0.0], params=[0.0], input_bytes=0.0).stage_profile([1], True)
    assert list(unknown.forward) == [1.0] and list(unknown.backward) == [2.0]  # 1 : 2 without a measurement


def _measured(actions, costs, shift):
    """One step's timelines per rank as the bench records them, from the core: each action's
    compute interval starts ``shift`` after the core starts it (the executor's own time)."""
    spans = predict(actions, *costs).result.spans.values()
    per_rank = [{"rank": r, "origins": [0.0], "timelines": [[]]} for r in range(len(actions))]
    for sp in sorted((sp for sp in spans if "action" in sp.meta), key=lambda sp: sp.start):
        a = sp.meta["action"]
        per_rank[sp.meta["rank"]]["timelines"][0].append((a.stage, a.kind, a.microbatch, sp.start + shift, sp.end))
    return per_rank


def test_planner_prices_a_plan_exactly_as_the_bench_predictor():
    from commlab.costmodel.calibration.pipeline import calibrated_costs, predicted_step
    actions = build("1f1b", 2, 4)
    per_rank = _measured(actions, Costs([1.0, 1.5], [2.0, 3.0], alpha=0.3, overhead=0.2), shift=0.2)
    system, bench = calibrated_costs(per_rank, 2)
    alpha, overhead = system.p2p.alpha_s, system.overheads.action_s
    assert alpha > 0 and overhead > 0  # both terms really enter the comparison
    # The same costs as a profile (one layer per stage) and a plan-time calibration.
    f, b = list(bench.forward), list(bench.backward)
    layer = LayerProfile(seconds=[x + y for x, y in zip(f, b)], saved=[0.0] * 2, output=[0.0] * 2, params=[0.0] * 2,
                         input_bytes=0.0, forward=f)  # fmt: skip
    (plan,) = candidates({4: layer}, 2, [1], ["never"], ["1f1b"], calibration(alpha=alpha, overhead=overhead))
    assert plan.step_time == pytest.approx(predicted_step({"schedule": "1f1b"}, per_rank, actions, 2, 2), rel=1e-12)
    assert plan.step_time > candidates({4: layer}, 2, [1], ["never"], ["1f1b"])[0].step_time  # compute alone is less


def test_planner_prices_boundary_bytes_and_recomputation_on_the_core():
    from commlab.costmodel.planner.calibrate import fit_line

    layer = LayerProfile(seconds=[3.0, 3.0, 3.0, 3.0], saved=[0.0] * 4, output=[100.0, 400.0, 100.0, 7.0], params=[0.0] * 4,
                         input_bytes=0.0, forward=[1.0] * 4)  # fmt: skip
    (plan,) = candidates({4: layer}, 2, [1], ["always"], ["gpipe"], calibration(alpha=0.1, beta=0.001, overhead=0.05))
    assert plan.balance == (2, 2)
    # The boundary after stage 0 is layer 1's output: 400 bytes, each way.
    costs = Costs([2.0, 2.0], [4.0, 4.0], message_bytes=[400.0], alpha=0.1, beta=0.001, overhead=0.05)
    assert plan.step_time == pytest.approx(predict(build("gpipe", 2, 4), *costs, checkpointed=range(4)).step_time)
    # Memory sees the same boundary: stage 1 stashes 4 checkpointed inputs of 400 bytes, and each
    # side of the boundary holds a receive and a send buffer of it; the backward's temporaries are
    # a layer's input and output gradients at once: 100 + 400 on stage 0 (layer 1), 400 + 100 on stage 1 (layer 2).
    assert temporaries([100.0, 400.0, 100.0, 7.0], 0.0, [2, 2]) == [500.0, 500.0]
    # a layer's new parameter gradients are alive beside its input and output gradients
    assert temporaries([100.0, 400.0, 100.0, 7.0], 0.0, [2, 2], [50.0, 0.0, 1000.0, 0.0]) == [500.0, 1500.0]
    args = (build("gpipe", 2, 4), (0, 1), [0.0, 0.0], [0.0, 400.0], [0.0, 0.0], range(4))
    assert plan.peak_bytes == peak_bytes(*args, temporary=[500.0, 500.0])
    assert peak_bytes(*args) == (800.0, 4 * 400.0 + 800.0) and plan.peak_bytes == (800.0 + 500.0, 4 * 400.0 + 800.0 + 500.0)
    assert fit_line([0, 100, 200], [1.0, 2.0, 3.0]) == pytest.approx((1.0, 0.01))
    assert fit_line([0, 100], [2.0, 1.0]) == (pytest.approx(1.5), 0.0)  # noise: no negative slope


def test_more_ranks_than_cores_share_them_and_calibration_inverts_it():
    from commlab.costmodel.calibration.pipeline import calibrated_costs, predicted_step
    from commlab.costmodel.lowering.pipeline import sharing

    actions, costs = build("1f1b", 3, 6), Costs([1.0, 1.5, 1.0], [2.0, 3.0, 2.0])
    alone = predict(actions, *costs).step_time
    assert predict(actions, *costs, cores=3).step_time == alone  # one core per rank: nothing shared
    crowded = predict(actions, *costs, cores=2)
    assert alone < crowded.step_time <= alone * 1.5  # at worst every action at 2/3 speed
    # A chain never overlaps, so it never slows: gpipe with one micro-batch.
    assert predict(build("gpipe", 3, 1), *costs, cores=2).step_time == pytest.approx(predict(build("gpipe", 3, 1), *costs).step_time)
    assert sharing(2)(None, [None, None]) == pytest.approx(2 / 3) and sharing(2)(None, [None]) == 1.0
    # The bench measures slowed actions: calibration with the cores recovers the work at full
    # speed exactly, and predicts the very step the timelines came from.
    per_rank = _measured(actions, costs, shift=0.0)
    measured = predict(actions, *costs, cores=2).step_time
    for r in per_rank:  # the measured timelines are the crowded ones
        r["timelines"] = [[(s, k, i, crowded.result.spans[f"{s}{k}{i}"].start, crowded.result.spans[f"{s}{k}{i}"].end)
                           for s, k, i, *_ in r["timelines"][0]]]  # fmt: skip
    recovered = calibrated_costs(per_rank, 3, cores=2)[1]
    assert list(recovered.forward) == pytest.approx([1.0, 1.5, 1.0]) and list(recovered.backward) == pytest.approx([2.0, 3.0, 2.0])
    assert list(calibrated_costs(per_rank, 3)[1].backward) != pytest.approx([2.0, 3.0, 2.0])  # as measured: slowed
    # (Not exact: idle_breakdown reads the posting rule's waits as a little executor overhead.)
    assert predicted_step({"schedule": "1f1b"}, per_rank, actions, 3, 3, cores=2) == pytest.approx(measured, rel=0.01)
    # Without the term the slowed medians hold for every action, overlapped or not: 5% too slow here.
    assert predicted_step({"schedule": "1f1b"}, per_rank, actions, 3, 3) > measured * 1.03
    # The planner uses the same term.
    layer = LayerProfile(seconds=[3.0, 4.5, 3.0], saved=[0.0] * 3, output=[0.0] * 3, params=[0.0] * 3, input_bytes=0.0,
                         forward=[1.0, 1.5, 1.0])  # fmt: skip
    (plan,) = candidates({6: layer}, 3, [1], ["never"], ["1f1b"], cores=2)
    assert plan.step_time == pytest.approx(measured)


def test_waiting_for_a_core_is_not_executor_overhead():
    from commlab.costmodel.calibration.pipeline import idle_breakdown

    # Rank 1's input arrives at 1 but it starts at 2; meanwhile ranks 0 and 2 compute, so on 2
    # cores it could have had 2/3 of a core: 2/3 s of overhead, not 1 s.
    timeline = {0: [(0, "F", 0, 0.0, 1.0), (0, "F", 1, 1.0, 4.0)], 1: [(1, "F", 0, 2.0, 3.0)], 2: [(0, "F", 2, 0.0, 3.0)]}
    assert idle_breakdown(timeline, 2, 0.0) == (pytest.approx(1.0), pytest.approx(1.0))
    assert idle_breakdown(timeline, 2, 0.0, cores=2)[1] == pytest.approx(2 / 3)
    assert idle_breakdown(timeline, 2, 0.0, cores=3)[1] == pytest.approx(1.0)


def test_checkpoint_modes_recompute_the_same_microbatches_for_executor_and_predictor():
    from commlab.costmodel.lowering.pipeline import checkpointed_microbatches
    from commlab.pipeline.schedule.checks import recomputes

    assert checkpointed_microbatches("never", 4) == ()
    assert checkpointed_microbatches("always", 4) == (0, 1, 2, 3)
    assert checkpointed_microbatches("except_last", 4) == (0, 1, 2)  # the last one's B follows its F at once
    assert [recomputes("except_last", i, 1) for i in range(1)] == [False]
    with pytest.raises(ValueError, match="unknown checkpoint mode 'sometimes'"):
        checkpointed_microbatches("sometimes", 4)


def test_plan_check_with_a_budget_judges_against_plans_whose_measured_peak_fits():
    from commlab.validation.planner import report, verdict

    def row(name, measured, peak, chosen=False):
        return dict(schedule=name, microbatches=2, virtual=1, checkpoint="never", chosen=chosen, predicted_s=measured,
                    measured_s=measured, q1_s=measured, q3_s=measured, predicted_peak=peak + 1, measured_peak=peak,
                    peak_bounded=True)  # fmt: skip

    rows = [row("gpipe", 1.0, 30.0), row("1f1b", 1.2, 18.0), row("zb-h1", 1.25, 19.0, chosen=True)]
    assert verdict(rows)["best"]["schedule"] == "gpipe"  # no budget: the whole grid
    v = verdict(rows, budget=20.0)  # gpipe's measured peak does not fit
    assert v["best"]["schedule"] == "1f1b" and v["pick_fits"] and v["pick_over_best"] == pytest.approx(1.25 / 1.2)
    assert "whose measured peak fits 1.90735e-05 MiB" in report(rows, 20.0)[-2] and "fits: yes" in report(rows, 20.0)[-2]
    rows[2]["forward_s"], rows[2]["reverse_s"] = 1.25 / 1.05, 1.25 / 1.3  # predicted 5% over one order, 30% over the other
    assert "(6 comparisons): median |error| 0.0%, worst 30.0% (zb-h1 m=2 v=1 never); within 10%: 5, within 25%: 5; against all rounds together: median 0.0%, worst 0.0%" in report(rows)[-1]
    assert not verdict(rows, budget=18.5)["pick_fits"]


def test_all_plans_needs_validate():
    result = CliRunner().invoke(main, ["pipeline", "plan", "--all-plans", "--no-calibrate", "--depth", "2", "--width", "8"])
    assert result.exit_code == 2 and "--all-plans widens --validate" in result.output


def test_a_split_backward_holds_what_i_kept_until_its_w():
    """Between a micro-batch's I and its W the stage holds the output gradients I kept for W
    (commlab/pipeline/runtime/compute.py); a schedule without I/W holds none."""
    zero = ([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], ())
    zb, f1 = build("zb-h1", 2, 4), build("1f1b", 2, 4)
    held = peak_bytes(zb, (0, 1), *zero, 2.0, (), (10.0, 10.0))
    assert peak_bytes(zb, (0, 1), *zero, 2.0, (), ()) == (0.0, 0.0)
    assert held[0] >= 10.0 and max(held) % 10.0 == 0.0  # whole micro-batches' worth
    assert peak_bytes(f1, (0, 1), *zero, 2.0, (), (10.0, 10.0)) == (0.0, 0.0)
