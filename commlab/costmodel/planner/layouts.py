"""Layouts (tensor x pipeline x data parallel) of one world, and a tensor-parallel step on the core.

A layout splits ``world`` ranks as ``tp * pp * dp``. Its tensor-parallel part is priced from a
:class:`SplitProfile`: one rank's share of the model, timed in a one-rank process at the split
shapes (:mod:`commlab.costmodel.planner.split`, never a tensor-parallel run), with the
collectives its real operators issue per layer and pass (Megatron's f and g: an all-reduce after
every row layer in forward, one for every distinct input of column layers in backward; under
sequence parallelism all-gathers and reduce-scatters). :func:`tp_tasks` lowers ``m`` micro-batches
of gradient accumulation onto the simulator core: per micro-batch, per layer, its forward compute
then its forward collectives, and in reverse its backward compute then its backward
collectives, all on the rank (a Gloo collective blocks the thread that calls it); with ``dp`` > 1
the DDP buckets of the last micro-batch's backward follow, each once the layer holding its last
gradient is done, on the rank's ``dp`` channel, priced by the calibrated all-reduce table, and
DDP's own copies and hooks of that micro-batch after them (``SplitProfile.sync_s``). The
collectives are priced by the calibrated table (:data:`BETWEEN`'s where measured; never here).

Memory per rank (:func:`peak_bytes`): this rank's parameters times the copies they need
(:func:`commlab.costmodel.planner.plan.param_copies`), what one micro-batch's forward saves for
backward (accumulation runs micro-batches one after another) and the backward's temporaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from commlab.costmodel.lowering.pipeline import DataParallel
from commlab.costmodel.planner.plan import param_copies
from commlab.costmodel.terms.costs import SystemCosts
from commlab.sim import Task, simulate

OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int

    def __str__(self) -> str:
        return f"tp{self.tp} pp{self.pp} dp{self.dp}"


def check_layout(tp: int, pp: int, dp: int, world: int, heads: int | None = None) -> Layout:
    """The layout, or ValueError: a size below 1, a product other than ``world``, or a ``tp``
    that does not divide the model's ``heads``."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("world", world)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if tp * pp * dp != world:
        raise ValueError(f"tp {tp} x pp {pp} x dp {dp} = {tp * pp * dp} ranks, not the world size {world}")
    if heads is not None and heads % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the model's {heads} attention heads")
    return Layout(tp, pp, dp)


def layouts(world: int, heads: int | None = None, *, max_pp: int | None = None) -> list[Layout]:
    """Every (tp, pp, dp) whose product is ``world``, tp dividing ``heads`` (None: any) and pp at
    most ``max_pp`` (the model's layers), in (tp, pp) order."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) or (heads is not None and heads % tp) or (max_pp is not None and pp > max_pp):
                continue
            out.append(Layout(tp, pp, world // (tp * pp)))
    return out


@dataclass(frozen=True)
class SplitProfile:
    """One micro-batch on one tensor-parallel rank, per layer: forward and backward seconds, the
    collectives (op, bytes) each pass issues, this rank's parameter bytes (module order, per
    layer: one entry per tensor), and per micro-batch the bytes saved for backward and the
    backward's temporaries. ``recompute``: the profile was taken with every block checkpointed,
    so the backward times and collectives include the forward run again."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    forward_collectives: tuple[tuple[tuple[str, int], ...], ...]
    backward_collectives: tuple[tuple[tuple[str, int], ...], ...]
    param_sizes: tuple[tuple[int, ...], ...]
    saved_bytes: float
    temporary_bytes: float
    tp: int = 1
    recompute: bool = False
    # What DDP adds to the micro-batch that synchronises, beyond its all-reduces: the copy of every
    # gradient into its bucket, the reduced one back into ``.grad``, the reducer's hooks (timed in
    # a one-rank DDP beside the bare share: commlab/costmodel/planner/split.py's ddp_sync_seconds)
    sync_s: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.forward)
        if not (len(self.backward) == len(self.forward_collectives) == len(self.backward_collectives) == len(self.param_sizes) == n):
            raise ValueError("a split profile needs every per-layer field for each of its layers")
        for passes in (self.forward_collectives, self.backward_collectives):
            for layer in passes:
                for op, nbytes in layer:
                    if op not in OPS or nbytes < 0:
                        raise ValueError(f"unknown collective {op!r} of {nbytes} bytes")

    @property
    def param_bytes(self) -> int:
        return sum(sum(layer) for layer in self.param_sizes)

    def collective_count(self) -> dict[str, int]:
        """How many of each collective one micro-batch issues (both passes)."""
        out = dict.fromkeys(OPS, 0)
        for passes in (self.forward_collectives, self.backward_collectives):
            for layer in passes:
                for op, _ in layer:
                    out[op] += 1
        return out


# The key of the tensor-parallel collectives' table in ``SystemCosts.collectives`` where one was
# measured between compute (commlab/costmodel/planner/tp_calibrate.py); else the plain one.
BETWEEN = "between_compute"


def _collective_task(name: str, op: str, nbytes: int, deps: tuple[str, ...], rank: int, system: SystemCosts, tp: int) -> Task:
    kind = op.replace("_", "")
    cost = system.collective(kind, BETWEEN if (kind, BETWEEN, tp) in system.collectives else "native", tp)
    return Task(name, f"rank{rank}", cost(nbytes), deps, kind=f"tp_{op}", meta={"bytes": nbytes})


def tp_tasks(profile: SplitProfile, microbatches: int, system: SystemCosts, dp: DataParallel | None = None,
             rank: int = 0) -> list[Task]:  # fmt: skip
    """One step of ``microbatches`` accumulated micro-batches on one rank (see the module docstring)."""
    if microbatches < 1:
        raise ValueError(f"micro-batches must be >= 1, got {microbatches}")
    tp, layers, out = profile.tp, len(profile.forward), []
    last: tuple[str, ...] = ()
    done_by_layer: dict[int, str] = {}

    def add(task: Task) -> None:
        nonlocal last
        out.append(task)
        last = (task.name,)

    for i in range(microbatches):
        for l in range(layers):
            add(Task(f"F{i}.{l}", f"rank{rank}", profile.forward[l], last, kind="forward"))
            for k, (op, nbytes) in enumerate(profile.forward_collectives[l] if tp > 1 else ()):
                add(_collective_task(f"F{i}.{l}.{op}{k}", op, nbytes, last, rank, system, tp))
        for l in reversed(range(layers)):
            add(Task(f"B{i}.{l}", f"rank{rank}", profile.backward[l], last, kind="backward"))
            for k, (op, nbytes) in enumerate(profile.backward_collectives[l] if tp > 1 else ()):
                add(_collective_task(f"B{i}.{l}.{op}{k}", op, nbytes, last, rank, system, tp))
            if i == microbatches - 1:
                done_by_layer[l] = last[0]
    if dp is not None and dp.world > 1:
        buckets = _dp_buckets(profile, dp, system, done_by_layer, rank)
        # DDP's own work in the synchronising micro-batch, on the rank's thread; placed after the
        # last bucket, where its write-back is (the copy-in, during backward, is the smaller part)
        out += buckets + [Task("ddp_sync", f"rank{rank}", profile.sync_s, (last[0], buckets[-1].name), kind="ddp")]
    return out


def _dp_buckets(profile: SplitProfile, dp: DataParallel, system: SystemCosts, done_by_layer: dict[int, str], rank: int) -> list[Task]:
    """DDP's buckets of the last backward: gradients become ready in reverse module order, and a
    bucket is reduced once the layer holding its last gradient is done, one at a time per channel."""
    sizes = [n for layer in profile.param_sizes for n in layer]
    owner = [l for l, layer in enumerate(profile.param_sizes) for _ in layer]
    cost = system.collective("allreduce", dp.algorithm, dp.world)
    out, ready, previous = [], list(reversed(range(len(sizes)))), ()
    taken = 0
    for k, nbytes in enumerate(dp.buckets(sizes)):
        # The bucket holds the next params in ready order up to its bytes; its last one gates it.
        filled, last_param = 0, ready[taken]
        while filled < nbytes and taken < len(ready):
            last_param = ready[taken]
            filled += sizes[last_param]
            taken += 1
        deps = (done_by_layer[owner[last_param]], *previous)
        task = Task(f"dp{k}", f"dp{rank}", cost(nbytes), deps, kind="allreduce", meta={"bytes": nbytes})
        out.append(task)
        previous = (task.name,)
    return out


def step_time(profile: SplitProfile, microbatches: int, system: SystemCosts, dp: DataParallel | None = None) -> float:
    """The predicted step time: :func:`tp_tasks` run on the core (every rank of a group alike)."""
    return simulate(tp_tasks(profile, microbatches, system, dp)).makespan


def peak_bytes(profile: SplitProfile, dp: int = 1, optimizer: str = "none") -> float:
    """Predicted peak bytes on one rank (see the module docstring)."""
    return param_copies(dp, optimizer) * profile.param_bytes + profile.saved_bytes + profile.temporary_bytes


def collective_bytes(profile: SplitProfile, microbatches: int) -> dict[str, int]:
    """Bytes per collective kind one step of ``microbatches`` issues on a rank of the tensor-parallel group."""
    out = dict.fromkeys(OPS, 0)
    for passes in (profile.forward_collectives, profile.backward_collectives):
        for layer in passes:
            for op, nbytes in layer:
                out[op] += nbytes * microbatches
    return out
