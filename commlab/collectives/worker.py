"""Communication workers: one thread per process group runs that group's collectives in order.

Why a thread: a Python-level all-reduce is a loop of sends, waits and reductions. Run on the
caller's thread from a DDP gradient hook it would stall backward until the bucket is reduced,
which is exactly the overlap DDP exists to get (Li et al., VLDB 2020, section 3.2.3). So
``async_op=True`` hands the collective to the group's worker and returns at once; backward keeps
computing while the worker waits on the network (torch releases the GIL in ``Work.wait`` and in
the reductions' kernels).

Why one path per group: every rank must issue a group's collectives in the same order, two
collectives between the same pair of ranks must not interleave their messages, and on NCCL the
coalescing state of ``batch_isend_irecv`` is kept per group for the whole process
(``_world.pg_coalesce_state``): a ``dist.all_reduce`` issued by another thread while a batch is
open would be swallowed into it. So everything commlab issues on a group goes through that
group's worker: async jobs on its FIFO queue, blocking ones (:func:`run_ordered`: buffer
broadcasts, DDP's unused-parameter all-reduce, a native issue) on the caller's thread once the
queue has drained, under the same lock.

Re-entrance (a blocking or async collective called from a future callback or a comm hook that
runs *on* the worker thread) runs inline at once: it is already in program order there, and
waiting for the queue would wait for itself.

Failures: every wait is bounded by the process group's timeout, and a failure is delivered
through the handle's future. Each p2p collective gets the next tag of its group (the same on
every rank, since the order is), so a message left in flight by a failed collective can never be
received by the next one. Workers are daemon threads, released with :func:`release_groups` (DDP
calls it for the groups it created) and stopped at interpreter exit.

The per-group worker table below is the package's only process-wide state.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commlab.collectives import streams
from commlab.collectives.handle import CollectiveHandle
from commlab.collectives.p2p import TAG_SPAN, release_group_state


def group_timeout(group: dist.ProcessGroup | None) -> float:
    """The process group's timeout in seconds (what torch bounds its own waits by)."""
    pg = dist.group.WORLD if group is None else group
    backend = str(dist.get_backend(pg)).lower()
    try:
        device = torch.device("cuda" if backend == "nccl" else "cpu")
        return pg._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # a backend without options: torch's default for it
        return dist.distributed_c10d._get_default_timeout(backend).total_seconds()


class CommWorker:
    """A daemon thread running one process group's collectives, first submitted first run."""

    def __init__(self, name: str, timeout: float):
        self.timeout = timeout
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._running = threading.Lock()  # held while a collective of this group runs
        self._idle = threading.Condition()
        self._pending = 0  # submitted, not yet started
        self.active = False  # a queued job is running on the worker thread now
        self._tag = 0
        self._streams: dict[torch.device, Any] = {}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def on_worker(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def next_tag(self) -> int:
        """The next p2p tag of this group, taken as a collective starts: collectives start in the
        same order on every rank, so the tags agree."""
        with self._idle:
            self._tag = self._tag % (TAG_SPAN - 1) + 1  # 1 .. TAG_SPAN - 1 (see p2p.TAG_SPAN)
            return self._tag

    def stream(self, device: torch.device) -> Any:
        """This channel's dedicated CUDA stream on ``device`` (created on first use)."""
        if device not in self._streams:
            self._streams[device] = streams.new_comm_stream(device)
        return self._streams[device]

    def submit(self, job: Callable[[], object], stream: Any = None) -> torch.futures.Future:
        """Queue ``job``; its future is completed with ``stream`` (a comm stream or None) current."""
        future = torch.futures.Future(devices=[stream.device]) if stream is not None else torch.futures.Future()
        if self.on_worker():  # re-entrant: run now, in place (see the module docstring)
            _complete(future, [job], stream)
            return future
        with self._idle:
            self._pending += 1
        self._jobs.put((job, future, stream))
        return future

    def run_inline(self, job: Callable[[], object]) -> object:
        """Run ``job`` on the calling thread after every job submitted before it."""
        if self.on_worker():
            return job()
        # The usual case, nothing queued or running, takes no condition variable: a blocking
        # collective's first send waits for everything before it (docs/measurements.md, 2026-11-25).
        if self._pending or not self._running.acquire(blocking=False):
            self._wait_turn()
        try:
            return job()
        finally:
            self._running.release()

    def _wait_turn(self) -> None:
        """Block until every job submitted so far has run, then hold ``_running``."""
        limit = 2 * self.timeout  # a backstop, as CollectiveHandle.wait's
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, limit):
                raise TimeoutError(f"{self._thread.name}: earlier collectives did not finish within {limit:g} s")
        if not self._running.acquire(timeout=limit):
            raise TimeoutError(f"{self._thread.name}: the running collective did not finish within {limit:g} s")

    def stop(self, timeout: float = 1.0) -> None:
        self._jobs.put(None)
        if not self.on_worker():
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def idle(self) -> bool:
        """Nothing queued and nothing running on the worker thread."""
        return self._pending == 0 and not self.active

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future, stream = item
            # Hold no reference to the job or its future past its completion: the caller's thread
            # then frees the collective's tensors once it is done with them, where the loop's
            # variables would keep the last job's (a whole bucket) until the next job arrives,
            # and free them on this thread, out of sight of the caller's memory profiler
            # (commlab/memtrack.py; measured, docs/measurements.md, 2026-11-27 14:48-15:20 UTC).
            item = None
            with self._running:
                with self._idle:
                    # Counted done before the future completes: its callbacks may run a blocking
                    # collective from another thread, which waits for this count.
                    self._pending -= 1
                    self._idle.notify_all()
                self.active = True
                try:
                    box, job = [job], None
                    _complete(future, box, stream)
                finally:
                    future = None
                    self.active = False


def _complete(future: torch.futures.Future, box: list[Callable[[], object]], stream: Any) -> None:
    """Run the job in ``box`` (taken out of it, and dropped before the future completes: see
    ``CommWorker._loop``) and complete ``future`` with its result or its exception."""
    job = box.pop()
    with streams.on_stream(stream):  # a CUDA future records its completion event on this stream
        try:
            result = job()
        except BaseException as exc:  # delivered to whoever waits on the handle
            job = None
            future.set_exception(exc)
        else:
            job = None
            future.set_result(result)


# group -> its worker. Keyed by the ProcessGroup object (the world group for None), so a group
# created after the default one was destroyed and re-initialised gets a fresh worker.
_WORKERS: dict[object, CommWorker] = {}
_WORKERS_LOCK = threading.Lock()
_NAMES = itertools.count()


def worker_for(group: dist.ProcessGroup | None) -> CommWorker:
    key = dist.group.WORLD if group is None else group
    with _WORKERS_LOCK:
        if key not in _WORKERS:
            _WORKERS[key] = CommWorker(f"commlab-comm-{next(_NAMES)}", group_timeout(key))
        return _WORKERS[key]


def run_ordered(group: dist.ProcessGroup | None, fn: Callable[[], object]) -> object:
    """Run ``fn`` (which issues collectives on ``group``) on this thread, in the group's order:
    after every collective queued on the group's worker, never concurrently with one."""
    return worker_for(group).run_inline(fn)


def group_busy(group: dist.ProcessGroup | None) -> bool:
    """Whether the group's worker has collectives queued or running (a p2p algorithm's buckets)."""
    return not worker_for(group).idle()


def run_async(group: dist.ProcessGroup | None, device: torch.device, fn: Callable[[], object]) -> torch.futures.Future:
    """Queue ``fn`` (which issues collectives on ``group`` and waits for them) on the group's
    worker, after everything queued before it; the future yields what ``fn`` returns. On CUDA
    ``fn`` runs on the worker's comm stream once the caller's stream has produced its inputs, and
    the future completes on that stream, as :func:`run_collective`'s do."""
    worker = worker_for(group)
    stream, job = _on_comm_stream(worker, device, lambda stream: fn())
    return worker.submit(job, stream)


def _on_comm_stream(worker: CommWorker, device: torch.device, body: Callable[[Any], object]) -> tuple[Any, Callable[[], object]]:
    """The worker's comm stream on ``device`` (None on CPU) and a job running ``body(stream)`` with
    it current, after it has waited for what the caller's stream has queued so far (an event)."""
    stream = worker.stream(device)
    ready = streams.record_ready(device)

    def job() -> object:
        with streams.on_stream(stream, ready):
            return body(stream)

    return stream, job


def release_groups(groups: Sequence[dist.ProcessGroup], *, destroy: bool = True) -> None:
    """Stop the workers of ``groups`` and (``destroy``) destroy the groups themselves."""
    with _WORKERS_LOCK:
        workers = [_WORKERS.pop(g) for g in groups if g in _WORKERS]
    for w in workers:
        w.stop()
    release_group_state(groups)
    if destroy and dist.is_initialized():
        for g in groups:
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):  # already destroyed (e.g. with the default group)
                pass


@atexit.register
def _stop_workers() -> None:
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    for w in workers:
        w.stop()


def run_collective(
    body: Callable[[torch.Tensor, int], None], tensor: torch.Tensor, group, async_op: bool, what: str = "collective"
) -> CollectiveHandle | None:
    """Run ``body(flat, tag)`` on a flat view of ``tensor`` on the group's worker, in order.

    ``tag`` is the collective's p2p tag. A non-contiguous tensor is reduced through a contiguous
    copy that is written back. On CUDA the body runs on the worker's comm stream, which first
    waits for the caller's stream (an event), and the future is completed on that stream, so
    waiting on it makes the waiter's stream wait instead of blocking the host.
    Returns a :class:`CollectiveHandle` when ``async_op``, else None once the tensor is reduced.
    """
    worker = worker_for(group)
    if not async_op and not tensor.is_cuda:
        # Blocking on CPU: no stream, no handle, no stamp; only the group's order. This path runs
        # between a barrier and the first send, where every step costs several times its warm
        # time (measured: docs/measurements.md, 2026-11-25).
        worker.run_inline(lambda: _reduce_flat(body, tensor, worker.next_tag()))
        return None
    handle = CollectiveHandle(None, worker.timeout, what)  # type: ignore[arg-type]

    def reduce_on(stream: Any) -> torch.Tensor:
        # The tag is taken when the job runs, not when it is queued: the run order is the same on
        # every rank, the queueing order is not (a callback may run before or after a later submit).
        tag = worker.next_tag()
        handle.launched = streams.stamp(stream)
        _reduce_flat(body, tensor, tag)
        streams.keep_alive(tensor, stream)
        return tensor

    stream, job = _on_comm_stream(worker, tensor.device, reduce_on)
    if async_op:
        handle._future = worker.submit(job, stream)
        return handle
    worker.run_inline(job)
    streams.join(stream)
    return None


def _reduce_flat(body: Callable[[torch.Tensor, int], None], tensor: torch.Tensor, tag: int) -> None:
    """``body(flat, tag)`` on a flat view of ``tensor``, through a contiguous copy written back
    when ``tensor`` is not contiguous."""
    if tensor.is_contiguous():
        body(tensor.view(-1), tag)
        return
    flat = tensor.contiguous().view(-1)
    body(flat, tag)
    tensor.copy_(flat.view(tensor.shape))


__all__ = ["group_busy", "group_timeout", "release_groups", "run_async", "run_collective", "run_ordered", "worker_for"]
