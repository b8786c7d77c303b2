"""Run metadata: what a results directory records about where and how it was made.

Shared by every app that writes results (sweep, pipeline, benchmarks, predictions), so it lives
in the runtime layer: versions (torch, its backends, the packages that shape the numbers), the
machine, thread settings, the git state of the commlab checkout and the command line.
"""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import commlab

# Packages whose versions can change a measurement or a figure.
PACKAGES = ("numpy", "pandas", "matplotlib", "seaborn", "click", "PyYAML", "torchvision")


def environment(collect_env: bool = True) -> dict[str, Any]:
    """Versions, hardware, thread settings, this host and the git state; needs torch.

    ``collect_env`` adds torch's own environment report (``python -m torch.utils.collect_env``,
    the one torch's issue template asks for); it takes a second or two.
    """
    import torch
    import torch.distributed as dist

    nccl = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    env = {
        "commlab": commlab.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        # Gloo is compiled into torch and reports no version of its own: torch's version names it.
        "backends": {"gloo": f"bundled with torch {torch.__version__}" if dist.is_gloo_available() else None,
                     "nccl": nccl, "cuda": torch.version.cuda},
        "packages": package_versions(),
        "cpu": cpu_model(),
        "cpu_count": cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "threads": thread_settings(),
        "host": socket.gethostname(),
        "git": git_state(Path(commlab.__file__).resolve().parent),
    }
    if collect_env:
        env["collect_env"] = torch_collect_env()
    return env


def thread_settings() -> dict[str, Any]:
    """This process's torch intra/inter-op threads and the variables that set them."""
    import torch

    return {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
            **{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}}


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            out[name] = None
    return out


def torch_collect_env() -> dict[str, Any] | str:
    """torch.utils.collect_env's summary as a mapping (or the error, which must not stop a run)."""
    try:
        from torch.utils.collect_env import get_env_info

        return {k: v for k, v in get_env_info()._asdict().items() if v not in (None, "", "N/A")}
    except Exception as err:  # it shells out to pip, nvidia-smi, ...: report, do not fail
        return f"unavailable: {type(err).__name__}: {err}"


def dirty_warning(env: dict[str, Any]) -> str | None:
    """A line for the console when the results come from uncommitted code."""
    git = env.get("git") or {}
    if git.get("dirty"):
        return (f"warning: the commlab checkout has uncommitted changes (commit {git['commit'][:10]}): "
                "these results may not be reproducible from the recorded commit")
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, as a container or taskset sees it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def git_state(where: Path) -> dict[str, Any] | None:
    """The commit of the commlab checkout and whether it had local changes; None outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def command_line(ctx) -> str:
    """The command as the user gave it: the command path and the options set on the command line.

    ``ctx`` is the running click command's context. Rebuilt from it rather than from sys.argv,
    which names the Python entry point (e.g. pytest's) when the command is invoked
    programmatically.
    """
    import click

    words = ctx.command_path.split()
    words[0] = "commlab"
    for param in ctx.command.params:
        if ctx.get_parameter_source(param.name) is not click.core.ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[param.name]
        if isinstance(param, click.Argument):
            words.append(str(value))
        elif param.is_flag:
            words.append(param.opts[0] if value else (param.secondary_opts or param.opts)[0])
        else:
            words += [param.opts[0], str(value)]
    return shlex.join(words)
