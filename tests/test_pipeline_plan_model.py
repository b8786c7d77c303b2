"""``pipeline plan --model``: any model the splitter cuts by name, planned with its optimizer state and temporaries."""

from click.testing import CliRunner

from commlab.cli import main
from commlab.costmodel.plan import candidates
from commlab.costmodel.plan_model import candidate_points, profile_model, split_points
from pipeline_plan_fixture import chain

FIXTURE = "pipeline_plan_fixture:chain"


def test_a_factory_model_is_profiled_piece_by_piece_and_planned():
    assert candidate_points(chain()) == [f"blocks.{k}" for k in range(4)]
    profiles, points = profile_model(FIXTURE, 8, [2, 4], 2)
    assert points == [f"blocks.{k}" for k in range(4)] and set(profiles) == {2, 4}
    p = profiles[2]  # five pieces: the projection, then a block each (the last with the head)
    assert len(p.seconds) == 5 and all(s > 0 for s in p.saved[1:]) and p.params[0] == (16 * 16 + 16) * 4
    assert split_points(points, [2, 3]) == ["blocks.1"] and split_points(points, [1, 1, 2, 1]) == ["blocks.0", "blocks.1", "blocks.3"]
    # The memory model counts the optimizer's state: Adam's two copies of the parameters more than none.
    plain = {(q.schedule, q.microbatches, q.checkpoint): q for q in candidates(profiles, 2, [1], ["never"], ["1f1b"])}
    adam = {(q.schedule, q.microbatches, q.checkpoint): q for q in candidates(profiles, 2, [1], ["never"], ["1f1b"], optimizer="adam")}
    for key, q in plain.items():
        params = [sum(p.params[a:a + n]) for a, n in zip((0, q.balance[0]), q.balance)]
        assert all(abs((b - a) - 2 * w) < 1e-6 for a, b, w in zip(q.peak_bytes, adam[key].peak_bytes, params))


def test_plan_cli_takes_a_model_and_prints_its_split_points():
    args = ["pipeline", "plan", "--model", FIXTURE, "-p", "2", "-m", "2,4", "--batch", "8", "--no-calibrate",
            "--schedules", "1f1b,dualpipev", "--checkpoint", "never,always", "--optimizer", "adam", "--budget-mb", "64"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "plan: " in out.output and "split points: ['blocks." in out.output and "dualpipev" in out.output
    bad = CliRunner().invoke(main, args[:4] + ["--split-at", "nope"] + args[4:])
    assert bad.exit_code == 2 and "names no submodule" in bad.output
    assert CliRunner().invoke(main, ["pipeline", "plan", "--split-at", "blocks.1"]).exit_code == 2
