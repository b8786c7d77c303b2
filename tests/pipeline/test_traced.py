"""A model cut by name (torch.export), run with torch's step() call, against the unpartitioned model and torch.

The model is commlab.models.GPT, written as users write one (embeddings, a ModuleList of blocks
looped over in forward, final norm, head), fed integer token ids and an attention-mask keyword.
On two Gloo ranks (three and four: fewer cases) each schedule's loss, per-micro-batch ``losses``, gradients (named as in the
model) and ``eval_step`` outputs must equal the unpartitioned model's; torch.distributed.pipelining
runs the same split under Schedule1F1B and ScheduleGPipe in the same processes and must give the
same losses, gradients and eval() outputs. Torch's traced stages cannot read a root input after
the first stage (its stage raises "expected non-root _RecvInfo but got root arg"), so that
comparison runs without the mask; commlab carries the mask to the later stages.
Bad input is refused before any process starts.
"""

import functools
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import commlab
from commlab.models import GPT, lm_loss
from commlab.pipeline import PipelineExecutor, RankStages, looping, v_shape
from commlab.pipeline.runtime.chunks import inputs_of
from commlab.pipeline.runtime.traced import trace_stages

BATCH, M, VOCAB, SEQ = 8, 4, 64, 16  # the world-2 run and the single-process checks
TWO = ["layers.2"]
FOUR = ["layers.1", "layers.2", "layers.3"]
THREE = ["layers.2", "layers.4"]
SIX = ["layers.1", "layers.2", "layers.3", "layers.4", "layers.5"]
FOUR_OF_8 = ["layers.2", "layers.4", "layers.6"]
EIGHT = [f"layers.{k}" for k in range(1, 8)]
V = "v"
CASES = {  # world -> [(name, schedule, split points, placement, checkpoint, with the attention mask)]
    2: [("gpipe", "gpipe", TWO, None, "never", True),
        ("1f1b", "1f1b", TWO, None, "never", True),
        ("1f1b checkpointed", "1f1b", TWO, None, "except_last", True),
        ("interleaved", "interleaved", FOUR, None, "never", True),
        ("zb-h1", "zb-h1", TWO, None, "never", True),
        ("zb-v", "zb-v", FOUR, V, "never", True),
        ("dualpipev", "dualpipev", FOUR, V, "except_last", True),
        ("looped-bfs", "looped-bfs", FOUR, None, "never", True),
        ("interleaved-zb", "interleaved-zb", FOUR, None, "always", True),
        ("gpipe no mask", "gpipe", TWO, None, "never", False),
        ("1f1b no mask", "1f1b", TWO, None, "never", False)],
    3: [("gpipe", "gpipe", THREE, None, "never", True),
        ("1f1b", "1f1b", THREE, None, "never", True),
        ("interleaved", "interleaved", SIX, None, "except_last", True),
        ("zb-h1", "zb-h1", THREE, None, "never", True),
        ("zb-v", "zb-v", SIX, V, "never", True),
        ("dualpipev", "dualpipev", SIX, V, "never", True),
        ("looped-bfs", "looped-bfs", SIX, None, "never", True),
        ("interleaved-zb", "interleaved-zb", SIX, None, "never", True),
        ("1f1b no mask", "1f1b", THREE, None, "never", False)],
    4: [("1f1b", "1f1b", FOUR_OF_8, None, "never", True),
        ("interleaved", "interleaved", EIGHT, None, "never", True),
        ("zb-v", "zb-v", EIGHT, V, "never", True),
        ("dualpipev", "dualpipev", EIGHT, V, "never", True)],
}  # fmt: skip
SIZES = {2: (4, BATCH, M), 3: (6, 12, 6), 4: (8, 16, 8)}  # world -> (layers, batch, micro-batches of 2)
TORCH = {  # world -> {schedule: (torch's class, split points, placement)}, run without the mask
    2: {"1f1b": ("Schedule1F1B", TWO, None), "gpipe": ("ScheduleGPipe", TWO, None),
        "interleaved": ("ScheduleInterleaved1F1B", FOUR, None), "looped-bfs": ("ScheduleLoopedBFS", FOUR, None),
        "interleaved-zb": ("ScheduleInterleavedZeroBubble", FOUR, None),  # torch's order differs; the sums do not
        "zb-v": ("ScheduleZBVZeroBubble", FOUR, V), "dualpipev": ("ScheduleDualPipeV", FOUR, V)},
    3: {"1f1b": ("Schedule1F1B", THREE, None)},
    4: {},
}  # fmt: skip
for _world, _runs in TORCH.items():  # the same runs here, without the mask, for the comparison
    CASES[_world] += [(f"{s} no mask", s, points, where, "never", False) for s, (_, points, where) in _runs.items()
                      if f"{s} no mask" not in {c[0] for c in CASES[_world]}]  # fmt: skip


def _model(layers: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, d_model=32, layers=layers, heads=4, seq=SEQ)


def _data(batch: int = BATCH):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    mask = torch.ones(batch, SEQ)
    mask[::3, 11:] = 0  # padding at the end of every third sequence
    return tokens, mask, torch.roll(tokens, -1, dims=1)


def _example(tokens, mask, m=M):
    n = tokens.shape[0] // m
    return (tokens[:n],), ({"attention_mask": mask[:n]} if mask is not None else {})


def _torch_run(world: int, schedule: str, tokens, target):
    from torch.distributed import pipelining

    layers, _, m = SIZES[world]
    name, points, where = TORCH[world][schedule]
    pipe = pipelining.pipeline(_model(layers), mb_args=_example(tokens, None, m)[0],
                               split_spec={p: pipelining.SplitPoint.BEGINNING for p in points})  # fmt: skip
    rank, placement = dist.get_rank(), v_shape(world) if where == V else looping(world, len(points) + 1)
    if where == V:  # torch's traced stages assume the looping placement (their first p2p fails on the
        # V), so the V schedules run torch's manual PipelineStage on the same cut, made here.
        cut = trace_stages(_model(layers), points, _example(tokens, None, m)[0])
        stages = [pipelining.PipelineStage(_Piece(cut.parts[s]), s, len(placement), torch.device("cpu"))
                  for s in range(len(placement)) if placement[s] == rank]  # fmt: skip
    else:
        stages = [pipe.build_stage(s, torch.device("cpu")) for s in range(len(placement)) if placement[s] == rank]
    run = getattr(pipelining, name)(stages if len(placement) > world else stages[0], n_microbatches=m, loss_fn=lm_loss)
    losses: list = []
    first, last = placement[0] == rank, placement[-1] == rank
    run.step(*((tokens,) if first else ()), target=target if last else None, losses=losses)
    grads = {n.removeprefix("part.inner."): p.grad.clone()
             for st in stages for n, p in st.submod.named_parameters() if p.grad is not None}  # fmt: skip
    # torch's eval() of its V schedules fails here (a forward receive finds its peer gone): checked
    # for the looping ones only.
    evaluated = run.eval(*((tokens,) if first else ()), target=target if last else None) if where != V else None
    return [x.item() for x in losses], grads, evaluated if last else None


class _Piece(nn.Module):
    """A stage of commlab's cut as torch's manual PipelineStage calls it: the tensors as arguments."""

    def __init__(self, part):
        super().__init__()
        self.part = part

    def forward(self, *tensors):
        return self.part(tensors)


def _ranks(world: int):
    warnings.filterwarnings("ignore")  # torch.export's deprecation chatter
    layers, batch, m = SIZES[world]
    tokens, mask, target = _data(batch)
    out = {}
    for name, schedule, points, placement, checkpoint, masked in CASES[world]:
        model = _model(layers)
        args, kwargs = _example(tokens, mask if masked else None, m)
        stage = RankStages(model, split_points=points, example_args=args, example_kwargs=kwargs,
                           placement=v_shape(world) if placement == V else None)  # fmt: skip
        pipe = PipelineExecutor(stage, schedule, microbatches=m, loss_fn=lm_loss, checkpoint=checkpoint, timeout=100)
        losses: list = []
        inputs = ((tokens,), {"attention_mask": mask} if masked else {}) if stage.is_first else ((), {})
        loss = pipe.step(*inputs[0], target=target if stage.is_last else None, losses=losses, **inputs[1])
        grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
        evaluated = pipe.eval_step(*inputs[0], **inputs[1])
        assert {n for n, _ in stage.named_parameters()} <= {n for n, _ in model.named_parameters()}
        out[name] = (None if loss is None else loss.item(), [x.item() for x in losses], grads, evaluated)
    for schedule in TORCH[world]:
        out["torch " + schedule] = _torch_run(world, schedule, tokens, target)
    one_stage_each = next(c[2] for c in CASES[world] if c[1] == "1f1b")
    # A batch that does not split into micro-batches of the traced shape: refused on every rank.
    stage = RankStages(_model(layers), split_points=one_stage_each, example_args=(tokens[:2],),
                       example_kwargs={"attention_mask": mask[:2]})  # fmt: skip
    pipe = PipelineExecutor(stage, "1f1b", microbatches=m, loss_fn=lm_loss, timeout=100)
    try:
        pipe.step(*((tokens[:-1],) if stage.is_first else ()), target=target[:-1], attention_mask=mask[:-1])
    except ValueError as err:
        out["refused"] = str(err)
    return out


@pytest.fixture(scope="module")
def runs():
    """world -> every rank's results, each world launched once, when a test first asks for it."""
    cache: dict = {}

    def get(world: int):
        if world not in cache:
            cache[world] = commlab.launch(_ranks, world, world_size=world, backend="gloo", timeout=600)
        return cache[world]

    return get


@functools.lru_cache(maxsize=None)
def _reference(world: int, masked: bool):
    layers, batch, m = SIZES[world]
    model, (tokens, mask, target) = _model(layers), _data(batch)
    mask = mask if masked else None
    loss = lm_loss(model(tokens, attention_mask=mask), target)
    loss.backward()
    with torch.no_grad():
        out = model(tokens, attention_mask=mask)
        per_mb = [lm_loss(model(t, attention_mask=None if mask is None else mask.chunk(m)[k]), y).item()
                  for k, (t, y) in enumerate(zip(tokens.chunk(m), target.chunk(m)))]  # fmt: skip
    return loss.item(), per_mb, {n: p.grad for n, p in model.named_parameters()}, out


def _merged(ranks, name):
    loss = next(r[name][0] for r in ranks if r[name][0] is not None)
    losses = next(r[name][1] for r in ranks if r[name][1])
    grads = {k: v for r in ranks for k, v in r[name][2].items()}
    evaluated = next(r[name][3] for r in ranks if r[name][3] is not None)
    return loss, losses, grads, evaluated


@pytest.mark.parametrize("world, name, masked", [(w, c[0], c[-1]) for w, cases in CASES.items() for c in cases])
@pytest.mark.slow
def test_split_by_name_matches_unpartitioned_model(runs, world, name, masked):
    ref_loss, ref_losses, ref_grads, ref_out = _reference(world, masked)
    loss, losses, grads, evaluated = _merged(runs(world), name)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert losses == pytest.approx(ref_losses, rel=1e-5)  # each micro-batch's loss, unscaled, in order
    assert set(grads) == set(ref_grads)  # every parameter, named as in the model, on exactly one rank
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6, msg=k)
    torch.testing.assert_close(evaluated, ref_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world, schedule", [(w, s) for w, names in TORCH.items() for s in names])
@pytest.mark.slow
def test_same_losses_gradients_and_eval_as_torch_pipelining(runs, world, schedule):
    ranks = runs(world)
    loss, losses, grads, evaluated = _merged(ranks, schedule + " no mask")
    torch_losses = next(r["torch " + schedule][0] for r in ranks if r["torch " + schedule][0])
    torch_grads = {k: v for r in ranks for k, v in r["torch " + schedule][1].items()}
    assert losses == pytest.approx(torch_losses, rel=1e-6)
    assert set(grads) == set(torch_grads)
    for k, g in torch_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6, msg=k)
    if TORCH[world][schedule][2] != V:
        torch_eval = next(r["torch " + schedule][2] for r in ranks if r["torch " + schedule][2] is not None)
        torch.testing.assert_close(evaluated, torch_eval, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", list(CASES))
@pytest.mark.slow
def test_a_batch_that_does_not_split_into_the_traced_shape_is_refused_on_every_rank(runs, world):
    for r in runs(world):
        assert "traced on" in r["refused"] and "static-shape" in r["refused"], r["refused"]


# -- bad input, before any process starts ---------------------------------------------------------
def _trace(model=None, points=TWO, batch=2):
    tokens, mask, _ = _data(batch)
    return trace_stages(model or _model(), points, (tokens,), {"attention_mask": mask})


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if h.sum() > 0 else h  # branches on a value: no single graph


@pytest.mark.parametrize("make, points, expected", [
    (_model, ["layers.9"], "split point 'layers.9' names no submodule of GPT"),
    (_model, ["blocks.1"], "names no submodule"),
    (_model, ["layers.3", "layers.1"], "not in the order forward calls them"),
    (_model, ["layers.1", "layers.1"], "given more than once"),
    (_model, "layers.1", "non-empty list of submodule names"),
    (_model, ["layers.1", "layers.1.ln1"], "nested inside another"),
])  # fmt: skip
def test_bad_split_points_are_refused(make, points, expected):
    with pytest.raises(ValueError, match=expected):
        _trace(make(), points)


def test_a_model_torch_export_cannot_trace_is_refused():
    with pytest.raises(ValueError, match="torch.export cannot trace _DataDependent"):
        trace_stages(_DataDependent(), ["b"], (torch.randn(2, 4),))


def test_tied_parameters_across_stages_are_refused_by_name():
    model = _model()
    model.head.weight = model.tok.weight  # tied input and output embeddings
    with pytest.raises(ValueError, match=r"\['tok.weight', 'head.weight'\] are one tensor used by stages \[0, 1\]"):
        _trace(model)


def test_the_cut_model_computes_the_model_and_leaves_it_unchanged():
    model = _model()
    traced = _trace(model, FOUR)
    tokens, mask, _ = _data(2)
    value = (tokens, mask)
    for part in traced.parts:
        value = part(value)
    torch.testing.assert_close(value, model(tokens, attention_mask=mask))
    assert "forward" not in model.layers[1].__dict__  # torch's split marker was taken off again
    # The mask crosses every cut beside the hidden state; the token ids only enter stage 0.
    assert [[str(d) for _, d in c] for c in traced.carried] == [["torch.int64", "torch.float32"]] + [
        ["torch.float32", "torch.float32"]] * 3  # fmt: skip
    named = [n for part in traced.parts for n, _ in part.inner.named_parameters()]
    assert sorted(named) == sorted(n for n, _ in model.named_parameters())
    # Tensors the graph creates were traced on the example's device; placing a stage moves them too.
    assert "device = device(type='cpu')" in traced.parts[0].inner.code
    placed = traced.parts[0].place(torch.device("meta"))
    assert "device(type='meta')" in placed.inner.code and placed.inner.tok.weight.is_meta


def test_chunk_specs_that_do_not_divide_are_refused():
    traced = _trace(batch=2)
    stage = types.SimpleNamespace(traced=traced, device=torch.device("cpu"))
    tokens, mask, _ = _data(BATCH)
    ok = inputs_of(stage, (tokens,), {"attention_mask": mask}, M, None, None)
    assert len(ok) == M and ok[1][0].shape == (2, SEQ)
    with pytest.raises(ValueError, match="has no dimension 2"):
        inputs_of(stage, (tokens,), {"attention_mask": mask}, M, (2,), None)
    with pytest.raises(ValueError, match="16 along dimension 1 cannot be split into 32"):
        inputs_of(stage, (tokens,), {"attention_mask": mask}, 32, (1,), None)
    with pytest.raises(ValueError, match="traced on"):  # 10 rows do not make four micro-batches of 2
        inputs_of(stage, (tokens[:6].repeat(2, 1)[:10],), {"attention_mask": mask[:10]}, M, None, None)
    with pytest.raises(ValueError, match="traced on"):  # the mask replicated: its shape is the whole batch
        inputs_of(stage, (tokens,), {"attention_mask": mask}, M, None, {"attention_mask": None})
    with pytest.raises(ValueError, match="must take the arguments the model was traced with"):
        inputs_of(stage, (tokens,), {}, M, None, None)
