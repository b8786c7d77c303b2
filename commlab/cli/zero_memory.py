"""`commlab predict --memory`: the ZeRO memory model's bytes per rank by stage, no calibration.

\b
    commlab predict --memory --params 7.5e9 --world-size 64 --precision mixed
    commlab predict --memory --model transformer --model-args depth=12 --world-size 8,64

The numbers are commlab/sharded/memory_model.py's ``zero_memory`` (parameters, gradients and
optimizer state; Rajbhandari et al. 2020, section 5), in GB of 1e9 bytes as the paper states
them; --model counts the model's trainable parameters on the meta device (nothing allocated).
"""

from __future__ import annotations

import click

OPTIONS = [
    click.Option(["--memory"], is_flag=True, help="print the ZeRO memory model's bytes per rank for stages 0-3 "
                                                 "(--params or --model, --world-size, --precision) and exit"),
    click.Option(["--params", "num_params"], type=click.FloatRange(min=0), help="with --memory: parameter count, e.g. 7.5e9"),
    click.Option(["--precision"], type=click.Choice(["mixed", "fp32"]),
                 help="with --memory: mixed (2+2+12 bytes per parameter, Adam) or fp32 (4+4+8) [mixed]"),
]


def report(num_params: float | None, model: str | None, model_args: str | None, world_sizes: str | None,
           precision: str | None) -> str:
    """The table `--memory` prints; click.UsageError for bad input (before anything is built)."""
    from commlab.sharded.memory_model import PRECISIONS, zero_memory

    if num_params is not None and model is not None:
        raise click.UsageError("--memory takes --params or --model, not both")
    if num_params is None and model is None:
        raise click.UsageError("--memory needs --params N or --model NAME (with --model-args)")
    try:
        worlds = [int(w) for w in (world_sizes or "2").split(",") if w.strip()]
    except ValueError:
        raise click.UsageError(f"--world-size: comma-separated integers, got {world_sizes!r}") from None
    if not worlds or min(worlds) < 1:
        raise click.UsageError(f"--world-size: positive integers, got {world_sizes!r}")
    precision = precision or "mixed"
    what = f"{num_params:.4g} parameters" if num_params is not None else ""
    if num_params is None:
        num_params = count_parameters(model, model_args or "")
        what = f"{model} {model_args or '(default sizes)'}: {num_params:.4g} trainable parameters"
    p, g, k = PRECISIONS[precision]
    lines = [f"ZeRO memory per rank (parameters + gradients + optimizer state), {what}, {precision} precision "
             f"({p}+{g}+{k} bytes per parameter); GB = 1e9 bytes; activations and buffers not included",
             f"{'world size':>10}  " + "  ".join(f"{'stage ' + str(s):>8}" for s in range(4))]
    for w in worlds:
        gb = [zero_memory(num_params, w, s, precision).total / 1e9 for s in range(4)]
        lines.append(f"{w:>10}  " + "  ".join(f"{x:>8.1f}" if x >= 1 else f"{x:>8.3g}" for x in gb))
    return "\n".join(lines)


def count_parameters(model: str, model_args: str) -> int:
    """Trainable parameters of a built-in or ``package.module:factory`` model (meta device)."""
    from commlab.costmodel.calibration.driver import Workload, parameter_sizes
    from commlab.models import check_workload
    from commlab.runs.options import canonical_model_args, parse_model_args

    try:
        check_workload(model, **parse_model_args(model_args))
        _, shapes = parameter_sizes(Workload(model, canonical_model_args(model_args), 1))
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total
