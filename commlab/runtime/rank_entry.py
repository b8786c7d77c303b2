"""The first code a spawned rank runs: die with the parent, then import torch and the work.

A spawned child unpickles its target before running it, and unpickling imports the target's
module. This module imports nothing heavy, and the rank's function and arguments arrive as bytes
unpickled only after ``prctl(PR_SET_PDEATHSIG)``: importing torch takes seconds, and a parent
killed during those seconds would otherwise leave an orphaned rank behind.
"""

from __future__ import annotations

import pickle
import sys

from commlab.runtime.orphans import set_parent_death_signal
# Whether torch was already imported when the parent-death signal was set (the tests read it).
torch_loaded_at_pdeathsig: bool | None = None


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when the process that started it (pid ``parent``) dies."""
    global torch_loaded_at_pdeathsig
    torch_loaded_at_pdeathsig = "torch" in sys.modules
    set_parent_death_signal(parent)


def start_rank(rank: int, payload: bytes, q, parent: int | None = None) -> None:
    """A spawned process's target: die with the parent, then unpickle the work and run it in the group."""
    die_with_parent(parent)
    # Imported here, not at the top: it imports torch, which must load after the death signal.
    from commlab.runtime.rank_work import run_in_process_group

    run_in_process_group(rank, *pickle.loads(payload), q)
