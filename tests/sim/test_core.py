"""The discrete-event core: ordering per resource, dependencies, releases, interference, errors."""

import pytest

from commlab.sim import DeadlockError, Task, simulate


def test_in_order_per_resource_and_dependencies():
    r = simulate([
        Task("f", "compute", 2.0),
        Task("b1", "compute", 1.0, deps=("f",)),
        Task("b2", "compute", 3.0),
        Task("ar1", "comm", 4.0, deps=("b1",)),
        Task("ar2", "comm", 1.0, deps=("b2",)),
        Task("opt", "compute", 0.5, deps=("ar1", "ar2")),
    ])
    s = {k: (v.start, v.end) for k, v in r.spans.items()}
    assert s["f"] == (0, 2) and s["b1"] == (2, 3) and s["b2"] == (3, 6)
    assert s["ar1"] == (3, 7)
    assert s["ar2"] == (7, 8)  # ready at 6, but the channel is FIFO behind ar1
    assert s["opt"] == (8, 8.5)
    assert r.makespan == 8.5
    assert [x.name for x in r.by_resource("comm")] == ["ar1", "ar2"]
    assert r.busy("compute") == pytest.approx(6.5)


def test_release_time_and_zero_duration():
    r = simulate([Task("a", "x", 0.0, release=1.5), Task("b", "x", 1.0), Task("c", "y", 0.0, deps=("b",))])
    assert (r.spans["a"].start, r.spans["a"].end) == (1.5, 1.5)
    assert (r.spans["b"].start, r.spans["b"].end) == (1.5, 2.5)
    assert r.spans["c"].start == r.spans["c"].end == 2.5


def test_interference_is_integrated_over_the_overlap():
    # Compute runs at half speed while comm runs on the same host; comm is unaffected.
    def rate(task, others):
        return 0.5 if task.kind == "compute" and others else 1.0

    r = simulate(
        [Task("bw", "cpu0", 4.0, kind="compute", host="rank0"), Task("ar", "ch0", 1.0, kind="comm", host="rank0")],
        rate=rate,
    )
    assert r.spans["ar"].end == pytest.approx(1.0)
    # 1 s at half speed (0.5 of work), then 3.5 s of work alone.
    assert r.spans["bw"].end == pytest.approx(4.5)
    # Other hosts do not interfere.
    r2 = simulate(
        [Task("bw", "cpu0", 4.0, kind="compute", host="rank0"), Task("ar", "ch1", 1.0, kind="comm", host="rank1")],
        rate=rate,
    )
    assert r2.spans["bw"].end == pytest.approx(4.0)


def test_errors():
    with pytest.raises(DeadlockError, match="waiting heads"):
        # x runs a then b; y runs c then d; b needs d, c needs b -> cycle through the orders.
        simulate([Task("a", "x", 1), Task("b", "x", 1, deps=("d",)), Task("c", "y", 1, deps=("b",)), Task("d", "y", 1)])
    with pytest.raises(ValueError, match="unknown"):
        simulate([Task("a", "x", 1, deps=("zz",))])
    with pytest.raises(ValueError, match="twice"):
        simulate([Task("a", "x", 1), Task("a", "y", 1)])
    with pytest.raises(ValueError, match="duration"):
        simulate([Task("a", "x", -1)])
    with pytest.raises(ValueError, match="rate"):
        simulate([Task("a", "x", 1, host="h"), Task("b", "y", 1, host="h")], rate=lambda t, o: 0.0)
