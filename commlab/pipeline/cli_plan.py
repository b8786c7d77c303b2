"""`commlab pipeline plan`: the planner's command, and with ``--validate`` its check against a measured grid.

    commlab pipeline plan --ranks 2 --budget-mb 16
    commlab pipeline plan --ranks 2 --budget-mb 16 --validate --iters 10      measure every plan that fits
"""

from __future__ import annotations

import os

import click

from commlab.pipeline.schedules import REGISTRY


@click.command()
@click.option("--ranks", "-p", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--budget-mb", default=64.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="per-rank memory budget, MiB")
@click.option("--schedules", default=",".join(REGISTRY), show_default=True)
@click.option("--microbatches", "-m", default="2,4,8,16", show_default=True, help="comma-separated")
@click.option("--virtual", "-v", default="1,2", show_default=True, help="stages per rank to try (interleaved)")
@click.option("--checkpoint", "checkpoints", default="never,except_last,always", show_default=True)
@click.option("--depth", default=8, show_default=True, type=click.IntRange(min=1), help="MLP blocks")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(min=1), help="MLP width")
@click.option("--batch", default=64, show_default=True, type=click.IntRange(min=1), help="mini-batch size")
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=1), help="plans to list")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="measure the executor's per-action overhead and the per-message cost first (a few seconds on --ranks Gloo ranks)")
@click.option("--validate", is_flag=True, help="then measure every plan that fits on --ranks Gloo ranks, alternating")
@click.option("--iters", default=10, show_default=True, type=click.IntRange(min=1), help="--validate: timed rounds")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(min=0), help="--validate: untimed rounds")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="--validate: seconds")
def plan(ranks, budget_mb, schedules, microbatches, virtual, checkpoints, depth, width, batch, top, calibrate, validate, iters, warmup,
         timeout) -> None:  # fmt: skip
    """The fastest plan (schedule x micro-batches x stages per rank x checkpointing) under a per-rank memory budget.

    Layers are profiled at each micro-batch size, and every plan is predicted on the shared
    simulator core with its peak memory per rank. ``--validate`` then measures the grid.
    """
    import torch

    from commlab.models import mlp
    from commlab.pipeline.cli import _ints, _names, _schedule_names
    from commlab.pipeline.executor import CHECKPOINT_MODES
    from commlab.pipeline.plan import best, candidates, profile

    names = _names(schedules, _schedule_names(), "--schedules")
    modes = _names(checkpoints, CHECKPOINT_MODES, "--checkpoint")
    ms = [m for m in _ints(microbatches, "--microbatches") if m <= batch]
    if not ms:
        raise click.BadParameter(f"every micro-batch count exceeds the batch of {batch}", param_hint="--microbatches")
    if validate and ranks < 2:
        raise click.BadParameter("--validate needs at least 2 ranks", param_hint="--ranks")
    torch.manual_seed(0)
    model = mlp(depth, width)
    # Profile with the threads a rank gets (commlab.launch: cores // ranks unless OMP_NUM_THREADS
    # is set), not the parent's: on a shared machine 2 threads per op can be 20x slower than 1.
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    try:
        profiles = {m: profile(model, torch.randn(batch // m, width)) for m in ms}
    finally:
        torch.set_num_threads(threads)
    from commlab.pipeline.plan_calibrate import Calibration
    from commlab.pipeline.plan_calibrate import calibrate as measure_costs

    costs = Calibration()
    if calibrate and ranks > 1:
        # Every boundary a plan can have is some layer's output at some micro-batch size.
        sizes = {int(b) for p in profiles.values() for b in p.output}
        costs = measure_costs(ranks, sorted(sizes), timeout=timeout)
        click.echo(f"calibrated on {ranks} Gloo ranks: executor overhead {costs.overhead * 1e6:.0f} us/action, message "
                   f"{costs.alpha * 1e6:.0f} us + {costs.beta * 1e9:.3f} ns/byte")  # fmt: skip
    # Ranks beyond the cores share them: each rank's compute slows while others compute.
    plans = candidates(profiles, ranks, _ints(virtual, "--virtual"), modes, names, costs, os.cpu_count())
    budget = budget_mb * 2**20
    chosen = best(plans, budget)
    click.echo(f"{'schedule':<12} {'m':>3} {'v':>2} {'checkpoint':<12} {'pred ms':>8} {'peak MiB/rank':>14}  balance")
    for p in plans[:top]:
        mark = "" if max(p.peak_bytes) <= budget else "  over budget"
        click.echo(f"{p.schedule:<12} {p.microbatches:>3} {p.virtual:>2} {p.checkpoint:<12} {p.step_time * 1e3:8.2f} "
                   f"{max(p.peak_bytes) / 2**20:14.2f}  {list(p.balance)}{mark}")  # fmt: skip
    if chosen is None:
        raise click.ClickException(f"no plan fits {budget_mb:g} MiB per rank (smallest needs {min(max(p.peak_bytes) for p in plans) / 2**20:.2f} MiB)")
    click.echo(f"plan: {chosen.schedule}, m={chosen.microbatches}, v={chosen.virtual}, checkpoint {chosen.checkpoint}, "
               f"balance {list(chosen.balance)}: predicted {chosen.step_time * 1e3:.2f} ms, peak {max(chosen.peak_bytes) / 2**20:.2f} MiB per rank")  # fmt: skip
    if validate:
        _validate([p for p in plans if max(p.peak_bytes) <= budget], chosen, ranks,
                  dict(depth=depth, width=width, batch=batch, iters=iters, warmup=warmup, timeout=timeout))  # fmt: skip


def _validate(grid, chosen, ranks: int, common: dict) -> None:
    import commlab
    from commlab.pipeline.plan_check import measure_rank, summarise, verdict

    click.echo(f"\nvalidating: {len(grid)} plans that fit, {ranks} Gloo ranks, {common['iters']} timed rounds after "
               f"{common['warmup']}, plans alternating forward / backward each round")  # fmt: skip
    specs = [dict(schedule=p.schedule, microbatches=p.microbatches, checkpoint=p.checkpoint, balance=list(p.balance)) for p in grid]
    per_rank = commlab.launch(measure_rank, specs, common, world_size=ranks, backend="gloo", timeout=common["timeout"])
    rows = summarise(grid, chosen, per_rank)
    click.echo(f"{'schedule':<12} {'m':>3} {'v':>2} {'checkpoint':<12} {'pred ms':>8} {'meas ms':>8} {'q1-q3 ms':>13} "
               f"{'pred MiB':>9} {'meas MiB':>9} bound")  # fmt: skip
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        click.echo(f"{r['schedule']:<12} {r['microbatches']:>3} {r['virtual']:>2} {r['checkpoint']:<12} {r['predicted_s'] * 1e3:8.2f} "
                   f"{r['measured_s'] * 1e3:8.2f} {r['q1_s'] * 1e3:6.2f}-{r['q3_s'] * 1e3:6.2f} {r['predicted_peak'] / 2**20:9.2f} "
                   f"{r['measured_peak'] / 2**20:9.2f} {'yes' if r['peak_bounded'] else 'NO'}{'  <- pick' if r['chosen'] else ''}")  # fmt: skip
    v = verdict(rows)
    b = v["best"]
    click.echo(f"pick measured / best measured = {v['pick_over_best']:.3f} (bar 1.05; best: {b['schedule']} m={b['microbatches']} "
               f"v={b['virtual']} {b['checkpoint']}); predicted peak bounds measured on every plan and rank: "
               f"{'yes' if v['peaks_bounded'] else 'NO'}")  # fmt: skip
