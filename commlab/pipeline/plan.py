"""The planner: the fastest schedule x micro-batches x stages per rank x checkpointing that fits a memory budget.

Every candidate is built from the registry, split by :func:`partition` on profiled per-layer
times, and predicted on the shared core (:func:`commlab.pipeline.predict.predict`) with the
bench predictor's lowering and cost terms: per-action compute from the profile, the executor's
per-action overhead, ``alpha + bytes * beta`` per message at the plan's real boundary sizes,
sends that complete only once the receive is posted, recomputation. Overhead, alpha and beta
are measured once at plan time (:mod:`commlab.pipeline.plan_calibrate`, a few seconds). Its peak
memory per rank is predicted from the action order (:func:`peak_bytes`): parameters and their
gradients, what each stashed micro-batch keeps (everything its forward saved, or only the stage
input when checkpointed, plus one micro-batch being recomputed), and one receive buffer and one
send per boundary. Candidates over the budget are dropped; the fastest survivor is the plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from commlab.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Actions, num_microbatches
from commlab.pipeline.partition import partition
from commlab.pipeline.plan_calibrate import Calibration
from commlab.pipeline.predict import Costs, checkpointed_microbatches, predict
from commlab.pipeline.schedules import REGISTRY


@dataclass(frozen=True)
class LayerProfile:
    """Per layer at one micro-batch: forward + backward seconds, bytes saved for backward, output
    bytes, parameter bytes (from :func:`commlab.pipeline.partition.profile_times` and friends)."""

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

    def costs(self, balance: Sequence[int], split: bool, calibration: Calibration = Calibration()) -> Costs:
        """Per-stage action costs under ``balance``; ``split``: the schedule runs I and W;
        ``calibration``: the per-message and per-action terms, priced at this split's boundaries."""
        compute = self._compute(balance, split)
        ends = [sum(balance[: s + 1]) - 1 for s in range(len(balance) - 1)]
        return replace(compute, message_bytes=[float(self.output[e]) for e in ends], alpha=calibration.alpha,
                       beta=calibration.beta, overhead=calibration.overhead)  # fmt: skip

    def _compute(self, balance: Sequence[int], split: bool) -> Costs:
        total = _stage_sums(self.seconds, balance)
        if not self.forward:
            return Costs([t / 3 for t in total], [t * 2 / 3 for t in total])
        fwd = _stage_sums(self.forward, balance)
        if split and self.input_grad:
            i, w = _stage_sums(self.input_grad, balance), _stage_sums(self.weight_grad, balance)
            return Costs(fwd, [a + b for a, b in zip(i, w)], sum(w) / max(sum(i) + sum(w), 1e-12))
        return Costs(fwd, [max(t - f, 0.0) for t, f in zip(total, fwd)])


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
               params: Sequence[float], checkpointed: Sequence[int]) -> tuple[float, ...]:  # fmt: skip
    """Predicted peak bytes per rank of one step (see the module docstring); per-stage bytes per micro-batch."""
    recomputed = set(checkpointed)
    out = []
    for r, rank in enumerate(actions):
        local = [s for s, p in enumerate(placement) if p == r]
        live = peak = 0.0
        for a in rank:
            s, ck = a.stage, a.microbatch in recomputed
            keep = inputs[s] + (0.0 if ck else saved[s])
            if a.kind == FORWARD:
                live += keep
            elif a.kind in (BACKWARD, INPUT_GRAD) and ck:
                live += saved[s]  # the forward recomputed for this backward
            peak = max(peak, live)
            if a.kind in (BACKWARD, WEIGHT_GRAD):
                live -= keep + (saved[s] if ck else 0.0)
        buffers = sum(2 * inputs[s] for s in local if s > 0) + sum(2 * inputs[s + 1] for s in local if s + 1 < len(placement))
        out.append(2 * sum(params[s] for s in local) + peak + buffers)
    return tuple(out)


def candidates(profiles: Mapping[int, LayerProfile], ranks: int, virtuals: Sequence[int], checkpoints: Sequence[str],
               schedules: Sequence[str] | None = None, calibration: Calibration = Calibration(),
               cores: int | None = None) -> list[Plan]:  # fmt: skip
    """Every valid combination with its predicted step time and peak memory, fastest first.

    ``profiles[m]`` was taken at the micro-batch size the mini-batch has when split in m;
    ``calibration``: the per-message and per-action costs (zero: compute alone); ``cores``: the
    host's, for the sharing of cores among more ranks (:func:`commlab.pipeline.predict.sharing`).
    """
    plans = []
    for m, profile in sorted(profiles.items()):
        layers = len(profile.seconds)
        for name in schedules or tuple(REGISTRY):
            spec = REGISTRY[name]
            for v in virtuals if spec.virtual is None else spec.virtual:
                stages = ranks * v
                try:
                    spec.check(ranks, m, v)
                except ValueError:
                    continue
                if stages > layers:
                    continue
                balance = partition(profile.seconds, stages)
                saved, params = _stage_sums(profile.saved, balance), _stage_sums(profile.params, balance)
                placement = spec.placement(ranks, stages)
                actions = spec.build(ranks, m, v)
                costs = profile.costs(balance, INPUT_GRAD in spec.kinds, calibration)
                # Stage s > 0 receives the boundary that costs.message_bytes[s - 1] prices.
                inputs = [profile.input_bytes, *costs.message_bytes]
                for mode in checkpoints:
                    recomputed = checkpointed_microbatches(mode, num_microbatches(actions))
                    step = predict(actions, costs, placement, recomputed, cores).step_time
                    peak = peak_bytes(actions, placement, saved, inputs, params, recomputed)
                    plans.append(Plan(name, m, v, mode, tuple(balance), step, peak))
    return sorted(plans, key=lambda p: (p.step_time, max(p.peak_bytes)))


def best(plans: Sequence[Plan], budget: float) -> Plan | None:
    """The fastest plan whose every rank's predicted peak fits ``budget`` bytes."""
    return next((p for p in plans if max(p.peak_bytes) <= budget), None)


def profile(model, sample, repeat: int = 3) -> LayerProfile:
    """Profile ``model`` (an nn.Sequential) on ``sample`` (one micro-batch): see :class:`LayerProfile`.

    Times are the best of ``repeat``: forward + backward, forward alone, and the split backward's
    I (``autograd.grad`` for the input only) and W (``backward(inputs=params)``), as the executor
    runs them (:mod:`commlab.pipeline.compute`)."""
    import time

    import torch

    from commlab.pipeline.memory import SavedBytes
    from commlab.pipeline.partition import best_per_layer, profile_times

    # B (one fused backward) costs less than I + W, so it is timed on its own (profile_times).
    seconds = profile_times(model, sample, repeat=repeat)
    saved, output, params = [], [], []
    sync = torch.cuda.synchronize if sample.is_cuda else (lambda: None)  # time kernels, not launches

    def now() -> float:
        sync()
        return time.perf_counter()

    def split_backward(layer, x) -> tuple:
        """(output, forward, I, W) seconds of one layer, as the executor runs them."""
        weights = [p for p in layer.parameters() if p.requires_grad]
        start = now()
        with torch.enable_grad():
            y = layer(x)
        forward = now() - start
        if not y.requires_grad:
            return y, forward, 0.0, 0.0
        g = torch.ones_like(y)
        mid = now()
        if x.requires_grad:
            torch.autograd.grad(y, x, g, retain_graph=True, allow_unused=True)
        done_i = now()
        if weights:
            torch.autograd.backward(y, g, inputs=weights)
        return y, forward, done_i - mid, now() - done_i

    timed = best_per_layer(model, sample, split_backward, repeat)
    forward, input_grad, weight_grad = ([t[i] for t in timed] for i in range(3))
    x = sample
    for layer in model:
        x = x.detach().requires_grad_(x.is_floating_point())
        weights = list(layer.parameters())
        with SavedBytes(weights) as counted, torch.enable_grad():
            y = layer(x)
        saved.append(float(counted.nbytes))
        output.append(float(y.numel() * y.element_size()))
        params.append(float(sum(p.numel() * p.element_size() for p in weights)))
        x = y
    model.zero_grad(set_to_none=True)
    return LayerProfile(seconds, saved, output, params, float(sample.numel() * sample.element_size()),
                        forward, input_grad, weight_grad)  # fmt: skip
