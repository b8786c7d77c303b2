"""Process groups in one place: launching ranks, the Runtime object, the pp x dp topology."""

from commlab.runtime.context import Runtime, init_from_env, resolve_backend, under_torchrun
from commlab.runtime.launch import LaunchError, launch

__all__ = ["LaunchError", "Runtime", "init_from_env", "launch", "resolve_backend", "under_torchrun"]
