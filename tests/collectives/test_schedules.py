"""Index maths of the collectives, without processes: each schedule simulated symbolically."""

import math

import pytest
import torch

from commlab.collectives.schedules import (
    chunk_bounds,
    hd_all_gather_steps,
    hd_fold,
    hd_real_rank,
    hd_reduce_scatter_steps,
    largest_power_of_two,
    pieces,
    COPY,
    ring_all_gather_blocks,
    ring_neighbours,
    ring_plan,
    ring_reduce_scatter_blocks,
    tree_children,
    tree_parent,
)


@pytest.mark.parametrize("numel", [0, 1, 3, 7, 8, 100, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8])
def test_chunk_bounds_tile_the_range_like_tensor_split(numel, parts):
    bounds = chunk_bounds(numel, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == [t.numel() for t in torch.tensor_split(torch.arange(numel), parts)]


def test_chunk_bounds_and_pieces_reject_bad_input():
    with pytest.raises(ValueError):
        chunk_bounds(5, 0)
    with pytest.raises(ValueError):
        chunk_bounds(-1, 2)
    with pytest.raises(ValueError):
        pieces(0, 5, 0)
    assert pieces(3, 10, 3) == [(3, 6), (6, 9), (9, 10)]
    assert pieces(4, 4, 3) == []


def test_ring_literal_schedule_for_four_ranks():
    assert ring_neighbours(0, 4) == (3, 1)
    assert ring_reduce_scatter_blocks(0, 4) == [(3, 2), (2, 1), (1, 0)]
    assert ring_all_gather_blocks(0, 4) == [(0, 3), (3, 2), (2, 1)]


@pytest.mark.parametrize("world", range(1, 10))
def test_ring_schedule_reduces_every_block_and_gathers_it(world):
    # contributions[r][b]: which ranks' data rank r's copy of block b holds.
    held = [[{r} for _ in range(world)] for r in range(world)]
    rs = [ring_reduce_scatter_blocks(r, world) for r in range(world)]
    for s in range(world - 1):
        for r in range(world):
            left, _ = ring_neighbours(r, world)
            sent_block, recv_block = rs[left][s][0], rs[r][s][1]
            assert sent_block == recv_block  # what the left neighbour sends is what r expects
        incoming = [set(held[ring_neighbours(r, world)[0]][rs[r][s][1]]) for r in range(world)]
        for r in range(world):
            held[r][rs[r][s][1]] |= incoming[r]
    for r in range(world):
        assert held[r][r] == set(range(world))  # rank r owns the fully reduced block r
    owned = [{r} for r in range(world)]
    ag = [ring_all_gather_blocks(r, world) for r in range(world)]
    for s in range(world - 1):
        for r in range(world):
            left, _ = ring_neighbours(r, world)
            assert ag[left][s][0] == ag[r][s][1]
            assert ag[r][s][0] in owned[r]  # a rank only forwards blocks it already has
        for r in range(world):
            owned[r].add(ag[r][s][1])
    assert all(o == set(range(world)) for o in owned)
    # The all-gather starts by sending the block the reduce-scatter ended with (one pass).
    if world > 1:
        assert all(ag[r][0][0] == rs[r][-1][1] for r in range(world))


def test_tree_literal_for_seven_ranks_and_rerooted():
    assert [tree_parent(r, 7) for r in range(7)] == [None, 0, 0, 1, 1, 2, 2]
    assert [tree_children(r, 7) for r in range(7)] == [[1, 2], [3, 4], [5, 6], [], [], [], []]
    assert tree_parent(2, 7, root=2) is None and tree_children(2, 7, root=2) == [3, 4]
    assert tree_parent(1, 7, root=2) == 4  # virtual (1-2)%7 = 6 -> parent virtual 2 -> rank 4


@pytest.mark.parametrize("world", range(1, 17))
def test_tree_is_a_spanning_tree_of_logarithmic_depth(world):
    for root in {0, world // 2, world - 1}:
        parents = {r: tree_parent(r, world, root) for r in range(world)}
        assert [r for r, p in parents.items() if p is None] == [root]
        for r in range(world):
            assert len(tree_children(r, world, root)) <= 2
            for c in tree_children(r, world, root):
                assert parents[c] == r
        depth = 0
        for r in range(world):
            d, node = 0, r
            while parents[node] is not None:
                node, d = parents[node], d + 1
            depth = max(depth, d)
        assert depth == int(math.log2(world))


def test_halving_doubling_fold_for_six_ranks():
    # p' = 4, r = 2: ranks 0 and 2 fold into 1 and 3; 4 and 5 take part as virtual 2 and 3.
    assert [hd_fold(r, 6) for r in range(6)] == [
        ("folded", None, 1), ("proxy", 0, 0), ("folded", None, 3), ("proxy", 1, 2),
        ("plain", 2, None), ("plain", 3, None),
    ]
    assert [hd_real_rank(v, 6) for v in range(4)] == [1, 3, 4, 5]
    assert largest_power_of_two(6) == 4 and largest_power_of_two(8) == 8 and largest_power_of_two(1) == 1


def test_halving_doubling_literal_steps_for_four_ranks():
    steps = hd_reduce_scatter_steps(1, 4)
    assert [(s.peer, s.send, s.recv) for s in steps] == [(3, (2, 4), (0, 2)), (0, (0, 1), (1, 2))]
    assert [(s.peer, s.send, s.recv) for s in hd_all_gather_steps(1, 4)] == [(0, (1, 2), (0, 1)), (3, (0, 2), (2, 4))]


@pytest.mark.parametrize("world", range(1, 17))
def test_halving_doubling_reduces_and_gathers_for_any_world(world):
    pp = largest_power_of_two(world)
    roles = [hd_fold(r, world) for r in range(world)]
    assert sum(role != "folded" for role, _, _ in roles) == pp
    # After the fold each taking-part rank holds its own data plus its folded partner's.
    held = {}
    for r, (role, v, partner) in enumerate(roles):
        if role == "folded":
            assert roles[partner][0] == "proxy" and roles[partner][2] == r
            continue
        assert hd_real_rank(v, world) == r
        held[v] = [({r, partner} if role == "proxy" else {r}) for _ in range(pp)]
    plans = {v: hd_reduce_scatter_steps(v, world) for v in held}
    assert all(len(plan) == int(math.log2(pp)) for plan in plans.values())
    for s in range(int(math.log2(pp))):
        new = {v: [set(b) for b in blocks] for v, blocks in held.items()}
        for v, plan in plans.items():
            step = plan[s]
            pv = hd_fold(step.peer, world)[1]
            mirror = plans[pv][s]
            assert hd_real_rank(v, world) == mirror.peer  # partners choose each other
            assert (mirror.send, mirror.recv) == (step.recv, step.send)
            for b in range(*step.recv):
                new[v][b] |= held[pv][b]
        held = new
    everyone = set(range(world))
    assert all(held[v][v] == everyone for v in held)  # virtual rank v owns reduced block v
    owned = {v: {v} for v in held}
    for v in held:
        assert [(s.send, s.recv) for s in hd_all_gather_steps(v, world)] == [
            (s.recv, s.send) for s in reversed(plans[v])
        ]
    for s in range(int(math.log2(pp))):
        nxt = {v: set(o) for v, o in owned.items()}
        for v in held:
            step = hd_all_gather_steps(v, world)[s]
            assert set(range(*step.send)) == owned[v]  # send exactly what this rank owns
            nxt[v] |= set(range(*step.recv))
        owned = nxt
    assert all(o == set(range(pp)) for o in owned.values())


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("numel, piece", [(0, 4), (3, 4), (100, 7), (96, 1000)])
@pytest.mark.parametrize("rs, ag", [(True, True), (True, False), (False, True)])
def test_ring_plan_forwards_what_the_right_neighbour_expects(world, numel, piece, rs, ag):
    plans = [ring_plan(numel, world, r, piece, rs, ag) for r in range(world)]
    bounds = chunk_bounds(numel, world)
    for r, plan in enumerate(plans):
        right = plans[(r + 1) % world]
        # Everything r sends, in order with its tag phase: step 0's pieces, then each forwarded
        # arrival; the right neighbour receives exactly these sizes on these phases.
        sent = [(b - a, plan.first_phase) for a, b in plan.first_sends]
        sent += [(x.stop - x.start, x.forward) for x in plan.arrivals if x.forward is not None]
        assert sent == [(x.stop - x.start, x.phase) for x in right.arrivals]
        assert [x.phase for x in right.arrivals] == [0] * right.n_reduce + [1] * (len(right.arrivals) - right.n_reduce)
        assert all(x.stop - x.start <= piece for x in plan.arrivals)
    # What the data ends as: run the plans on sets of ranks (the oracle is the collective's meaning).
    held = _ring_dataflow(plans, numel, world)
    owner = [b for b, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)]
    for r in range(world):
        for e in range(numel):
            if rs and ag:  # all-reduce: every element sums every rank's
                assert held[r][e] == frozenset(range(world))
            elif rs:  # reduce-scatter: rank r's own block is fully reduced
                assert owner[e] != r or held[r][e] == frozenset(range(world))
            else:  # all-gather: every block ends holding its owner's data
                assert held[r][e] == frozenset([owner[e]])


def _ring_dataflow(plans, numel: int, world: int) -> list[list[frozenset]]:
    """Element e of rank r starts as {r}; a reduced piece takes the union with what arrives, a
    copied piece takes what arrives. The j-th message a rank sends (its step-0 pieces as they
    were at the start, then its forwarded arrivals as they were once handled) is the right
    neighbour's j-th arrival. Ranks advance whenever their next arrival has been sent."""
    held = [[frozenset([r]) for _ in range(numel)] for r in range(world)]
    sent = [[held[r][a:b] for a, b in plan.first_sends] for r, plan in enumerate(plans)]
    nxt = [0] * world
    while any(nxt[r] < len(plans[r].arrivals) for r in range(world)):
        progressed = False
        for r, plan in enumerate(plans):
            left, q = (r - 1) % world, nxt[r]
            if q == len(plan.arrivals) or q >= len(sent[left]):
                continue
            x, data = plan.arrivals[q], sent[left][q]
            for k, e in enumerate(range(x.start, x.stop)):
                held[r][e] = data[k] if x.kind == COPY else held[r][e] | data[k]
            if x.forward is not None:
                sent[r].append(held[r][x.start : x.stop])
            nxt[r], progressed = q + 1, True
        assert progressed, "the plans deadlock: some rank waits for a message never sent"
    return held
