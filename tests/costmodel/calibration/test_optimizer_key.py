"""A calibration profiles the configuration's optimizer and is keyed by it (no process starts)."""

import pytest

from commlab.costmodel.calibration import cache, driver
from commlab.costmodel.search import grid_costs
from commlab.runs.grid import build_grid, merge


class Stop(Exception):
    pass


def test_the_spec_the_ranks_run_names_the_workloads_optimizer(monkeypatch):
    seen = {}

    def capture(rank_fn, spec, **_):
        seen.update(spec)
        raise Stop

    monkeypatch.setattr(driver, "run_calibration", capture)
    with pytest.raises(Stop):
        driver.calibrate(driver.Workload("mlp", "depth=2,width=32", 8, "adam"), backend="gloo", world_size=2, threads=1)
    assert seen["optimizer"] == "adam"


def test_sgd_and_adam_calibrations_have_different_keys_and_sgd_keeps_its_old_one():
    args = dict(backend="gloo", world_size=2, threads=1, model="mlp", model_args="", batch_per_rank=32)
    sgd, adam = cache.make_key(**args), cache.make_key(**args, optimizer="adam")
    assert "optimizer" not in sgd and cache.key_optimizer(sgd) == "sgd"  # an entry made before: plain SGD
    assert cache.key_optimizer(adam) == "adam" and cache.key_id(adam) != cache.key_id(sgd)
    assert "-adam-" in cache.key_id(adam) and "-sgd" not in cache.key_id(sgd)
    plan = build_grid(merge({}, {"stage": "0,1", "optimizer": "sgd,adam", "overlap": "on"}))
    keys = {grid_costs.group_key(c) for c in plan.configs}
    assert {k[-1] for k in keys} == {"sgd", "adam"} and len(keys) == 2  # one calibration per optimizer


def test_an_sgd_entry_is_never_served_for_adam(tmp_path, monkeypatch):
    from tests.support.calibrations import synthetic_entry

    path = tmp_path / "c.json"
    cache.store(path, synthetic_entry())  # plain SGD's
    asked = []

    def calibrate(workload, *, backend, world_size, threads, **_):
        asked.append(workload.optimizer)
        return synthetic_entry(key=driver.workload_key(workload, backend, world_size, threads))

    monkeypatch.setattr(driver, "calibrate", calibrate)
    said = []
    for optimizer in ("sgd", "adam"):
        cfg = build_grid(merge({}, {"model_args": "depth=2,width=64", "optimizer": optimizer})).configs[0]
        entry = next(iter(grid_costs.entries_for([cfg], calibration_path=path, echo=said.append).values()))
        assert cache.key_optimizer(entry["key"]) == optimizer
    assert asked == ["adam"]  # SGD's came from the cache
    assert "optimizer sgd, not adam" in said[0]  # why the cached entry does not serve
