"""Communication workers: one thread per process group runs that group's collectives in order.

Why a thread: a Python-level all-reduce is a loop of sends, waits and reductions. Run on the
caller's thread from a DDP gradient hook it would stall backward until the bucket is reduced,
which is exactly the overlap DDP exists to get (Li et al., VLDB 2020, section 3.2.3). So
``async_op=True`` hands the collective to the group's worker and returns at once; backward keeps
computing while the worker waits on the network (torch releases the GIL in ``Work.wait`` and in
the reductions' kernels).

Why one thread per group and a FIFO: every rank must issue a group's collectives in the same
order, and two collectives between the same pair of ranks must not interleave their messages
(sends and receives are matched in posting order). One queue per group, drained by one thread,
keeps that order; a blocking call from the caller first waits for the queue to drain, then runs
under the same lock, so it also stays in program order.

Nothing hangs: every wait inside an algorithm is bounded by the process group's timeout, and a
failure is delivered through the handle's future. Workers are daemon threads (they cannot keep a
process alive) and are asked to stop at interpreter exit.

The per-group worker table below is the package's only process-wide state.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist


class CollectiveHandle:
    """What ``async_op=True`` returns, like torch's ``Work``: ``wait()`` and ``get_future()``.

    The future's value is the reduced tensor (so a DDP comm hook can return it as is).
    """

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def wait(self) -> bool:
        self._future.wait()  # re-raises the collective's exception, if any
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


class CommWorker:
    """A daemon thread running one process group's collectives, first submitted first run."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._running = threading.Lock()  # held while a collective of this group runs
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], object]) -> torch.futures.Future:
        future = torch.futures.Future()
        with self._idle:
            self._pending += 1
        self._jobs.put((job, future))
        return future

    def run_inline(self, job: Callable[[], object]) -> object:
        """Run ``job`` on the calling thread after every job submitted before it."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        with self._running:
            return job()

    def stop(self, timeout: float = 1.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            try:
                with self._running:
                    result = job()
            except BaseException as exc:  # delivered to whoever waits on the handle
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


# group -> its worker. Keyed by the ProcessGroup object (the world group for None), so a group
# created after the default one was destroyed and re-initialised gets a fresh worker.
_WORKERS: dict[object, CommWorker] = {}
_WORKERS_LOCK = threading.Lock()


def worker_for(group: dist.ProcessGroup | None) -> CommWorker:
    key = dist.group.WORLD if group is None else group
    with _WORKERS_LOCK:
        if key not in _WORKERS:
            _WORKERS[key] = CommWorker(f"commlab-comm-{len(_WORKERS)}")
        return _WORKERS[key]


@atexit.register
def _stop_workers() -> None:
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    for w in workers:
        w.stop()


def run_collective(
    body: Callable[[torch.Tensor], None], tensor: torch.Tensor, group, async_op: bool
) -> CollectiveHandle | None:
    """Run ``body(flat)`` on a flat view of ``tensor`` on the group's worker, in order.

    A non-contiguous tensor is reduced through a contiguous copy that is written back.
    Returns a :class:`CollectiveHandle` when ``async_op``, else None once the tensor is reduced.
    """
    ready = None
    if tensor.is_cuda:
        # The worker's stream must not read the tensor before the caller's stream produced it.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))

    def job() -> torch.Tensor:
        if ready is not None:
            torch.cuda.set_device(tensor.device)
            torch.cuda.current_stream(tensor.device).wait_event(ready)
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        body(flat)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        if ready is not None:  # complete the future only once the result is really there
            torch.cuda.current_stream(tensor.device).synchronize()
        return tensor

    worker = worker_for(group)
    if async_op:
        return CollectiveHandle(worker.submit(job))
    worker.run_inline(job)
    return None
