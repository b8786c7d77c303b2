"""Plans, blocks and the vocab-parallel loss's arithmetic, without processes."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from commlab.models import GPT
from commlab.tensor import gpt_plan, kind_names, resolve
from commlab.tensor.comm import TPGroup
from commlab.tensor.loss import _VocabCrossEntropy
from commlab.tensor.shards import block, check_divides, head_count
from tests.support.tensor_models import SmallLM, commlab_plan


def test_blocks_are_equal_and_contiguous_as_torch_shards_them():
    assert [block(12, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert block(7, 1, 0) == (0, 7)
    assert [tuple(c.tolist()) for c in torch.arange(12).chunk(3)] == [tuple(range(*block(12, 3, r))) for r in range(3)]
    with pytest.raises(ValueError, match=r"tensor-parallel size 2 does not divide q.out_features \(15\)"):
        check_divides(2, 15, "q.out_features")
    with pytest.raises(ValueError, match="rank 2 is outside"):
        block(8, 2, 2)
    with pytest.raises(ValueError, match="positive integer"):
        check_divides(0, 8, "x")


def test_head_count_is_read_from_the_nearest_owner():
    inner, outer = nn.Module(), nn.Module()
    inner.num_heads, outer.heads = 6, 4
    assert head_count([inner, outer]) == 6 and head_count([nn.Module(), outer]) == 4
    assert head_count([nn.Module()]) is None


def test_a_plan_resolves_to_every_module_it_names_in_model_order():
    kinds = resolve(SmallLM(), commlab_plan(True, "colwise"), 2)
    assert list(kinds)[:4] == ["tok", "layers.0", "layers.0.ln1", "layers.0.attn.q"]
    assert [n for n, k in kinds.items() if k == "colwise"] == [
        f"layers.{i}.{m}" for i in range(2) for m in ("attn.q", "attn.k", "attn.v", "mlp.fc1")] + ["head"]
    assert kinds["layers.1.mlp.fc2"] == "rowwise" and kinds["norm"] == "sequence" and kinds["tok"] == "vocab"
    assert set(kind_names()) == {"colwise", "colwise_gather", "rowwise", "vocab", "sequence", "split_sequence",
                                 "gather_sequence"}


@pytest.mark.parametrize("model, plan, message", [
    (SmallLM(), {"layers.*.attention.q": "colwise"}, r"plan pattern 'layers.\*.attention.q' names no module of SmallLM"),
    (SmallLM(), {"head": "diagonal"}, r"plan entry 'head': 'diagonal' is not a kind: choose from colwise, "),
    (SmallLM(), {}, "a plan is a non-empty mapping"),
    (SmallLM(), {"tok": "colwise"}, "tok is a Embedding; 'colwise' takes Linear"),
    (SmallLM(), {"head": "vocab"}, "head is a Linear; 'vocab' takes Embedding"),
    (SmallLM(), {"head": "rowwise", "he*": "colwise"}, "module 'head' is given two kinds, 'rowwise' and 'colwise'"),
    (SmallLM(d=12, heads=3), {"layers.*.attn.q": "colwise"}, r"does not divide the attention heads around layers.0.attn.q \(3\)"),
    (SmallLM(vocab=31), {"tok": "vocab"}, r"does not divide tok.num_embeddings \(31\)"),
    (SmallLM(vocab=31), {"head": "colwise_gather"}, r"does not divide head.out_features \(31\)"),
    (SmallLM(), {"": "colwise"}, "the root module is a SmallLM"),
])
def test_a_wrong_plan_is_a_value_error_naming_the_fix(model, plan, message):
    with pytest.raises(ValueError, match=message):
        resolve(model, plan, 2)


def test_sequence_parallelism_needs_the_place_where_the_sequence_is_split():
    plan = {"layers.*.attn.[qkv]": "colwise", "layers.*.attn.o": "rowwise"}
    assert resolve(SmallLM(), plan, 2, sequence_parallel=False)
    with pytest.raises(ValueError, match="sequence_parallel=True needs a 'split_sequence' entry"):
        resolve(SmallLM(), plan, 2, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel must be True or False"):
        resolve(SmallLM(), plan, 2, sequence_parallel="yes")


def test_gather_and_scatter_run_on_the_algorithm_where_it_provides_them_else_on_the_ring():
    assert TPGroup(None, 2, 0, "native").scatter_gather == "native"
    assert TPGroup(None, 4, 0, "halving_doubling").scatter_gather == "halving_doubling"
    assert TPGroup(None, 3, 0, "halving_doubling").scatter_gather == "ring"
    assert TPGroup(None, 2, 0, "tree").scatter_gather == "ring"


def test_the_gpt_plan_fits_the_gpt_and_refuses_heads_the_group_does_not_divide():
    for vocab in (False, True):
        kinds = resolve(GPT(vocab=32, d_model=16, layers=2, heads=4, seq=8), gpt_plan(vocab), 2, sequence_parallel=True)
        assert kinds["layers.1.q"] == kinds["layers.1.fc"] == "colwise" and kinds["layers.0.proj"] == "rowwise"
        assert kinds["head"] == ("colwise" if vocab else "gather_sequence") and ("tok" in kinds) == vocab
    with pytest.raises(ValueError, match=r"attention heads around layers.0.q \(3\)"):
        resolve(GPT(vocab=32, d_model=24, layers=1, heads=3, seq=8), gpt_plan(), 2)


def test_the_vocab_parallel_loss_on_one_rank_is_cross_entropy_and_its_gradient():
    torch.manual_seed(0)
    logits = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 9, 3, 3, 7, 1])
    mine = _VocabCrossEntropy.apply(logits, target, TPGroup(None, 1, 0))
    weights = torch.arange(1.0, 7.0, dtype=torch.float64)
    (mine * weights).sum().backward()
    grad, logits.grad = logits.grad, None
    want = F.cross_entropy(logits, target, reduction="none")
    (want * weights).sum().backward()
    torch.testing.assert_close(mine, want)
    torch.testing.assert_close(grad, logits.grad)
