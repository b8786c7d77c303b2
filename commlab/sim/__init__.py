"""One simulator core for every prediction (DDP, pipelines, hybrids): see ``commlab.sim.core``."""

from commlab.sim.core import DeadlockError, SimResult, Span, Task, simulate

__all__ = ["DeadlockError", "SimResult", "Span", "Task", "simulate"]
