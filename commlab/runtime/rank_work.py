"""A spawned rank's work: join the FileStore rendezvous, run the function, report through the queue.

Imported by :func:`commlab.runtime.rank_entry.start_rank` only after the rank set its parent-death
signal, because importing torch takes seconds during which a killed parent would leave it behind.
"""

from __future__ import annotations

import datetime
import os
import pickle
import traceback

import torch
import torch.distributed as dist

from commlab.runtime.devices import rank_device
from commlab.runtime.threads import use_rank_threads


def run_in_process_group(rank, world_size, backend, store_path, timeout, fn, args, q) -> None:
    """Initialise the process group from the FileStore, run ``fn(*args)``, put ``(rank, ok,
    result or traceback)`` on ``q``, destroy the group (after :func:`~commlab.runtime.rank_entry.start_rank`
    set the death signal)."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    # Gloo picks its transport interface from the hostname unless told: keep it on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    use_rank_threads(world_size)  # not a thread per core in each of N ranks (the rule's docstring)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank_device(backend, rank))
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(*args)
        q.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
