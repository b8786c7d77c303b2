"""Sharded checkpoints through torch's own helpers: get_state_dict / dcp.save at world size 2
(stage 3, small buckets), dcp.load / set_state_dict at world size 3 (stage 1, one bucket), then
training on equals training never stopped. Two spawns; rank side in
tests/support/sharded_checkpoint_cases.py."""

import pytest
import torch

import commlab
from tests.support import sharded_checkpoint_cases as cases
from tests.support.sharded_cases import SPLIT_MB


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    results = commlab.launch(cases.save, path, 3, SPLIT_MB, world_size=2, backend="gloo", timeout=300)
    return path, results


@pytest.mark.slow
def test_each_rank_saves_its_own_shards_without_gathering(saved):
    _, (r0, r1) = saved
    assert r0["dtensors"] == r0["entries"] == 7  # every parameter (Net has 7) a DTensor shard
    assert any(not torch.equal(r0["locals"][k], r1["locals"][k]) for k in r0["locals"])  # distinct content
    assert {f for f in r0["files"] if f.endswith(".distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    for r in (r0, r1):
        # stage 3: no bucket's full parameters held before or after, and none gathered while saving
        assert not any(r["gathered"]) and r["gathers_while_saving"] == 0


@pytest.mark.slow
def test_resumed_at_another_world_size_stage_and_bucket_size_trains_on_exactly(saved):
    path, _ = saved
    results = commlab.launch(cases.resume, path, 1, 25.0, world_size=3, backend="gloo", timeout=300)
    for rank, r in enumerate(results):
        assert r["keys"] and r["buckets"] == 1
        assert max(r["scaled"].values()) <= 1e-6, (rank, r["scaled"])
