"""``pipeline plan --model``: any model the splitter cuts by name, planned with its optimizer state and temporaries."""

import pytest
from click.testing import CliRunner

from commlab.cli import main
from commlab.costmodel.planner.plan import candidates
from commlab.costmodel.planner.model import candidate_points, profile_model, split_points
from tests.support.pipeline_chain import chain

FIXTURE = "tests.support.pipeline_chain:chain"


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


def test_a_block_that_forward_calls_first_is_no_split_point():
    import torch

    from examples.heldout_models import blocks

    model = blocks(d_model=32, layers=3, heads=2, seq=4)  # the encoder's first layer runs first: no stage before it
    assert candidate_points(model) == [f"blocks.layers.{k}" for k in range(3)]
    assert candidate_points(model, torch.randn(1, 4, 32)) == ["blocks.layers.1", "blocks.layers.2"]
    assert candidate_points(chain(), torch.randn(1, 16)) == [f"blocks.{k}" for k in range(4)]  # the projection runs first


def test_a_traced_stage_keeps_its_weight_nodes_gradients_for_w():
    import torch

    from commlab.costmodel.planner.model import _Piece, weight_node_bytes
    from commlab.pipeline.runtime.traced import trace_stages

    model, x = chain(width=16, depth=2), torch.randn(8, 16)
    pieces = torch.nn.Sequential(*(_Piece(p, k) for k, p in enumerate(trace_stages(model, ["blocks.0", "blocks.1"], (x,)).parts)))
    kept = weight_node_bytes(pieces, x)
    # The projection's input needs no gradient: nothing to split. A block keeps the gradients at its
    # two Linears' outputs (8 x 32 and 8 x 16 floats); the last piece the head's too (8 x 4).
    assert kept == [0.0, (8 * 32 + 8 * 16) * 4.0, (8 * 32 + 8 * 16 + 8 * 4) * 4.0]  # the first: the model's input, no I
    profiles, _ = profile_model(FIXTURE, 16, [2], 2)
    assert profiles[2].kept_nodes[1] == kept[1]
    # A stage keeps its output's gradient and its pieces' weight-node gradients, not every piece's output.
    assert profiles[2].stage_kept([1, 2, 2]) == [profiles[2].output[0], profiles[2].output[2] + 2 * kept[1],
                                               profiles[2].output[4] + kept[1] + kept[2]]  # fmt: skip


@pytest.mark.slow
def test_plan_validate_measures_a_traced_model_and_calibrates_on_it_off_the_grid(tmp_path):
    # One launch calibrates (the model's own runs at 3 micro-batches, a count no plan uses), one measures.
    out = tmp_path / "rows.csv"
    args = ["pipeline", "plan", "--model", FIXTURE, "--model-args", "width=64,depth=4", "-p", "2", "-m", "2,4", "--batch", "16",
            "--schedules", "1f1b,zb-h1", "--checkpoint", "never,always", "--validate", "--all-plans", "--iters", "2",
            "--warmup", "1", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "from the model's own runs at 3 micro-batches" in result.output and "zb-h1 v=1 never" in result.output
    assert "every stage timed on every rank at once" in result.output
    assert "(16 comparisons): median |error|" in result.output
    rows = out.read_text().splitlines()
    assert len(rows) == 9 and rows[0].startswith("schedule,microbatches,virtual,checkpoint,balance,chosen,predicted_s,measured_s")
    for row in rows[1:]:
        cells = dict(zip(rows[0].split(","), row.split(",")))
        assert float(cells["measured_s"]) > 0 and float(cells["forward_s"]) > 0 and float(cells["reverse_s"]) > 0
        # The weight-node gradients zb-h1 keeps are counted: predicted within 25% of the allocator's peak.
        assert abs(float(cells["predicted_peak"]) / float(cells["measured_peak"]) - 1) < 0.25, cells


def test_plan_options_that_need_another_are_refused_before_anything_runs():
    for args, says in ((["--out", "x.csv"], "--out writes what --validate measures"),
                       (["--model-args", "depth=2"], "--model-args sizes --model"),
                       (["--model", FIXTURE, "--model-args", "colour=2"], "unexpected keyword argument 'colour'")):  # fmt: skip
        result = CliRunner().invoke(main, ["pipeline", "plan", "--no-calibrate", *args])
        assert result.exit_code == 2 and says in result.output, result.output


def test_the_last_stage_keeps_what_the_loss_saves():
    from dataclasses import replace

    # Cross-entropy keeps its log-softmax, as large as the logits: the last stage's stash holds it.
    profiles, _ = profile_model("transformer", 8, [2], 2, vocab=64, d_model=16, layers=2, heads=2, seq=4)
    p = profiles[2]
    logits = 4 * 4 * 64 * 4.0  # 4 samples x 4 tokens x 64 classes, float32
    assert p.output[-1] == logits and logits <= p.loss_saved <= logits + 1024  # and the int64 targets
    balance = [1, len(p.seconds) - 1]
    without = replace(p, loss_saved=0.0).stage_saved(balance)  # the same profile, the loss saving nothing
    assert without[0] == p.stage_saved(balance)[0] and p.stage_saved(balance)[1] == without[1] + p.loss_saved
