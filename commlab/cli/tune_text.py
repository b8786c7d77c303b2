"""What `commlab tune` prints: the DDP answers and, with --stage, the sharded one (the same numbers as --json)."""

from __future__ import annotations

import click

from commlab.runs.zero_stage import STAGES, parse_stage

OPTIONS = [
    click.Option(["--stage"], help="also search sharded data parallelism: auto (stages 0-3) or one stage 0-3; "
                                   "the answer is the fastest predicted stage x bucket x prefetch x reshard that fits "
                                   "--memory-gb"),
    click.Option(["--memory-gb"], type=click.FloatRange(min=0, min_open=True),
                 help="with --stage: GiB per rank the predicted peak must fit in"),
    click.Option(["--optimizer-bytes"], type=click.FloatRange(min=0),
                 help="with --stage: optimizer state bytes per parameter in the peak (0: plain SGD, 8: Adam) "
                      "[--optimizer's: 0 for sgd, the default, 8 for adam]"),
]


def stages_of(stage: str | None, memory_gb: float | None) -> tuple[int, ...] | None:
    """The stages --stage asks for (None: no sharded answer); usage errors before anything runs."""
    from commlab.costmodel.search.tune_sharded import parse_stages

    if stage is None:
        if memory_gb is not None:
            raise click.UsageError("--memory-gb needs --stage (auto or 0-3)")
        return None
    try:
        return parse_stages(stage)
    except ValueError as err:
        raise click.UsageError(f"--stage: {err}") from None


def sharded_text(r: dict) -> str:
    """The sharded answer's lines (commlab/costmodel/search/tune_sharded.py)."""
    gib = lambda b: f"{b / 2**30:.3g} GiB"  # noqa: E731
    kw = ", ".join(f"{n}={v!r}" for n, v in r["kwargs"].items())
    wrapper = parse_stage(r["stage"]).wrapper
    limit = "no memory limit" if r["memory_limit_bytes"] is None else f"fits {gib(r['memory_limit_bytes'])}"
    # hybrid sharding: the groups come from a Topology (shard groups of that size, replicas across)
    groups = (f", process_group=topo.shard_group, replicate_group=topo.replicate_group) with topo = "
              f"commlab.Topology.build(shard={r['shard_group']}" if r.get("shard_group") else "")
    lines = [f"  sharded ({limit}; {r['searched']} candidates): {wrapper}(model, {kw}{groups})  "
             f"step {r['predicted_step_s'] * 1e3:.1f} ms, peak {gib(r['predicted_peak_bytes'])} per rank"]
    if r.get("chosen_by") == "default":
        lines.append("    UNSTEADY calibration: the machine's load bent the predicted times, so this is the lowest "
                     "stage that fits at the default settings, not a search; calibrate again on a quiet machine "
                     "(--recalibrate), or pass --force to see the search's pick")
    elif not r.get("steady", True):
        lines.append("    UNSTEADY calibration (--force): the machine's load bent these numbers; calibrate again on a "
                     "quiet machine (--recalibrate) before trusting the pick")
    for s in map(str, STAGES):
        if s in r["by_stage"]:
            b = r["by_stage"][s]
            what = "fastest that fits" if b["fits"] else "smallest peak, does not fit"
            what += f", shard groups of {b['shard_group']}" if b.get("shard_group") else ""
            lines.append(f"    stage {s}: step {b['predicted_step_s'] * 1e3:.1f} ms, peak "
                         f"{gib(b['predicted_peak_bytes'])} ({what})")
    return "\n".join(lines)


def tune_text(entry: dict, r: dict, force: bool) -> str:
    """What `commlab tune` prints for one workload (the same numbers as --json)."""
    from commlab.costmodel.terms import uncertainty

    k = entry["key"]
    steadiness = uncertainty.Steadiness.from_json(entry["steadiness"]) if "steadiness" in entry else None
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    span = lambda a: f"{ms(a['predicted_step_s'])} (likely {ms(a['interval_s'][0])} to {ms(a['interval_s'][1])})"  # noqa: E731
    kw = lambda d: ", ".join(f"{n}={v!r}" for n, v in d.items())  # noqa: E731
    default = r["default_step_s"]
    lines = [f"{k['model']} {k['model_args'] or '(default sizes)'} on {k['backend']}, world size {k['world_size']}, "
             f"batch {k['batch_per_rank']} per rank (all figures PREDICTED)"]
    if steadiness is not None:
        lines.append(f"  calibration {steadiness.describe()}")
    if not r["steady"] and not force:
        lines.append("  NO RECOMMENDATION: the calibration cannot be trusted, so keep torch's default (below). "
                     "Calibrate again on a quiet machine (--recalibrate), or pass --force to see the search's pick "
                     "with widened intervals.")
    for name, a in (("torch DDP", r["torch"]), ("commlab DDP", r["commlab"])):
        args = {**a["ddp_kwargs"], **a.get("commlab_kwargs", {})}
        gain = default / a["predicted_step_s"] - 1
        noise = uncertainty.within_noise(a["predicted_step_s"], default, steadiness)
        verdict = ("within noise of the default: the model cannot tell them apart, keep the default" if noise
                   else f"{gain * 100:+.1f}% over the default")
        lines.append(f"  {name + ':':13s} DistributedDataParallel(model{', ' if args else ''}{kw(args)})  "
                     f"step {span(a)}; {verdict}")
    lines.append(f"  torch's default (25 MiB buckets, 1 MiB first bucket, native all-reduce, overlap): {ms(default)}")
    lines.append(f"  intervals: the model's worst error on held-out work, {uncertainty.VALIDATION.abs_worst * 100:.1f}%"
                 f"{' plus the calibration spread' if r['steady'] is False else ''}; source: "
                 f"{uncertainty.VALIDATION.source}")
    return "\n".join(lines)
