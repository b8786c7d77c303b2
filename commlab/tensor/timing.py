"""Per-layer time in tensor-parallel collectives, per iteration, as DDP's ``iteration_timings``.

    model = parallelize(GPT(), gpt_plan())
    record_timings(model)                 # stamps from the next forward on (off by default)
    ...train...
    last = timings(model)[-1]             # one entry per forward of the whole model
    for layer in last.layers: print(layer.name, layer.forward, layer.backward, layer.counts)

An iteration is a forward of the module ``parallelize`` returned and everything until its next
forward (the backward). Stamps are ``time.perf_counter()`` seconds relative to the forward's
start, taken on the host around each collective call. On CPU (Gloo) every tensor-parallel
collective blocks the training thread until it completes and the next layer needs its result,
so all of its time is exposed (on the critical path); on CUDA the stamps would time the issue of
work, not the GPU's execution. Off, a collective costs one Python call more and no stamp.

Per collective (``collectives``): ``layer`` (the name of the module whose operator issued it; q,
k and v share one input, so its collective is counted at the first of them to run), ``phase``
(``forward`` or ``backward``: issued inside the forward or after it), ``kind`` (``all_reduce``,
``all_gather``, ``reduce_scatter``), ``nbytes`` (the tensor handed to it), ``start``, ``end``.

Per layer (``layers``, in the order their first collective ran): ``forward`` and ``backward``, the
seconds in its collectives in each phase, and ``counts``, collectives per ``(phase, kind)``.

Per iteration: ``forward`` (forward start -> end), ``backward`` (forward end -> end of backward
compute: the autograd engine's final callback, queued by the first backward collective; without
one, the last collective's end), ``exposed_comm`` (seconds the thread was blocked in the module's
collectives: all of them, see above), ``total`` (forward start -> end of backward). The
vocab-parallel loss is outside the module and not counted. The last :data:`MAX_ITERATIONS` are kept.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from torch.autograd import Variable

MAX_ITERATIONS = 10_000  # iterations kept (deque maxlen), as DDP keeps


@dataclass
class CollectiveTiming:
    layer: str
    phase: str
    kind: str
    nbytes: int
    start: float
    end: float


@dataclass
class LayerTiming:
    name: str
    forward: float = 0.0
    backward: float = 0.0
    counts: dict[tuple[str, str], int] = field(default_factory=dict)  # (phase, kind) -> collectives


@dataclass
class TensorIterationTiming:
    forward: float
    backward: float
    exposed_comm: float
    total: float
    layers: list[LayerTiming] = field(default_factory=list)
    collectives: list[CollectiveTiming] = field(default_factory=list)


class Recorder:
    """Raw stamps per iteration (absolute), resolved into :class:`TensorIterationTiming` when read."""

    def __init__(self) -> None:
        self.enabled = False
        self._raw: deque[dict] = deque(maxlen=MAX_ITERATIONS)
        self._current: dict | None = None
        self._in_forward = False

    def enable(self, on: bool) -> None:
        self.enabled, self._current = on, None  # an iteration starts at a forward

    def forward_start(self, *_) -> None:
        if self.enabled:
            self._current = {"t0": time.perf_counter(), "forward_end": None, "backward_end": None, "stamps": []}
            self._raw.append(self._current)
            self._in_forward = True

    def forward_end(self, *_) -> None:
        if self.enabled and self._current is not None:
            self._current["forward_end"] = time.perf_counter()
            self._in_forward = False

    def timed(self, site: str, kind: str, nbytes: int, run):
        """``run()``, stamped as a collective of ``site`` when recording (inside an iteration)."""
        current = self._current
        if not self.enabled or current is None:
            return run()
        start = time.perf_counter()
        out = run()
        phase = "forward" if self._in_forward else "backward"
        current["stamps"].append((site, phase, kind, nbytes, start, time.perf_counter()))
        if phase == "backward" and current["backward_end"] is None:
            current["backward_end"] = False  # queued once per iteration
            Variable._execution_engine.queue_callback(lambda: current.__setitem__("backward_end", time.perf_counter()))
        return out

    def iterations(self) -> list[TensorIterationTiming]:
        return [_resolve(raw) for raw in self._raw]


def _resolve(raw: dict) -> TensorIterationTiming:
    t0 = raw["t0"]
    collectives = [CollectiveTiming(site, phase, kind, n, s - t0, e - t0) for site, phase, kind, n, s, e in raw["stamps"]]
    layers: dict[str, LayerTiming] = {}
    for c in collectives:
        layer = layers.setdefault(c.layer, LayerTiming(c.layer))
        setattr(layer, c.phase, getattr(layer, c.phase) + c.end - c.start)
        layer.counts[c.phase, c.kind] = layer.counts.get((c.phase, c.kind), 0) + 1
    forward_end = raw["forward_end"] - t0 if raw["forward_end"] is not None else max((c.end for c in collectives), default=0.0)
    end = raw["backward_end"] - t0 if raw["backward_end"] else max((c.end for c in collectives), default=forward_end)
    end = max(end, forward_end)
    return TensorIterationTiming(forward=forward_end, backward=end - forward_end,
                                 exposed_comm=sum(c.end - c.start for c in collectives), total=end,
                                 layers=list(layers.values()), collectives=collectives)


def recorder_of(module) -> Recorder:
    recorder = getattr(module, "_tensor_parallel_timing", None)
    if recorder is None:
        raise ValueError(f"{type(module).__name__} was not returned by commlab.tensor.parallelize: it has no "
                         "tensor-parallel timings (pass the module parallelize returned, the model's root)")
    return recorder


def record_timings(module, enabled: bool = True) -> None:
    """Start (or stop) stamping the collectives of a module ``parallelize`` returned, from its next forward."""
    recorder_of(module).enable(bool(enabled))


def timings(module) -> list[TensorIterationTiming]:
    """One entry per recorded iteration of a module ``parallelize`` returned (definitions above)."""
    return recorder_of(module).iterations()


def start_iteration(module) -> None:
    """Begin a recorded iteration now, for a driver that runs the model's parts but never the module
    ``parallelize`` returned (a pipeline's stages), whose forward would begin it. Until the next one,
    every collective counts as the ``forward`` phase: without the root's forward, the two are not told apart."""
    recorder_of(module).forward_start()
