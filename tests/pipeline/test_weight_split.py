"""A traced stage's backward split into I and W at its weight nodes equals one full backward."""

import torch
from torch import nn

from commlab.models import GPT
from commlab.pipeline.runtime.weight_split import split_input_grad, split_weight_grad, weight_nodes


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_split_backward_of_one_graph_equals_the_full_backward_and_counts_each_weight_once():
    torch.manual_seed(0)
    gpt = GPT(vocab=32, d_model=16, layers=2, heads=2, seq=8)
    blocks = nn.ModuleList(gpt.layers)  # a middle stage: blocks on an activation that needs a gradient
    x = torch.randn(3, 8, 16)
    g = torch.randn(3, 8, 16)

    def run(split: bool):
        blocks.zero_grad(set_to_none=True)
        h = inp = x.clone().requires_grad_(True)
        for b in blocks:
            h = b(h)
        params = [p for p in blocks.parameters()]
        if not split:
            h.backward(g)
            return inp.grad, _grads(blocks)
        found, kept = split_input_grad([h], [g], [inp], params)
        assert kept is not None and len(kept) >= len(blocks) * 4  # attention, MLP and norms' nodes
        assert all(p.grad is None for p in params)  # I computed no weight gradient
        split_weight_grad(kept)
        return found[0], _grads(blocks)

    full_in, full_w = run(False)
    split_in, split_w = run(True)
    torch.testing.assert_close(split_in, full_in)
    for a, b in zip(split_w, full_w):
        torch.testing.assert_close(a, b)


def test_a_tied_weight_is_left_to_the_whole_graph_and_a_weight_off_the_path_is_split_where_it_joins():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(lin(x))  # one weight feeding two nodes: no single kept gradient counts it once
    assert weight_nodes([y.grad_fn], [x], list(lin.parameters())) is None
    assert split_input_grad([y], [torch.ones_like(y)], [x], list(lin.parameters())) is None
    # an embedding off the input's path hangs below the add that joins it: W starts there
    emb, head = nn.Embedding(5, 4), nn.Linear(4, 4)
    z = torch.randn(2, 4, requires_grad=True)
    params = [*emb.parameters(), *head.parameters()]
    (head(z) + emb(torch.tensor([1, 2]))).sum().backward()
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    out = head(z) + emb(torch.tensor([1, 2]))
    found, kept = split_input_grad([out], [torch.ones_like(out)], [z], params)
    split_weight_grad(kept)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)


def test_w_runs_on_the_engine_directly_or_through_backward_alike_and_fires_accumulate_hooks(monkeypatch):
    from commlab.pipeline.runtime import weight_split

    torch.manual_seed(0)
    block = GPT(vocab=32, d_model=16, layers=1, heads=2, seq=8).layers[0]
    x, g = torch.randn(3, 8, 16), torch.randn(3, 8, 16)
    params = list(block.parameters())

    def run():
        block.zero_grad(set_to_none=True)
        fired = []
        hooks = [p.register_post_accumulate_grad_hook(lambda p, k=k: fired.append(k)) for k, p in enumerate(params)]
        inp = x.clone().requires_grad_(True)
        out = block(inp)
        found, kept = split_input_grad([out], [g], [inp], params)
        split_weight_grad(kept)
        for h in hooks:
            h.remove()
        assert sorted(fired) == list(range(len(params)))  # each parameter's hook once (DDP's reducer hangs there)
        return [found[0], *_grads(block)]

    assert weight_split._run_backward is not None  # torch 2.13 has the engine entry point
    direct = run()
    monkeypatch.setattr(weight_split, "_run_backward", None)
    for a, b in zip(run(), direct):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
