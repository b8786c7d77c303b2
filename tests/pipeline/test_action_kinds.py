"""Adding an action kind: one registry entry and one executor handler, here in the test alone.

The new kind ``N`` ("note") reads a micro-batch's stage output after its forward, on the same
rank, and sends nothing. Validation, the comm pass, liveness, the schedule simulation, the cost
lowering and the executor all take it without a change to their code.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from commlab.pipeline import KINDS, Kind, as_actions, liveness, lower_comm, register_kind, simulate, check_schedule
from commlab.costmodel.terms.costs import PointToPoint, StageProfile, SystemCosts
from commlab.costmodel.lowering.pipeline import predict
from commlab.pipeline.runtime.executor import HANDLERS, PipelineExecutor
from commlab.pipeline.runtime.stages import RankStages
from commlab.pipeline.schedule.checks import problems

NOTE = "N"


@pytest.fixture
def note_kind():
    seen = []

    def note(executor, action, message):  # the executor's handler: record the stage's output norm
        seen.append((action.stage, action.microbatch, float(executor._stash[(action.stage, action.microbatch)].y.detach().norm())))
        return None

    register_kind(Kind(NOTE, lambda a, stages, split: (a.at(a.stage, "F"),), lambda f, b, w: 0.25 * f, doc="note"))
    HANDLERS[NOTE] = note
    try:
        yield seen
    finally:
        del KINDS[NOTE], HANDLERS[NOTE]


def test_a_registered_kind_is_validated_simulated_and_priced(note_kind):
    gpipe = as_actions([["0F0", "0B0"], ["1F0", "1N0", "1B0"]])
    check_schedule(gpipe)
    assert any("before 1F0 (F before N)" in p for p in problems(as_actions([["0F0", "0B0"], ["1N0", "1F0", "1B0"]])))
    # F0 (1) -> F1 (1) -> N1 (0.25 of F) -> B1 (2) -> B0 (2): the chain, its cost from the registry.
    assert simulate(gpipe, 1.0, 2.0).step_time == pytest.approx(6.25)
    assert predict(gpipe, SystemCosts(p2p=PointToPoint(0.5)), StageProfile((1.0, 1.0), (2.0, 2.0))).step_time == pytest.approx(7.25)
    # It sends nothing and keeps nothing alive of its own.
    assert [str(op) for op in lower_comm(gpipe)[1]] == ["RECV 0F0>1F0", "WAIT RECV 0F0>1F0", "1F0", "1N0", "1B0", "SEND 1B0>0B0",
                                                    "WAIT SEND 1B0>0B0"]  # awaited at the end of the step
    assert [dict(live.alive) for live in liveness(gpipe)[1]] == [{(1, 0): True}] * 3


def test_the_executor_runs_a_registered_kind(note_kind, tmp_path):
    # One rank holding both stages: the executor's handler table and hand-overs, in this process.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        stages = RankStages(model, [2, 1], placement=[0, 0])
        order = [["0F0", "1F0", "1N0", "1B0", "0B0", "0F1", "1F1", "1N1", "1B1", "0B1"]]
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        loss = PipelineExecutor(stages, order, microbatches=2, loss_fn=F.mse_loss).step(x, target=y)
        assert [(s, i) for s, i, _ in note_kind] == [(1, 0), (1, 1)]
        assert note_kind[0][2] == pytest.approx(float(model(x[:2]).detach().norm()), rel=1e-5)
        assert loss.item() == pytest.approx(F.mse_loss(model(x), y).item(), rel=1e-5)
    finally:
        dist.destroy_process_group()
