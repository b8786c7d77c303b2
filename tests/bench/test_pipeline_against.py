"""``pipeline bench --against torch``: separate alternating launches on the GPT; the ratio's median and spread (no timings asserted)."""

import pytest
from click.testing import CliRunner

from commlab.bench.pipeline_against import _percentile, against_torch, check, split_points, summary, write_csv
from commlab.cli import main


def test_cut_and_refusals_before_any_launch():
    assert split_points("1f1b", 2, 4) == ["layers.2"]
    assert split_points("dualpipev", 2, 4) == ["layers.1", "layers.2", "layers.3"] == split_points("interleaved", 2, 4)
    with pytest.raises(ValueError, match="at least 4 layers"):
        split_points("zb-v", 2, 2)
    with pytest.raises(ValueError, match="no torch.distributed.pipelining counterpart"):
        check(["zb-h1"], [4], 2, 6, {})
    with pytest.raises(ValueError, match="at least as many micro-batches"):
        check(["dualpipev"], [2], 2, 6, {})
    with pytest.raises(ValueError, match="equal micro-batches"):
        check(["1f1b"], [3], 2, 6, {"batch": 16})
    assert _percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.1) == pytest.approx(1.4)
    bad = CliRunner().invoke(main, ["pipeline", "bench", "--against", "torch", "--schedules", "zb-h1"])
    assert bad.exit_code == 2 and "counterpart" in bad.output


@pytest.mark.slow
def test_alternating_launches_on_a_tiny_gpt(tmp_path):
    # Two rounds of the V schedule with the overlap action: 4 launches, world 2, Gloo.
    lines = []
    row = against_torch("dualpipev", 4, 2, echo=lines.append, layers=4, d_model=16, heads=2, seq=8, vocab=32, batch=8,
                        iters=2, warmup=1)  # fmt: skip
    assert len(row["commlab_s"]) == len(row["torch_s"]) == len(row["ratios"]) == 2 and len(lines) == 2
    assert all(t > 0 for t in row["commlab_s"] + row["torch_s"]) and row["p10"] <= row["ratio"] <= row["p90"]
    assert summary(row).startswith("dualpipev    m=4   commlab/torch ")
    write_csv(tmp_path / "run" / "against.csv", [row])
    lines = (tmp_path / "run" / "against.csv").read_text().splitlines()
    assert lines[0] == "schedule,microbatches,round,commlab_s,torch_s,ratio" and lines[1].startswith("dualpipev,4,0,")
