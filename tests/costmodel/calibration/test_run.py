"""One calibration run for every calibration (commlab/costmodel/calibration/run.py), without spawning:
the launch is replaced by one that records what it was asked to run."""

import torch

import commlab
from commlab.costmodel.calibration import run as calibration_run
from commlab.costmodel.terms.uncertainty import SPREAD_LIMIT


def _rank_fn(x):  # importable by name, as a spawned rank needs
    return {"x": x}


def test_the_ranks_get_the_threads_and_the_run_is_judged_by_their_spread(monkeypatch):
    asked = {}

    def fake_launch(fn, *args, world_size, backend, timeout):
        asked.update(fn=fn, args=args, world_size=world_size, backend=backend, timeout=timeout)
        return [{"samples": [1.0, 2.0]}, {"samples": [3.0]}]

    monkeypatch.setattr(commlab, "launch", fake_launch)
    monkeypatch.setattr(calibration_run, "runnable_now", lambda: 0.0)
    seen = []
    run = calibration_run.run_calibration(_rank_fn, 7, world_size=2, backend="gloo", timeout=5.0, threads=3,
                                          spread=lambda rs: seen.append(rs) or 2 * SPREAD_LIMIT)
    assert asked["fn"] is calibration_run._with_threads and asked["args"] == (3, _rank_fn, 7)
    assert (asked["world_size"], asked["backend"], asked["timeout"]) == (2, "gloo", 5.0)
    assert seen == [run.results] and run.threads == 3 and run.seconds >= 0
    assert not run.steadiness.steady and run.steadiness.spread == 2 * SPREAD_LIMIT
    assert any("uncertain" in reason for reason in run.steadiness.reasons)


def test_without_threads_the_ranks_get_the_rule_s(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(commlab, "launch", lambda fn, *args, **kw: [args])
    monkeypatch.setattr(calibration_run, "runnable_now", lambda: None)
    run = calibration_run.run_calibration(_rank_fn, world_size=4, backend="gloo", timeout=1.0, spread=lambda rs: 0.0)
    assert run.threads == 2 and run.results == [(2, _rank_fn)]


def test_a_rank_sets_its_threads_before_the_calibration_runs(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = calibration_run._with_threads(2, lambda: torch.get_num_threads())
        assert got == 2
    finally:
        torch.set_num_threads(before)

