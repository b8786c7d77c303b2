"""The unused-parameter search over the autograd graph, without processes."""

import torch
from torch import nn

from commlab.ddp.graph import grad_accumulators, reachable, unreachable, unreached


def test_unreachable_lists_parameters_outside_the_outputs_graph():
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    params = [*a.parameters(), *b.parameters(), *c.parameters()]  # a.w a.b b.w b.b c.w c.b
    with torch.no_grad():  # accumulators can be taken even where DDP is built under no_grad
        accs = grad_accumulators(params)
    index = {acc: i for i, acc in enumerate(accs)}
    x = torch.randn(2, 4)
    assert unreachable([a(x)], index) == [2, 3, 4, 5]
    assert unreachable([c(a(x)), b(x).detach()], index) == [2, 3]
    assert unreachable([b(a(x)).sum(), c(x)], index) == []
    assert unreachable([x * 2], index) == [0, 1, 2, 3, 4, 5]  # no graph at all
    # Tied weights: one accumulator, reached through either use.
    c.weight = a.weight
    assert grad_accumulators([a.weight])[0] is accs[0]
    assert unreachable([c(x)], index) == [1, 2, 3, 4]  # c.weight is now a.weight (index 0)
    # The accumulators found by the search are the ones autograd actually runs.
    seen = []
    a.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p is a.weight))
    c(a(x)).sum().backward()
    assert seen == [True]


def test_one_walk_serves_two_sets_of_accumulators():
    # DDP's dense and sparse reducers each hold their own accumulators; the dynamic mode walks the
    # graph once (reachable) and each reducer reads its own unused ones from that walk.
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    dense, sparse = [*a.parameters(), *b.parameters()], list(c.parameters())
    dense_index = {acc: i for i, acc in enumerate(grad_accumulators(dense))}
    sparse_index = {acc: i for i, acc in enumerate(grad_accumulators(sparse))}
    x = torch.randn(2, 4)
    for outputs in ([a(x)], [c(b(x))], [x * 2], [a(x), b(x), c(x)]):
        reached = reachable(outputs)
        for index in (dense_index, sparse_index):
            assert unreached(reached, index) == unreachable(outputs, index)
    reached = reachable([c(a(x))])
    assert unreached(reached, dense_index) == [2, 3] and unreached(reached, sparse_index) == []
