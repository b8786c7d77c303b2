"""The per-step shape handshake between stages, and message tags.

Activations and gradients travel as plain tensors over torch.distributed point-to-point ops
(Gloo on CPU, NCCL on GPU), so a receiver must allocate the right buffer before the data arrives.
As torch's PipelineStage does on its first step, each stage runs its module on a one-sample zero
batch to find its output's per-sample shape and dtype (each element's, for a tuple) and passes it on with the micro-batch sizes,
in stage order. Here the handshake runs at every step (a few small messages; the module runs again
only when its input's shape changed), so any dimension may change between steps (a sequence
length, the batch size), every wait obeys the schedule's timeout, and an error found on any rank
(a batch that cannot be split, a missing target: :func:`agree`; a stage output that cannot be
sent: :func:`handshake`) reaches every rank: each raises the same ValueError instead of waiting
for messages that never come.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from commlab.pipeline.schedule.actions import FORWARD, Action
from commlab.pipeline.runtime.stages import RankStages
from commlab.pipeline.runtime.values import MAX_PARTS, Boundary, check_output, flat


def tag(action: Action, microbatches: int, part: int = 0) -> int:
    """A tag unique to element ``part`` of the message ``action`` produces, so Gloo matches it
    whatever the posting order."""
    message = 2 * (action.stage * microbatches + action.microbatch) + (0 if action.kind == FORWARD else 1)
    return message * MAX_PARTS + part


_HANDSHAKE_TAG = 1 << 30  # above every activation / gradient tag


class HandshakeError(ValueError):
    """Raised on every rank when a stage upstream refused the step."""


def handshake(stage: RankStages, first: tuple[torch.Tensor, ...] | None, timeout: datetime.timedelta,
              cache: dict | None = None) -> dict[int, Boundary]:  # fmt: skip
    """The input boundary of every stage this rank holds or feeds (key: stage index).

    ``first`` is the first stage's micro-batches (on the rank holding stage 0, else None). A
    refused batch or target never gets here (:func:`agree` raises it first, on every rank); a
    module output refused here (values.check_output) travels down the chain in place of a
    boundary, then back up, and every rank raises it. Runs in stage order, so stage s waits only
    for stage s - 1. The result also holds the boundary after each local stage: the shape of the
    gradients that come back to it. ``cache`` maps an input boundary to the output one, so a
    module runs only for a shape it has not seen.
    """
    cache = {} if cache is None else cache
    inputs: dict[int, Boundary | str] = {}
    for s in sorted(stage.modules):
        if s == 0:
            inputs[s] = Boundary.of(_sizes(first), first[0])
        elif s not in inputs:
            inputs[s] = _recv_object(stage, stage.global_rank_of(s - 1), s, timeout)
        if s + 1 < stage.num_stages:
            if isinstance(inputs[s], str):
                inputs[s + 1] = inputs[s]
            else:
                key = (s, inputs[s])
                if key not in cache:
                    cache[key] = _output_boundary(stage, s, inputs[s])
                inputs[s + 1] = cache[key]
            if s + 1 not in stage.modules:
                _send_object(stage, inputs[s + 1], stage.global_rank_of(s + 1), s + 1, timeout)
    # Back up the chain: a refusal found downstream (a later stage's output) reaches every rank.
    refused = next((b for b in inputs.values() if isinstance(b, str)), None)
    for s in sorted(stage.modules, reverse=True):
        if s + 1 < stage.num_stages and s + 1 not in stage.modules:
            later = _recv_object(stage, stage.global_rank_of(s + 1), -s - 1, timeout)
            refused = refused or later
        if s > 0 and s - 1 not in stage.modules:
            _send_object(stage, refused, stage.global_rank_of(s - 1), -s, timeout)
    if refused is not None:
        raise HandshakeError(refused)
    return inputs  # type: ignore[return-value]


KNOWN_INPUTS = 16  # first-stage boundaries whose full handshake result a schedule remembers
_GATHER_BYTES = 8192  # room for each rank's (refusal, first-stage boundary) in the gather


def agree(stage: RankStages, first: tuple[torch.Tensor, ...] | None, timeout: datetime.timedelta,
          error: str | None, known: dict, cache: dict) -> dict[int, Boundary]:  # fmt: skip
    """Every stage's input boundary for this step, in one collective when nothing changed.

    One all-gather tells every rank each rank's refusal (the first stage's batch, the last
    stage's target) and the first stage's input boundary. Since every later boundary follows
    from that one (the modules' outputs are cached per input), a first-stage boundary seen in an
    earlier step (``known``, filled identically on every rank) needs nothing more; a new one runs
    the chained :func:`handshake` (where a module's output can still be refused). The chain costs
    2 (stages - 1) sequential message round trips per step, which at 3 ranks on 2 cores was about
    10% of a 1F1B step; the gather is one collective.
    """
    mine = (error, None if error or first is None else Boundary.of(_sizes(first), first[0]))
    found = _all_gather_object(stage, mine, timeout)
    refused = [e for e, _ in found if e]
    if refused:
        raise HandshakeError(error or refused[0])
    b0 = next(b for _, b in found if b is not None)
    if b0 not in known:
        # A traced model's boundaries are static and known to every rank: no chain of messages.
        boundaries = stage.boundaries(b0.sizes) or handshake(stage, first, timeout, cache)
        if len(known) >= KNOWN_INPUTS:
            known.pop(next(iter(known)))  # oldest first: the same on every rank
        known[b0] = boundaries
    return known[b0]


def _sizes(first) -> tuple[int, ...]:
    """Micro-batch sizes: the first dimension of each micro-batch's first tensor."""
    return tuple(int(flat(t)[0].shape[0]) for t in first)


def _all_gather_object(stage: RankStages, obj, timeout: datetime.timedelta) -> list:
    data = pickle.dumps(obj)
    if len(data) > _GATHER_BYTES - 8:  # refused on every rank rather than hanging one
        data = pickle.dumps((f"a stage boundary description of {len(data)} bytes exceeds {_GATHER_BYTES - 8}", None))
    buf = torch.zeros(_GATHER_BYTES, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(stage.device)
    out = [torch.empty_like(buf) for _ in range(stage.ranks)]
    try:
        dist.all_gather(out, buf, group=stage.group, async_op=True).wait(timeout)
    except RuntimeError as err:  # Gloo says "Operation timed out!": name what was awaited
        raise RuntimeError(f"Timed out after {timeout.total_seconds():g} s waiting for the pipeline's ranks to agree "
                           f"on the step's shapes (a peer is not calling step()?): {err}") from err  # fmt: skip
    found = []
    for t in out:
        t = t.cpu()
        n = int(t[:8].view(torch.int64).item())
        found.append(pickle.loads(t[8 : 8 + n].numpy().tobytes()))
    return found


def _send_object(stage: RankStages, obj, dst: int, s: int, timeout: datetime.timedelta) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(stage.device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=stage.device)
    tag = _HANDSHAKE_TAG + 4 * abs(s) + (2 if s < 0 else 0)  # s < 0: the reply up the chain
    works = [dist.isend(size, dst, stage.group, tag), dist.isend(data, dst, stage.group, tag + 1)]
    for w in works:
        w.wait(timeout)


def _recv_object(stage: RankStages, src: int, s: int, timeout: datetime.timedelta):
    tag = _HANDSHAKE_TAG + 4 * abs(s) + (2 if s < 0 else 0)
    size = torch.empty(1, dtype=torch.int64, device=stage.device)
    dist.irecv(size, src, stage.group, tag).wait(timeout)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=stage.device)
    dist.irecv(data, src, stage.group, tag + 1).wait(timeout)
    return pickle.loads(data.cpu().numpy().tobytes())


def _output_boundary(stage: RankStages, s: int, inp: Boundary) -> Boundary:
    module = stage.modules[s]
    module = getattr(module, "module", module)  # a DDP wrapper's own forward would talk to its group
    was_training = [m.training for m in module.modules()]
    module.eval()  # a one-sample batch in eval mode: no batch-norm statistics or dropout RNG touched
    try:
        with torch.no_grad():
            out = module(inp.sample(stage.device))
    finally:
        for m, flag in zip(module.modules(), was_training):
            m.training = flag
    # Refused on every rank: the message travels down the chain like a boundary.
    return check_output(s, out) or Boundary.of(inp.sizes, out)
