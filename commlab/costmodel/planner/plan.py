"""The planner: the fastest schedule x micro-batches x stages per rank x checkpointing that fits a memory budget.

Every candidate is built from the registry, split by :func:`partition` on profiled per-layer
times, and predicted on the shared core (:func:`commlab.costmodel.lowering.pipeline.predict`) with the
bench predictor's lowering and cost terms: per-action compute from each stage timed whole as the
executor runs it (:mod:`commlab.costmodel.planner.stages`; per-layer sums where a stage was not
timed), stretched as compute stretches inside a pipeline, the executor's per-action overhead,
``alpha + bytes * beta`` per message at the plan's real boundary sizes, sends that complete only
once the receive is posted, recomputation (a checkpointed micro-batch's first forward without
grad). Alpha and beta are measured once at plan time (:mod:`commlab.costmodel.planner.calibrate`),
overhead and stretch per schedule from the model's own runs at a count no plan uses
(:mod:`commlab.costmodel.planner.offgrid`). Its peak
memory per rank is predicted from the schedule's liveness (:func:`peak_bytes`): parameters, their
gradients and the optimizer's state (:func:`param_copies`), what each stashed micro-batch keeps
(everything its forward saved, or only the stage input when checkpointed, plus one micro-batch
being recomputed), one receive buffer and one send per boundary, and the backward's temporaries
(:func:`temporaries`). Candidates over the budget are dropped; the fastest survivor is the plan.

Nothing of a configuration is run to predict it: the per-layer profile is taken once per
micro-batch size and the communication terms once per plan, so every schedule x micro-batches x
checkpointing of a model is predicted before any of them runs (``pipeline plan --predictions``
writes them all; :mod:`commlab.validation.planner` compares them with a ``pipeline bench`` run).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from commlab.pipeline.runtime.partition import partition
from commlab.costmodel.terms.costs import StageProfile, SystemCosts
from commlab.costmodel.lowering.pipeline import DataParallel, checkpointed_microbatches, predict
from commlab.pipeline.schedule.actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Actions, num_microbatches
from commlab.pipeline.schedule.liveness import liveness
from commlab.pipeline.schedule.registry import REGISTRY
from commlab.runs.optimizers import OPTIMIZERS


@dataclass(frozen=True)
class LayerProfile:
    """Per layer at one micro-batch: forward + backward seconds, bytes saved for backward, output
    bytes, parameter bytes (from :func:`commlab.pipeline.runtime.partition.profile_times` and friends)."""

    seconds: Sequence[float]
    saved: Sequence[float]
    output: Sequence[float]
    params: Sequence[float]
    input_bytes: float
    # Measured per layer when known (:func:`profile`): forward alone, and the split backward's
    # I and W (a layer-by-layer split costs more than one B). Empty: forward : backward = 1 : 2.
    forward: Sequence[float] = ()
    input_grad: Sequence[float] = ()
    weight_grad: Sequence[float] = ()

    # Each layer's parameter sizes in module order, for data-parallel buckets; empty: one tensor per layer.
    param_sizes: Sequence[Sequence[int]] = ()
    # Whole stages timed as the executor runs them, by (first layer, layer count)
    # (commlab.costmodel.planner.stages.StageTimes): used over the per-layer sums where present.
    stages: Mapping = field(default_factory=dict)
    # Storages counted once (commlab.costmodel.planner.layers.profile): ``saved`` leaves out each
    # layer's input storage; ``saved_input``: its bytes where the layer saved it and the layer
    # before did not; ``unsaved_output``: the output's bytes where the layer did not save it.
    saved_input: Sequence[float] = ()
    unsaved_output: Sequence[float] = ()
    # A traced model's pieces (commlab.costmodel.planner.model.weight_node_bytes): what a split
    # backward's I keeps at each piece's weight nodes. Empty: an nn.Sequential, whose layers'
    # output gradients are what I keeps.
    kept_nodes: Sequence[float] = ()
    # What the loss saves for its backward per micro-batch (cross-entropy: its log-softmax, as
    # large as the logits), held by the last stage's stash with the rest (plan_profile.loss_saved_bytes).
    loss_saved: float = 0.0

    def stage_kept(self, balance: Sequence[int]) -> list[float]:
        """Per stage, what a split backward's I keeps for W per micro-batch: each layer's output
        gradient (an nn.Sequential, commlab/pipeline/runtime/compute.py), or for a traced stage
        (one graph) its output gradient and the gradients at its weight nodes."""
        if not self.kept_nodes:
            return _stage_sums(self.output, balance)
        return [float(self.output[a + n - 1] + sum(self.kept_nodes[a : a + n])) for a, n in zip(_starts(balance), balance)]

    def stage_saved(self, balance: Sequence[int]) -> list[float]:
        """What each stage's forward keeps per micro-batch beyond its input: its layers' saved
        storages, each once, and its output (the stash holds it); the last stage also the loss's."""
        if not self.saved_input:
            out = _stage_sums(self.saved, balance)
        else:
            out = []
            for a, n in zip(_starts(balance), balance):
                inner = sum(self.saved_input[a + 1 : a + n])  # the stage's own input is counted as its input
                out.append(float(sum(self.saved[a : a + n]) + inner + self.unsaved_output[a + n - 1]))
        out[-1] += self.loss_saved
        return out

    def stage_profile(self, balance: Sequence[int], split: bool) -> StageProfile:
        """What each stage computes under ``balance`` (``split``: the schedule runs I and W), what it
        sends (the boundary after it: its last layer's output) and its parameters' sizes."""
        total = _stage_sums(self.seconds, balance)
        ends = [sum(balance[: s + 1]) - 1 for s in range(len(balance) - 1)]
        sizes = self.param_sizes or [[int(p)] if p else [] for p in self.params]
        starts = _starts(balance)
        extra = dict(message_bytes=tuple(float(self.output[e]) for e in ends),
                     param_nbytes=tuple(tuple(int(n) for layer in sizes[a : a + k] for n in layer) for a, k in zip(starts, balance)))
        ranges = list(zip(starts, balance))
        if self.stages and all(r in self.stages for r in ranges):
            timed = [self.stages[r] for r in ranges]
            if split:
                i, w = [t.input_grad for t in timed], [t.weight_grad for t in timed]
                return StageProfile(tuple(t.split_forward for t in timed), tuple(a + b for a, b in zip(i, w)),
                                    sum(w) / max(sum(i) + sum(w), 1e-12), **extra)  # fmt: skip
            return StageProfile(tuple(t.forward for t in timed), tuple(t.backward for t in timed), **extra)
        if not self.forward:
            return StageProfile(tuple(t / 3 for t in total), tuple(t * 2 / 3 for t in total), **extra)
        fwd = tuple(_stage_sums(self.forward, balance))
        if split and self.input_grad:
            i, w = _stage_sums(self.input_grad, balance), _stage_sums(self.weight_grad, balance)
            return StageProfile(fwd, tuple(a + b for a, b in zip(i, w)), sum(w) / max(sum(i) + sum(w), 1e-12), **extra)
        return StageProfile(fwd, tuple(max(t - f, 0.0) for t, f in zip(total, fwd)), **extra)


    def nograd_forward(self, balance: Sequence[int]) -> tuple[float, ...] | None:
        """Each stage's forward without grad (a checkpointed micro-batch's first) where every stage was timed whole."""
        ranges = list(zip(_starts(balance), balance))
        if not all(r in self.stages and self.stages[r].nograd_forward > 0 for r in ranges):
            return None
        return tuple(self.stages[r].nograd_forward for r in ranges)


@dataclass(frozen=True)
class Plan:
    schedule: str
    microbatches: int
    virtual: int
    checkpoint: str
    balance: tuple[int, ...]
    step_time: float
    peak_bytes: tuple[float, ...]  # per rank


def _stage_sums(values: Sequence[float], balance: Sequence[int]) -> list[float]:
    out, start = [], 0
    for n in balance:
        out.append(float(sum(values[start : start + n])))
        start += n
    return out


def peak_bytes(actions: Actions, placement: Sequence[int], saved: Sequence[float], inputs: Sequence[float],
               params: Sequence[float], checkpointed: Sequence[int], param_copies: float = 2.0,
               temporary: Sequence[float] = (), kept: Sequence[float] = ()) -> tuple[float, ...]:  # fmt: skip
    """Predicted peak bytes per rank of one step (see the module docstring); per-stage bytes per
    micro-batch. ``param_copies``: bytes held per parameter byte (:func:`param_copies`);
    ``temporary``: per stage, what its backward allocates on top (:func:`temporaries`): one
    backward runs at a time on a rank, so the largest of its stages' counts once; ``kept``: per
    stage, the gradients a split backward's I keeps at the weight nodes until its W runs
    (commlab/pipeline/runtime/weight_split.py), held by every micro-batch between the two."""
    out = []
    for r, lives in enumerate(liveness(actions, checkpointed)):
        local = [s for s, p in enumerate(placement) if p == r]
        pending: set[tuple[int, int]] = set()  # I ran, W not yet
        peak = 0.0
        for live in lives:
            # While an action runs: each live micro-batch's stage input, and what its forward saved
            # unless checkpointed and not yet recomputed (:func:`liveness`), and the kept gradients.
            held = sum(inputs[s] + (saved[s] if full else 0.0) for (s, _), full in live.alive.items())
            peak = max(peak, held + (sum(kept[s] for s, _ in pending) if kept else 0.0))
            key = (live.action.stage, live.action.microbatch)
            if live.action.kind == INPUT_GRAD:
                pending.add(key)
            elif live.action.kind == WEIGHT_GRAD:
                pending.discard(key)
        buffers = sum(2 * inputs[s] for s in local if s > 0) + sum(2 * inputs[s + 1] for s in local if s + 1 < len(placement))
        extra = max((temporary[s] for s in local), default=0.0) if temporary else 0.0
        out.append(param_copies * sum(params[s] for s in local) + peak + buffers + extra)
    return tuple(out)


# State per parameter in multiples of its bytes, from the one registry (commlab/runs/optimizers.py,
# which cites torch's optimizers); "none": no optimizer step at all (``--validate`` runs).
OPTIMIZER_STATE = {"none": 0.0, **{name: kind.state_bytes / 4 for name, kind in OPTIMIZERS.items()}}


def param_copies(dp: int = 1, optimizer: str = "none") -> float:
    """Bytes a rank holds per byte of its parameters: the parameters and their gradients, the
    optimizer's state (:data:`OPTIMIZER_STATE`; "none": no optimizer step, as ``--validate``
    measures), and with data parallelism (``dp`` > 1) the DDP reducer's flat bucket buffers, one
    more copy (commlab's DDP, as torch's, copies gradients into them unless ``gradient_as_bucket_view``)."""
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose from {', '.join(OPTIMIZER_STATE)}")
    return 2.0 + OPTIMIZER_STATE[optimizer] + (1.0 if dp > 1 else 0.0)


def temporaries(output: Sequence[float], input_bytes: float, balance: Sequence[int],
                params: Sequence[float] = ()) -> list[float]:
    """Per stage, the bytes its backward allocates beyond the stash and the boundary buffers: while
    layer l's backward runs, the gradient of its output, the new gradient of its input and the new
    gradients of its parameters are alive together (autograd frees the first once the others are
    made; a parameter's new gradient is a fresh tensor that AccumulateGrad then adds into the
    ``.grad`` already held, torch/csrc/autograd/functions/accumulate_grad.h), so the largest
    ``input[l] + output[l] + params[l]`` over the stage's layers (``.grad`` itself is counted
    with the parameters)."""
    inputs = [input_bytes, *output[:-1]]
    own = list(params) or [0.0] * len(output)
    return [max(inputs[l] + output[l] + own[l] for l in range(a, a + n)) for a, n in zip(_starts(balance), balance)]


def _starts(balance: Sequence[int]) -> list[int]:
    return [sum(balance[:s]) for s in range(len(balance))]


def candidates(profiles: Mapping[int, LayerProfile], ranks: int, virtuals: Sequence[int], checkpoints: Sequence[str],
               schedules: Sequence[str] | None = None, system: SystemCosts = SystemCosts(),
               cores: int | None = None, dp: DataParallel | None = None, *, balance_mode: str = "time",
               optimizer: str = "none", overheads: Mapping[tuple[str, int], Mapping[str, tuple[float, float]]] | None = None) -> list[Plan]:  # fmt: skip
    """Every valid combination with its predicted step time and peak memory, fastest first.

    ``profiles[m]`` was taken at the micro-batch size the mini-batch has when split in m;
    ``system``: the per-message and per-action costs (default zero: compute alone), and with
    ``dp`` its all-reduce table; ``cores``: the host's, for the sharing of cores among more ranks
    (:func:`commlab.costmodel.lowering.pipeline.sharing`); ``dp``: every stage replicated that many
    times, its DDP buckets after its last backward (:func:`commlab.costmodel.lowering.pipeline.step_tail`);
    ``balance_mode``: split layers by profiled time ("time") or in equal counts ("uniform", as
    ``pipeline bench --balance uniform``); ``optimizer``: whose state the memory model counts;
    ``overheads``: per (schedule, stages per rank) where measured and per checkpoint mode (one not
    measured: "never"'s), the executor's overhead per action and how much compute stretches
    against the profile, the same at every micro-batch count
    (:func:`commlab.costmodel.planner.offgrid.schedule_costs`); else ``system``'s and none.
    """
    if balance_mode not in ("time", "uniform"):
        raise ValueError(f"balance_mode must be 'time' or 'uniform', got {balance_mode!r}")
    world = dp.world if dp is not None else 1
    copies = param_copies(world, optimizer)
    if world > 1 and cores is not None:
        cores = cores / world  # every replica's pipeline computes at once: each gets its share of the host
    plans = []
    for m, profile in sorted(profiles.items()):
        layers = len(profile.seconds)
        for name in schedules or tuple(REGISTRY):
            spec = REGISTRY[name]
            if world > 1 and INPUT_GRAD in spec.kinds:
                continue  # DDP's reducer arms for one backward call, not I and W (commlab/pipeline/runtime/hybrid.py)
            for v in virtuals if spec.virtual is None else spec.virtual:
                stages = ranks * v
                try:
                    spec.check(ranks, m, v)
                except ValueError:
                    continue
                if stages > layers:
                    continue
                balance = partition(profile.seconds if balance_mode == "time" else [1.0] * layers, stages)
                temporary = temporaries(profile.output, profile.input_bytes, balance, profile.params)
                kept = profile.stage_kept(balance)  # what I keeps for W
                saved, params = profile.stage_saved(balance), _stage_sums(profile.params, balance)
                placement = spec.placement(ranks, stages)
                actions = spec.build(ranks, m, v)
                stage = profile.stage_profile(balance, INPUT_GRAD in spec.kinds)
                by_mode = overheads.get((name, v), {}) if overheads else {}
                # Stage s > 0 receives the boundary that stage.message_bytes[s - 1] prices.
                inputs = [profile.input_bytes, *stage.message_bytes]
                nograd = profile.nograd_forward(balance)
                for mode in checkpoints:
                    costs, stretch = system, 1.0
                    if by_mode:
                        action, stretch = by_mode.get(mode, by_mode.get("never"))
                        costs = replace(system, overheads=replace(system.overheads, action_s=action))
                    stretched = replace(stage, forward=tuple(f * stretch for f in stage.forward),
                                        backward=tuple(b * stretch for b in stage.backward))  # fmt: skip
                    recomputed = checkpointed_microbatches(mode, num_microbatches(actions))
                    # A checkpointed micro-batch's first forward runs without grad (commlab/pipeline/runtime/executor.py).
                    first = {Action(s, FORWARD, i): nograd[s] * stretch for s in range(stages) for i in recomputed} if nograd else {}
                    step = predict(actions, costs, stretched, placement, recomputed, cores, dp=dp, durations=first).step_time
                    peak = peak_bytes(actions, placement, saved, inputs, params, recomputed, copies, temporary, kept)
                    plans.append(Plan(name, m, v, mode, tuple(balance), step, peak))
    return sorted(plans, key=lambda p: (p.step_time, max(p.peak_bytes)))


def best(plans: Sequence[Plan], budget: float) -> Plan | None:
    """The fastest plan whose every rank's predicted peak fits ``budget`` bytes."""
    return next((p for p in plans if max(p.peak_bytes) <= budget), None)


def table(plans: Sequence[Plan], budget: float) -> list[str]:
    """The console table of ``plans``, each marked when over ``budget`` bytes per rank."""
    lines = [f"{'schedule':<12} {'m':>3} {'v':>2} {'checkpoint':<12} {'pred ms':>8} {'peak MiB/rank':>14}  balance"]
    for p in plans:
        mark = "" if max(p.peak_bytes) <= budget else "  over budget"
        lines.append(f"{p.schedule:<12} {p.microbatches:>3} {p.virtual:>2} {p.checkpoint:<12} {p.step_time * 1e3:8.2f} "
                     f"{max(p.peak_bytes) / 2**20:14.2f}  {list(p.balance)}{mark}")  # fmt: skip
    return lines


def no_fit(plans: Sequence[Plan], budget_mb: float) -> str:
    """Why no plan fits ``budget_mb`` MiB per rank: the smallest peak any plan needs, and a budget that fits it."""
    smallest = min(plans, key=lambda p: max(p.peak_bytes))
    need = max(smallest.peak_bytes) / 2**20
    suggest = math.ceil(need) if need >= 1 else math.ceil(need * 1000) / 1000  # whole MiB unless tiny
    return (f"no plan fits {budget_mb:g} MiB per rank: the smallest peak any plan needs is {need:.3f} MiB per rank "
            f"({smallest.schedule}, m={smallest.microbatches}, checkpoint {smallest.checkpoint}); "
            f"try --budget-mb {suggest:g} or more")  # fmt: skip
