"""Tuples of tensors between stages, on two Gloo ranks, against the unpartitioned model.

The model forks a hidden state into (a float tensor, a non-contiguous float view, whole-number
ids) and joins them again (the ids through an Embedding), twice. Balances put a tuple on a
cross-rank boundary, on a same-rank hand-over (zb-v), and inside a stage run layer by layer
(the split backward of zb-h1). Only the float elements carry gradients back.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import commlab
from commlab.pipeline import PipelineExecutor, RankStages, v_shape

pytestmark = pytest.mark.slow  # every test here starts processes

BATCH = 10  # micro-batches of 3, 3, 2, 2
CASES = [  # name, schedule, balance, placement, checkpoint
    ("gpipe", "gpipe", [2, 5], None, "never"),
    ("1f1b always", "1f1b", [2, 5], None, "always"),
    ("zb-h1", "zb-h1", [2, 5], None, "never"),
    ("zb-h1 tuple inside a stage", "zb-h1", [3, 4], None, "except_last"),
    ("zb-v two tuple boundaries", "zb-v", [2, 3, 1, 1], "v", "never"),
]


class Fork(nn.Module):
    """(tanh of the first half, the second half as a strided view, token ids from the first three)."""

    def forward(self, h):
        ids = (h[:, :3].detach().abs() * 10).long() % 20
        return torch.tanh(h[:, :6]), h[:, 6:], ids


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6)

    def forward(self, parts):
        a, b, ids = parts
        return torch.cat([a * b, self.emb(ids).sum(dim=1)], dim=1)


class Dict(nn.Module):
    def forward(self, h):
        return {"h": h}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 12), Fork(), Join(), nn.Linear(12, 12), Fork(), Join(), nn.Linear(12, 5))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 12, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _ranks():
    x, y = _data()
    out = {}
    for name, schedule, balance, placement, checkpoint in CASES:
        model = _model()
        stage = RankStages(model, balance, v_shape(2) if placement == "v" else None)
        pipe = PipelineExecutor(stage, schedule, microbatches=4, loss_fn=F.cross_entropy, checkpoint=checkpoint, timeout=60)
        loss = pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)
        out[name] = (None if loss is None else loss.item(), _grads(model))
    # A value that is neither a tensor nor a tuple of tensors is refused on every rank.
    pipe = PipelineExecutor(RankStages(nn.Sequential(nn.Linear(12, 12), Dict(), nn.Linear(12, 5)), [2, 1]), "gpipe",
                            microbatches=2, loss_fn=F.cross_entropy, timeout=60)  # fmt: skip
    try:
        pipe.step(x if dist.get_rank() == 0 else None, target=y)
    except ValueError as err:
        out["refused"] = str(err)
    # The chained shape handshake runs only for a first-stage boundary not seen before; otherwise
    # one all-gather agrees on the step (3 ranks on 2 cores: the chain cost ~10% of a 1F1B step).
    from commlab.pipeline.runtime import handshake as comm

    chained, real = [], comm.handshake
    comm.handshake = lambda *a, **k: chained.append(1) or real(*a, **k)
    try:
        model = _model()
        stage = RankStages(model, [2, 5])
        pipe = PipelineExecutor(stage, "1f1b", microbatches=4, loss_fn=F.cross_entropy, timeout=60)
        for n in (BATCH, BATCH, 8, BATCH, 8):
            pipe.step(x[:n] if stage.is_first else None, target=y[:n] if stage.is_last else None)
    finally:
        comm.handshake = real
    out["chained"] = len(chained)
    return out


@pytest.fixture(scope="module")
def ranks():
    return commlab.launch(_ranks, world_size=2, backend="gloo", timeout=240)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_tuple_boundaries_match_unpartitioned_model(ranks, name):
    model, (x, y) = _model(), _data()
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    loss = next(r[name][0] for r in ranks if r[name][0] is not None)
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    grads = {k: v for r in ranks for k, v in r[name][1].items()}
    expected = _grads(model)
    assert set(grads) == set(expected)  # the Embeddings after an integer element got gradients too
    for k, g in expected.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=1e-6, msg=k)


def test_the_chained_handshake_runs_only_for_new_shapes(ranks):
    assert [r["chained"] for r in ranks] == [2, 2]  # batch 10, then 8; the repeats reuse them


def test_other_outputs_are_refused_on_every_rank(ranks):
    for r in ranks:
        assert "must return a tensor or a tuple of tensors, got dict" in r["refused"]
