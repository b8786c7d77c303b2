"""What a results directory records about where it was made: versions, hardware, code, command."""

from __future__ import annotations

import platform
import shlex
import socket
import subprocess
from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist

import commlab


def environment() -> dict[str, Any]:
    """Versions of torch and its backends, CPU and GPU models, this host and the git commit."""
    nccl = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "commlab": commlab.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backends": {"gloo": dist.is_gloo_available(), "nccl": nccl, "cuda": torch.version.cuda},
        "cpu": cpu_model(),
        "cpu_count": _cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "host": socket.gethostname(),
        "git": git_state(Path(commlab.__file__).resolve().parent),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_state(where: Path) -> dict[str, Any] | None:
    """The commit of the commlab checkout and whether it had local changes; None outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def command_line(ctx: click.Context) -> str:
    """The command as the user gave it: the command path and the options set on the command line.

    Rebuilt from click's context rather than sys.argv, which names the Python entry point (e.g.
    pytest's) when the command is invoked programmatically.
    """
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


def _cpu_count() -> int | None:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
