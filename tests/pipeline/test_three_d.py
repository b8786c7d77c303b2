"""3D parallel training (tensor x pipeline x data) equals the unpartitioned model.

A small LM as an nn.Sequential (embeddings, four of commlab's GPT blocks, norm and head) is split
by Megatron's plan over the tensor group (commlab.tensor.parallelize), cut into two pipeline
stages, and kept in sync over the data-parallel group by commlab's DDP or ZeRO 1-3. Three steps of
SGD with momentum on a batch split over the replicas: every replica's loss per step (averaged as
DDP averages gradients) and every final parameter (the tensor blocks put back together) must
equal the unpartitioned model trained on the whole batch, within 1e-5 of each tensor's largest
value. One 8-rank spawn (2 x 2 x 2) loops over 1F1B and ZB-H1 (plus ZB-V) x DDP and ZeRO 1/2/3,
with sequence parallelism (the replicated norms' gradients summed over the tensor group, then
reduced over data parallelism); one 4-rank spawn builds tp x dp and tp x pp on the same world.
Bad input on every rank raises ValueError before any collective (the spawns then go on).
"""

import pytest
import torch
from torch import nn

import commlab
from commlab.models import Block, lm_loss
from commlab.pipeline import PipelineExecutor, v_shape
from commlab.pipeline.runtime.hybrid import DataParallelStage
from commlab.runtime.topology import Topology
from commlab.tensor import parallelize, resolve, vocab_parallel_cross_entropy

VOCAB, D, HEADS, SEQ, BATCH, STEPS, MICRO = 32, 16, 4, 8, 16, 3, 4


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)

    def forward(self, tokens):
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, x):
        return self.head(self.norm(x))


def _lm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Embed(), *(Block(D, HEADS) for _ in range(4)), _Head())


def _plan(vocab: bool) -> dict:
    plan = {"*.[qkv]": "colwise", "*.proj": "rowwise", "*.fc": "colwise", "*.out": "rowwise",
            "*.ln[12]": "sequence", "5.norm": "sequence", "1": "split_sequence",
            "5.head": "colwise" if vocab else "gather_sequence"}
    return {**plan, "0.tok": "vocab"} if vocab else plan


def _data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=2)


def _oracle():
    """The unpartitioned model on the whole batch: losses per step and final parameters."""
    model, (tokens, target) = _lm(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = lm_loss(model(tokens[step]), target[step])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _train(topo, schedule: str, dp: str, vocab: bool, sp: bool) -> dict:
    model = parallelize(_lm(), _plan(vocab), group=topo.tp_group, sequence_parallel=sp)
    splits = {n: getattr(model.get_submodule(n.rpartition(".")[0]), "tp_split", {}).get(n.rpartition(".")[2])
              for n, _ in model.named_parameters()}  # fmt: skip
    zero = None if dp == "ddp" else int(dp[-1])
    balance, placement = ([2, 1, 2, 1], v_shape(2)) if schedule == "zb-v" else ([3, 3], None)
    if topo.pp == 1:
        balance = [6]
    stage = DataParallelStage(model, balance, topo, placement=placement, zero_stage=zero, bucket_cap_mb=0.001)
    if vocab:
        def loss_fn(logits, target):
            return vocab_parallel_cross_entropy(logits, target, group=topo.tp_group)
    else:
        loss_fn = lm_loss
    pipe = PipelineExecutor(stage, schedule, microbatches=MICRO, loss_fn=loss_fn, timeout=200)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    tokens, target = _data()
    rows = slice(topo.replica * BATCH // topo.dp, (topo.replica + 1) * BATCH // topo.dp)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = pipe.step(tokens[step][rows] if stage.is_first else None, target=target[step][rows] if stage.is_last else None)
        opt.step()
        losses.append(None if loss is None else loss.item())
    names = {id(m): n for n, m in model.named_modules()}
    if zero is None:
        params = {n: p.detach().clone() for n, p in stage.named_parameters()}
    else:
        params = {f"{names[id(z.module)]}.{k}": v for s in sorted(stage.modules) for z in stage.sharded_layers(s)
                  for k, v in z.full_state_dict().items()}  # fmt: skip
    return {"losses": losses, "params": {n: (v, splits[n]) for n, v in params.items() if n in splits}}


def _bad_input(topo_args: dict) -> list:
    """Errors every rank raises before any collective (the spawn goes on, so no rank was left
    waiting); the tensor group here is the world (4 or 8 ranks)."""
    errors = []
    for call in (lambda: commlab.Topology.build(**topo_args),
                 lambda: parallelize(_lm(), {"7.q": "colwise"}),
                 lambda: parallelize(nn.Sequential(Block(24, 6)), {"*.q": "colwise"}),
                 lambda: parallelize(nn.Sequential(nn.Embedding(30, 8)), {"0": "vocab"}),
                 lambda: DataParallelStage(_lm(), [3, 3], None)):  # fmt: skip
        try:
            call()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


CASES_3D = [(schedule, dp) for schedule in ("1f1b", "zb-h1") for dp in ("ddp", "zero1", "zero2", "zero3")]
CASES_3D += [("zb-v", "zero3")]


def _world8():
    topo = commlab.Topology.build(tp=2, pp=2, timeout=200)
    out = {"coords": (topo.replica, topo.stage, topo.tp_rank), "bad": _bad_input({"tp": 2, "pp": 3})}
    for schedule, dp in CASES_3D:
        out[schedule, dp] = _train(topo, schedule, dp, vocab=schedule == "1f1b", sp=True)
    return out


def _world4():
    tp_dp = commlab.Topology.build(tp=2, timeout=200)
    tp_pp = commlab.Topology.build(tp=2, pp=2, timeout=200)
    out = {"coords": [(t.replica, t.stage, t.tp_rank) for t in (tp_dp, tp_pp)], "bad": _bad_input({"tp": 3})}
    out["tp x dp", "1f1b", "ddp"] = _train(tp_dp, "1f1b", "ddp", vocab=True, sp=False)
    out["tp x dp", "1f1b", "zero3"] = _train(tp_dp, "1f1b", "zero3", vocab=False, sp=True)
    out["tp x pp", "1f1b", "ddp"] = _train(tp_pp, "1f1b", "ddp", vocab=True, sp=True)
    out["tp x pp", "zb-h1", "zero2"] = _train(tp_pp, "zb-h1", "zero2", vocab=False, sp=False)
    return out


def _check(results: list, key, tp: int, pp: int, dp: int) -> None:
    losses, ref = _oracle()
    mesh = commlab.runtime.topology.mesh(tp, pp, dp)
    # The loss lives on the last stage's ranks (the first pipeline rank's under ZB-V): every tensor
    # rank has it; the replicas' mean is the whole batch's.
    last = 0 if key[-2] == "zb-v" else pp - 1
    per_replica = [[results[mesh[r][last][t]][key]["losses"] for t in range(tp)] for r in range(dp)]
    for r in range(dp):
        assert all(per_replica[r][t] == per_replica[r][0] for t in range(tp))
    for step in range(STEPS):
        mean = sum(per_replica[r][0][step] for r in range(dp)) / dp
        assert mean == pytest.approx(losses[step], rel=1e-5, abs=1e-6), (key, step)
    if dp > 1:
        assert per_replica[0][0][0] != pytest.approx(per_replica[1][0][0])  # the replicas saw different data
    for r in range(dp):
        found = {}
        for s in range(pp):
            blocks = [results[mesh[r][s][t]][key]["params"] for t in range(tp)]
            for name, (value, dim) in blocks[0].items():
                parts = [b[name][0] for b in blocks]
                if dim is None:
                    for part in parts[1:]:
                        torch.testing.assert_close(part, value, rtol=0, atol=0)  # whole on every tensor rank
                found[name] = value if dim is None else torch.cat(parts, dim)
        assert set(found) == set(ref), key
        for name, value in ref.items():
            tol = 1e-5 * value.abs().max().item()
            torch.testing.assert_close(found[name], value, rtol=0, atol=tol, msg=f"{key} replica {r} {name}")


def _check_bad(results: list, product: str) -> None:
    for r in results:
        topology, no_module, heads, vocab, no_groups = r["bad"]
        assert product in topology
        assert "'7.q' names no module" in no_module
        assert "heads" in heads and "6" in heads
        assert "30" in vocab
        assert "no process groups" in no_groups


@pytest.mark.slow
def test_2x2x2_equals_the_unpartitioned_model_under_every_schedule_and_data_parallelism():
    results = commlab.launch(_world8, world_size=8, backend="gloo", timeout=900)
    assert [r["coords"] for r in results] == [(r, s, t) for r in range(2) for s in range(2) for t in range(2)]
    _check_bad(results, "tp x pp = 2 x 3 = 6 does not divide the world's 8 ranks")
    for schedule, dp in CASES_3D:
        _check(results, (schedule, dp), 2, 2, 2)


@pytest.mark.slow
def test_tp_by_dp_and_tp_by_pp_equal_the_unpartitioned_model():
    results = commlab.launch(_world4, world_size=4, backend="gloo", timeout=600)
    assert [r["coords"] for r in results] == [[(0, 0, 0), (0, 0, 0)], [(0, 0, 1), (0, 0, 1)],
                                               [(1, 0, 0), (0, 1, 0)], [(1, 0, 1), (0, 1, 1)]]  # fmt: skip
    _check_bad(results, "tp x pp = 3 x 1 = 3 does not divide the world's 4 ranks")
    _check(results, ("tp x dp", "1f1b", "ddp"), 2, 1, 2)
    _check(results, ("tp x dp", "1f1b", "zero3"), 2, 1, 2)
    _check(results, ("tp x pp", "1f1b", "ddp"), 2, 2, 1)
    _check(results, ("tp x pp", "zb-h1", "zero2"), 2, 2, 1)


def test_bad_input_is_refused_without_processes():
    with pytest.raises(ValueError, match="zero_stage is 1, 2 or 3"):
        DataParallelStage(_lm(), [3, 3], Topology(pp=1, dp=1, rank=0), zero_stage=4)
    with pytest.raises(ValueError, match="needs balance="):
        DataParallelStage(_lm(), None, Topology(pp=1, dp=1, rank=0), zero_stage=1, split_points=["2"])
    assert len(resolve(_lm(), _plan(True), 2, sequence_parallel=True)) == 36  # the plan the spawns run
    with pytest.raises(ValueError, match="does not divide the attention heads"):
        resolve(_lm(), _plan(False), 8)  # 16 features split 8 ways, but 4 heads
    with pytest.raises(ValueError, match=r"does not divide 0\.tok\.num_embeddings \(32\)"):
        resolve(_lm(), {"0.tok": "vocab"}, 3)
    with pytest.raises(ValueError, match="names no module"):
        resolve(_lm(), {**_plan(False), "layers.*.q": "colwise"}, 2)
