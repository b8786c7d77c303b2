"""torch DDP's API edges on commlab's DDP, against torch's DDP on Gloo.

One spawn checks no_sync with find_unused_parameters, pickling / torch.save / copy.deepcopy, the
logging dictionary and its sampling, ``_set_static_graph`` and backward under distributed
autograd; a second spawn (new processes) loads the DDP the first saved and trains it. The rank
code is in tests/support/ddp_torch_api_cases.py.
"""

import pytest

import commlab
from tests.support import ddp_torch_api_cases

pytestmark = pytest.mark.slow  # every test here starts processes

DIST_AUTOGRAD = "commlab's DistributedDataParallel does not support torch.distributed.autograd"


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp_torch_api")
    save_path, rpc_file = str(folder / "ddp.pt"), str(folder / "rpc_init")
    first = commlab.launch(ddp_torch_api_cases.first, save_path, rpc_file, world_size=2, backend="gloo", timeout=300)
    second = commlab.launch(ddp_torch_api_cases.second, save_path, world_size=2, backend="gloo", timeout=180)
    return first, second


def test_no_sync_reduces_what_any_micro_batch_used_as_torch(spawned):
    for rank, result in enumerate(spawned[0]):
        r = result["no_sync"]
        # Accumulation 1: rank 0 used b only under no_sync; every rank gets torch's averaged .grad.
        # Accumulation 2: nobody used b; it keeps its .grad untouched, as in torch.
        assert r["same"] == [True, True], rank
        assert r["b_grad_none"] == [False, False], rank


def test_pickle_deepcopy_and_torch_save_round_trip(spawned):
    for rank, result in enumerate(spawned[0]):
        r = result["pickling"]
        assert r["types"] == ["DistributedDataParallel"] * 3, rank
        assert r["equal_after_load"] == [True, True, True], rank
        assert not r["shared"], rank  # a deep copy has parameters of its own
        assert r["copy_trains_as_original"] and r["copy_grads_averaged"], rank
        assert r["subgroup_error"].startswith("RuntimeError: DDP Pickling/Unpickling are only supported"), rank


def test_a_loaded_ddp_trains_in_new_processes_as_torch(spawned):
    for rank, r in enumerate(spawned[1]):
        assert r == {"type": "DistributedDataParallel", "same_start": True, "trains_as_torch": True}, rank


def test_logging_data_has_torchs_keys_and_sampling(spawned):
    for rank, result in enumerate(spawned[0]):
        theirs, ours = result["logging"]["torch"], result["logging"]["ours"]
        for case in ("trained", "unused"):
            assert set(ours[case]) == set(theirs[case]), (rank, case, set(ours[case]) ^ set(theirs[case]))
            timed = {k for k in theirs[case] if "time" in k}
            for key in set(theirs[case]) - timed:  # what does not depend on the clock is equal
                assert ours[case][key] == theirs[case][key], (rank, case, key)
            assert all(isinstance(ours[case][k], int) and ours[case][k] >= 0 for k in timed), (rank, case)
        assert ours["iterations"] == theirs["iterations"], rank  # first 10, then every 2nd
        assert ours["caps"] == theirs["caps"] and ours["firsts"] == theirs["firsts"], rank
        assert theirs["caps"][1:] == [512 * 1024, 25 * 2**20, int(100.5 * 2**20)], rank
        assert ours["bad_rate"] == theirs["bad_rate"], rank
        d = ours["trained"]
        assert d["avg_backward_compute_time"] >= d["avg_backward_compute_comm_overlap_time"], rank
        assert d["backward_comm_time_end"] >= d["backward_comm_time_start"] >= d["backward_compute_time_start"], rank
        assert d["backward_compute_time_start"] >= d["forward_compute_time_start"], rank


def test_set_static_graph_is_static_graph_true(spawned):
    for rank, result in enumerate(spawned[0]):
        r = result["static_graph"]
        assert r["same"] and r["static"] == (True, 1), rank
        assert r["late"] == "RuntimeError: set_static_graph() should be called before training loop starts " \
            "and after DistributedDataParallel is constructed.", rank  # fmt: skip
        assert r["late_logged"] == (1, r["late"].removeprefix("RuntimeError: ")), rank


def test_distributed_autograd_is_refused_on_every_rank_at_forward(spawned):
    for rank, result in enumerate(spawned[0]):
        r = result["dist_autograd"]
        assert r["error"].startswith(f"NotImplementedError: {DIST_AUTOGRAD}"), (rank, r["error"])
        assert r["no_grad"] == r["no_sync"] == "no error", rank
        assert r["trains_after"], rank
