"""Rank-side code of the tensor-parallel timing tests: the GPT trained a few steps with timings
recorded, returned as plain data (per iteration: each layer's collective counts and seconds)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.models import GPT, lm_loss
from commlab.tensor import full_state_dict, gpt_plan, parallelize, record_timings, timings

BATCH, SEQ, D_MODEL = 2, 8, 32


def _train(model, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(3)  # the same tokens on every rank, as tensor parallelism needs
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, model.vocab, (BATCH, SEQ + 1), generator=gen)
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    return losses


def _iteration(it) -> dict:
    return {
        "forward": it.forward, "backward": it.backward, "exposed": it.exposed_comm, "total": it.total,
        "layers": {l.name: {"forward": l.forward, "backward": l.backward,
                            "counts": {f"{phase} {kind}": n for (phase, kind), n in l.counts.items()}}
                   for l in it.layers},
        "collectives": [(c.layer, c.phase, c.kind, c.nbytes, c.start, c.end) for c in it.collectives],
    }


def _model(sequence_parallel: bool):
    torch.manual_seed(0)
    return parallelize(GPT(vocab=64, d_model=D_MODEL, layers=2, heads=4, seq=SEQ), gpt_plan(),
                       sequence_parallel=sequence_parallel)


def run() -> dict:
    out = {}
    for sp in (False, True):
        untimed_losses = _train(_model(sp), 2)
        model = _model(sp)
        before = len(timings(model))
        _train(model, 1)  # not recorded: off by default
        record_timings(model)
        losses = _train(model, 2)
        full_state_dict(model)  # its gathers are no part of an iteration
        record_timings(model, False)
        _train(model, 1)
        out["sp" if sp else "plain"] = {
            "before": before, "iterations": [_iteration(it) for it in timings(model)],
            "same_losses": losses == untimed_losses,
        }
    out["rank"] = dist.get_rank()
    return out
