"""torch's own DDP tests, run against commlab's DDP and against torch's (opt-in: minutes).

    PYTHONPATH=$PWD python -m pytest -m torch_suite tests/ddp/test_torch_suite.py

tests/ddp/torch_suite/run.py runs every DDP test of torch's ``_DistTestBase`` and of
ddp_under_dist_autograd_test.py (harness.py rebuilds torch's spawn harness: Gloo, world size 2,
CPU), once with torch's class in every rank and once with commlab's. What must hold: the swap
took in every rank that built a DDP; every test torch passes, commlab passes, except the ones
driving DDP through torch.distributed.autograd, which commlab refuses (commlab/ddp/dist_autograd.py):
those must fail on the refusal, not on a wrong value or a timeout.
"""

import os

import pytest

from tests.support.suite_runs import run_runner

# slow too: `-m "not slow"` replaces addopts' `-m "not torch_suite"` and must still leave these out
pytestmark = [pytest.mark.torch_suite, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLASSES = {
    "commlab": "commlab.ddp.distributed.DistributedDataParallel",
    "torch": "torch.nn.parallel.distributed.DistributedDataParallel",
}
# The tests that run DDP's backward through dist_autograd.backward.
DIST_AUTOGRAD = {
    "TensorPipeDdpUnderDistAutogradTest.test_backward_ddp_outside",
    "TensorPipeDdpUnderDistAutogradTest.test_backward_ddp_outside_uneven_inputs",
    "TensorPipeDdpUnderDistAutogradTest.test_backward_ddp_inside",
    "TensorPipeDdpComparisonTest.test_ddp_comparison",
    "TensorPipeDdpComparisonTest.test_ddp_comparison_uneven_inputs",
    "TensorPipeDdpComparisonTest.test_ddp_dist_autograd_sparse_grads",
    "TensorPipeDdpComparisonTest.test_ddp_dist_autograd_local_vs_remote",
}
REFUSAL = "NotImplementedError: commlab's DistributedDataParallel does not support torch.distributed.autograd"


def _run(ddp: str, folder) -> dict:
    pytest.importorskip("expecttest", reason="torch's test utilities import expecttest (pip install expecttest)")
    out = folder / f"{ddp}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(HERE, "torch_suite")]))
    return run_runner(os.path.join(HERE, "torch_suite", "run.py"), ["--ddp", ddp], env, folder / f"{ddp}.log", out)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("torch_suite")
    return {ddp: _run(ddp, folder) for ddp in ("torch", "commlab")}


def _count(results: dict, outcome: str) -> int:
    return sum(r["outcome"] == outcome for r in results.values())


def test_the_swap_took_in_every_rank(outcomes):
    for ddp, results in outcomes.items():
        built = {name: r["built"] for name, r in results.items() if r["built"]}
        assert built, ddp
        assert all(classes == [CLASSES[ddp]] for classes in built.values()), (ddp, built)


def test_commlab_passes_what_torch_passes_or_refuses_dist_autograd(outcomes):
    theirs, ours = outcomes["torch"], outcomes["commlab"]
    assert theirs.keys() == ours.keys()
    print(f"\ntorch: {_count(theirs, 'passed')} passed, commlab: {_count(ours, 'passed')} passed "
          f"(of {len(theirs)} selected; skipped: torch {_count(theirs, 'skipped')}, commlab {_count(ours, 'skipped')})")  # fmt: skip
    for name, r in theirs.items():
        mine = ours[name]
        if r["outcome"] != "passed":
            continue
        if name in DIST_AUTOGRAD and mine["outcome"] != "passed":
            assert REFUSAL in mine["text"], (name, mine["text"][-1500:])
            assert "timed out after" not in mine["text"], name  # MultiProcessTestCase's timeout
        else:
            assert mine["outcome"] == "passed", (name, mine["outcome"], mine["text"][-1500:])
