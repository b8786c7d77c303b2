"""The `commlab` command line: one click group whose subcommands load only when used.

One module per command group: :mod:`commlab.cli.sweep` (sweep, figures, trace) and
:mod:`commlab.cli.bench` (bench ddp, bench sharded, bench collectives) hold click declarations
only and import
torch inside the commands, so every ``--help`` answers without it.
"""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click command; loading lazily keeps `commlab --help` fast
# (importing torch and pandas for every subcommand would cost seconds).
_COMMANDS = {
    "sweep": ("commlab.cli.sweep:sweep", "Sweep DDP over bucket size x backend x world size ..."),
    "figures": ("commlab.cli.sweep:figures", "Regenerate every figure of a results directory."),
    "trace": ("commlab.cli.sweep:trace", "Write one configuration's timeline as a Chrome trace."),
    "pipeline": ("commlab.cli.pipeline:pipeline", "Pipeline schedules: show, simulate, benchmark."),
    "calibrate": ("commlab.cli.predict:calibrate", "Measure the DDP model's terms once; cache them in a file."),
    "predict": ("commlab.cli.predict:predict", "Predict a sweep (same files, ids, figures) without running it."),
    "tune": ("commlab.cli.predict:tune", "Recommend bucket_cap_mb, algorithm and overlap by simulation."),
    "plan": ("commlab.cli.plan:plan", "Plan tp x pp x dp layouts under a per-rank memory budget."),
    "validate": ("commlab.cli.validate:validate", "Predictions against measurement on held-out work."),
}
_BENCH_COMMANDS = {
    "ddp": ("commlab.cli.bench:bench_ddp", "commlab DDP vs torch DDP, alternating, ratio."),
    "sharded": ("commlab.cli.bench:bench_sharded", "commlab sharded DP vs fully_shard and DDP, separate launches."),
    "tensor": ("commlab.cli.bench:bench_tensor", "commlab TP vs torch parallelize_module, separate launches."),
    "collectives": (
        "commlab.cli.bench:bench_collectives",
        "nccl-tests-style benchmark of collectives and their algorithms.",
    ),
}


class _LazyGroup(click.Group):
    def __init__(self, *args, lazy: dict[str, tuple[str, str]], **kwargs):
        super().__init__(*args, **kwargs)
        self._lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._lazy))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self._lazy:
            module_name, attr = self._lazy[name][0].split(":")
            return getattr(importlib.import_module(module_name), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help comes from the table above, so listing commands imports nothing heavy.
        rows = [(name, self._lazy[name][1]) for name in sorted(self._lazy)]
        for name in click.Group.list_commands(self, ctx):
            cmd = click.Group.get_command(self, ctx, name)
            if cmd is not None:
                rows.append((name, cmd.get_short_help_str()))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(sorted(rows))


@click.group(cls=_LazyGroup, lazy=_COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="commlab")
def main() -> None:
    """commlab: see and tune the communication of data- and pipeline-parallel training.

    \b
    Start here:
      commlab sweep --bucket-mb 5,25,100     DDP latency vs bucket size (CPU, gloo)
      commlab bench ddp                      commlab DDP vs torch DDP
      commlab bench collectives -b 1K -e 64M ring / tree / halving-doubling vs native
      commlab pipeline show --schedule 1f1b  a pipeline schedule's step x rank grid
    """


# Named bench_group, not bench: the submodule commlab.cli.bench, once imported, is the package's
# attribute `bench`.
@main.group("bench", cls=_LazyGroup, lazy=_BENCH_COMMANDS)
def bench_group() -> None:
    """Micro-benchmarks that compare two implementations in one run."""
