"""The pipeline executor on Gloo: loss and every gradient equal the unpartitioned model's.

One world-2 spawn checks every schedule x checkpoint mode (plus RNG replay under
checkpointing, gradient accumulation over two steps, activation bytes, the per-rank errors, and
torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B on the same split as a second oracle);
it returns a dict per rank and the asserts are here in the parent. test_hybrid.py does the
same with one world-4 spawn for hybrid pipeline x data parallel.
"""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import commlab
from commlab.pipeline import PipelineExecutor, RankStages

SCHEDULES = [("gpipe", [3, 5]), ("1f1b", [4, 4]), ("interleaved", [2, 2, 2, 2])]
CHECKPOINTS = ["never", "except_last", "always"]
MICROBATCHES = 4
BATCH = 10  # micro-batches of 3, 3, 2, 2: the uneven split must still give the exact mean loss


def _model(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 24), nn.ReLU(), nn.Dropout(dropout), nn.Linear(24, 24), nn.Tanh(),
        nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 5),
    )


def _data(batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)


def _grads(model: nn.Module) -> dict:
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(schedule, balance, checkpoint, dropout=0.0, steps=1, x=None, y=None):
    model = _model(dropout)
    if x is None:
        x, y = _data(BATCH)
    stage = RankStages(model, balance)
    pipe = PipelineExecutor(stage, schedule, microbatches=MICROBATCHES, loss_fn=F.cross_entropy, checkpoint=checkpoint, timeout=100)
    losses = []
    for k in range(steps):
        torch.manual_seed(100 + k)  # same dropout masks in every run that consumes RNG alike
        loss = pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)
        losses.append(None if loss is None else loss.item())
    return losses, _grads(model), pipe.peak_saved_bytes


def _torch_reference(schedule, x, y):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from commlab.pipeline import split

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = _model()
    stage = PipelineStage(split(model, [4, 4])[rank].to(device), rank, 2, device)
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    pipe = kind(stage, MICROBATCHES, loss_fn=F.cross_entropy)
    losses = []
    if rank == 0:
        pipe.step(x.to(device))
    else:
        pipe.step(target=y.to(device), losses=losses)
    loss = torch.stack(losses).mean().item() if losses else None
    return [loss], _grads(model), {}


def _two_ranks():
    out = {}
    for schedule, balance in SCHEDULES:
        for checkpoint in CHECKPOINTS:
            out[(schedule, checkpoint)] = _run(schedule, balance, checkpoint)
    # Recomputation must replay the forward's dropout masks exactly.
    out["dropout_never"] = _run("1f1b", [4, 4], "never", dropout=0.5)
    out["dropout_always"] = _run("1f1b", [4, 4], "always", dropout=0.5)
    out["two_steps"] = _run("1f1b", [4, 4], "never", steps=2)
    # torch.distributed.pipelining on the same split: a second oracle (equal micro-batches, where
    # its 1/m loss scaling is exact).
    x8, y8 = _data(8)
    for schedule in ("gpipe", "1f1b"):
        out[("ours8", schedule)] = _run(schedule, [4, 4], "never", x=x8, y=y8)
        out[("torch", schedule)] = _torch_reference(schedule, x8, y8)
    # Per-rank errors raise before any message is sent, so the other rank is not left waiting.
    stage = RankStages(_model(), [4, 4])
    pipe = PipelineExecutor(stage, "gpipe", microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
    x, y = _data(3)
    try:
        pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)
        out["small_batch"] = None
    except ValueError as err:
        out["small_batch"] = str(err)
    try:
        pipe.step(None, target=None)
        out["missing"] = None
    except ValueError as err:
        out["missing"] = str(err)
    if dist.get_backend() != "gloo":  # NCCL aborts its communicator on a timeout: Gloo only
        out["rank"] = dist.get_rank()
        return out
    # A peer that stops taking part: the waiting rank raises after the schedule's timeout.
    pipe = PipelineExecutor(stage, "gpipe", microbatches=MICROBATCHES, loss_fn=F.cross_entropy, timeout=2)
    x, y = _data(8)
    pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)  # shapes agreed
    if stage.is_last:
        time.sleep(4)  # skip the next step
    else:
        began = time.monotonic()
        try:
            pipe.step(x)
        except RuntimeError as err:
            out["stalled"] = (time.monotonic() - began, str(err))
    out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return commlab.launch(_two_ranks, world_size=2, backend="gloo", timeout=120)


def _reference(dropout: float = 0.0, steps: int = 1):
    model = _model(dropout)
    x, y = _data(BATCH)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
    return losses, _grads(model)


def _merged(results, key):
    grads = {}
    for r in results:
        grads.update(r[key][1])
    return results[-1][key][0], grads


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.slow
def test_loss_and_gradients_match_unpartitioned_model(two_ranks, schedule, checkpoint):
    ref_losses, ref_grads = _reference()
    losses, grads = _merged(two_ranks, (schedule, checkpoint))
    assert two_ranks[0][(schedule, checkpoint)][0] == [None]  # only the last stage returns the loss
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert set(grads) == set(ref_grads)  # every parameter got its gradient on exactly one rank
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.slow
def test_gradients_match_torch_pipelining(two_ranks, schedule):
    ours_loss, ours = _merged(two_ranks, ("ours8", schedule))
    torch_loss, theirs = _merged(two_ranks, ("torch", schedule))
    assert ours_loss == pytest.approx(torch_loss, rel=1e-5)
    assert set(ours) == set(theirs) and len(ours) == 8
    for name, g in theirs.items():
        torch.testing.assert_close(ours[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_checkpoint_replays_dropout_and_steps_accumulate(two_ranks):
    never = _merged(two_ranks, "dropout_never")
    always = _merged(two_ranks, "dropout_always")
    assert never[0] == pytest.approx(always[0], rel=1e-6)
    for name, g in never[1].items():
        torch.testing.assert_close(always[1][name], g, rtol=1e-5, atol=1e-6, msg=name)
    ref_losses, ref_grads = _reference(steps=2)  # .grad accumulates over steps, as in torch
    losses, grads = _merged(two_ranks, "two_steps")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_activation_bytes_follow_the_schedule(two_ranks):
    first = two_ranks[0]
    gpipe, one_f = first[("ours8", "gpipe")][2][0], first[("ours8", "1f1b")][2][0]
    # Same split, 8 samples in 4 micro-batches of 2: GPipe holds all 8 samples' activations on
    # stage 0, 1F1B at most two micro-batches (4 samples).
    assert one_f / gpipe == pytest.approx(4 / 8)
    # Checkpointing keeps only each micro-batch's stage input (plus one recomputation at a time).
    assert first[("gpipe", "always")][2][0] < first[("gpipe", "never")][2][0]
    # Interleaved: rank 0 holds stages 0 and 2 and reports each.
    assert set(first[("interleaved", "never")][2]) == {0, 2}


@pytest.mark.slow
def test_a_missing_peer_raises_instead_of_hanging(two_ranks):
    waited, message = two_ranks[0]["stalled"]
    assert 1.5 < waited < 30 and "Timed out" in message


@pytest.mark.slow
def test_bad_batches_raise_value_errors(two_ranks):
    assert "cannot be split into 4 micro-batches" in two_ranks[0]["small_batch"]
    assert "cannot be split into 4 micro-batches" in two_ranks[1]["small_batch"]
    assert "first stage must pass the mini-batch" in two_ranks[0]["missing"]
    assert "last stage must pass target" in two_ranks[1]["missing"]


def test_ledger_counts_a_shared_storage_once_but_in_full_for_each_holder():
    # No processes: the accounting the executor's _keep reads per stashed micro-batch.
    from commlab.pipeline.runtime.memory import Ledger

    a, b = torch.zeros(4), torch.zeros(8)  # 16 and 32 bytes
    ledger = Ledger()
    ledger.hold("stash", (0, 0, "F"), [a, b])
    ledger.hold("send", (0, 0, "F"), [b])
    assert ledger.held_bytes("stash", (0, 0, "F")) == 48 and ledger.held_bytes("send", (0, 0, "F")) == 32
    assert ledger.current == 48 and ledger.by_kind() == {"stash": 48, "send": 32}
    ledger.drop(("stash", 0, 0, "F"))
    assert ledger.current == 32 and ledger.peak == 48
    with pytest.raises(KeyError):
        ledger.held_bytes("stash", (0, 0, "F"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL pipeline needs two CUDA devices (one per rank)")
@pytest.mark.slow
def test_nccl_pipeline_matches_unpartitioned_model():
    # The same executor on CUDA tensors over NCCL (no tags: messages match by issue order).
    results = commlab.launch(_two_ranks, world_size=2, backend="nccl", timeout=120)
    ref_losses, ref_grads = _reference()
    for schedule, _ in SCHEDULES:
        for checkpoint in CHECKPOINTS:
            losses, grads = _merged(results, (schedule, checkpoint))
            assert losses == pytest.approx(ref_losses, rel=1e-4)
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)
