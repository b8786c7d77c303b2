"""`commlab bench sharded`: its rows and what each side runs, its per-launch arithmetic, its input checks,
and one tiny run of the three rows and of the DDP row."""

import pytest
from click.testing import CliRunner

from commlab.bench.sharded_bench import COMPARISONS, DEFAULT, HEADLINE, compare, launch_summary, runs, side_cfg
from commlab.cli.bench import bench_sharded


def test_a_launch_takes_the_slowest_rank_per_step_then_the_median():
    per_rank = [{"times": [1.0, 4.0, 2.0], "cpu": [1.0, 1.0, 1.0], "faults": [0, 9, 0]},
                {"times": [3.0, 1.0, 2.0], "cpu": [2.0, 0.5, 3.0], "faults": [1, 0, 0]}]
    assert launch_summary(per_rank) == {"times": 3.0, "cpu": 2.0, "faults": 1}  # [3, 4, 2], [2, 1, 3], [1, 9, 0]


def test_the_ratio_of_medians_and_the_spread_of_per_launch_ratios_over_launches_both_finished():
    launches = {"stage3": [{"times": t} for t in (2.0, 3.0, 4.0)],
                "fully_shard": [{"times": t} for t in (2.0, 2.0, 2.0, 8.0)]}  # its 4th launch has no partner
    s = compare(launches, "stage3", "fully_shard")
    assert s["launches"] == 3 and s["ours"] == 3.0 and s["theirs"] == 2.0 and s["ratio"] == 1.5
    assert s["range"] == (1.0, 2.0) and s["spread"] == pytest.approx((1.1, 1.5, 1.9))


CFG = {"algorithm": "auto", "prefetch": 1}


def test_the_like_for_like_rows_come_first_and_run_the_same_collectives_on_both_sides():
    assert list(COMPARISONS)[:3] == list(DEFAULT) == ["ring", "native", "fully_shard"] and HEADLINE == "ring"
    said = {c: [runs(side_cfg(CFG, side)) for side in COMPARISONS[c]] for c in COMPARISONS}
    ours, theirs = said["ring"]
    assert "commlab's ring" in ours and "commlab's ring" in theirs and "set_custom_" in theirs
    assert "prefetch 0" in ours and "no overlap" in theirs  # both sides' all-gathers block
    ours, theirs = said["native"]
    assert "Gloo's list reduce-scatter" in ours and "prefetch 0" in ours
    assert "Gloo's reduce_scatter_single" in theirs and "ring" not in theirs
    ours, theirs = said["fully_shard"]  # commlab as is: auto is the ring on Gloo, prefetch 1
    assert "commlab's ring" in ours and "1 unit(s) ahead" in ours and "Gloo's reduce_scatter_single" in theirs
    assert "Gloo's list" in runs(side_cfg({**CFG, "algorithm": "native"}, COMPARISONS["fully_shard"][0]))


BAD = [(["--compare", "deepspeed"], "--compare"), (["--compare", "ring,tree"], "--compare"), (["--compare", ","], "--compare"), (["--launches", "0"], "--launches"),
       (["--prefetch", "-1"], "--prefetch"), (["--bucket-mb", "0"], "--bucket-mb"), (["--algorithm", "tree"], "--algorithm")]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_options_fail_before_any_rank_starts(args, message):
    result = CliRunner().invoke(bench_sharded, args)
    assert result.exit_code == 2 and message in result.output


@pytest.mark.slow
def test_a_tiny_run_prints_the_three_rows_with_what_each_side_runs():
    args = ["--depth", "2", "--width", "32", "--batch", "4", "--iters", "2", "--warmup", "1", "--launches", "1",
            "--timeout", "120"]
    result = CliRunner().invoke(bench_sharded, args)
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.output.splitlines()]
    heads = [line for line in lines if line.startswith("[")]
    assert [h.split("]")[0] for h in heads] == ["[ring, the headline", "[native", "[fully_shard"]
    assert all("commlab stage 3 vs torch fully_shard" in h and "1 launches each" in h for h in heads)
    said = [line for line in lines if " runs: " in line]
    assert len(said) == 6 and "commlab's ring" in said[1] and "Gloo's reduce_scatter_single" in said[3]
    for label in ("commlab stage 3", "torch fully_shard"):
        rows = [line for line in lines if line.startswith(label) and " vs " not in line and " runs: " not in line]
        assert len(rows) == 3 and all(len(r[len(label):].split()) == 3 for r in rows)
        assert all(float(v) >= 0 for r in rows for v in r[len(label):].split())
    ratios = [line for line in lines if line.startswith("ratio commlab stage 3/torch fully_shard:")]
    assert len(ratios) == 3 and all(float(r.split(":")[1].split()[0]) > 0 and "min-max" in r for r in ratios)
    assert sum(line.startswith("cpu-time ratio:") for line in lines) == 3


@pytest.mark.slow
def test_the_ddp_row_on_request():
    args = ["--compare", "ddp", "--depth", "2", "--width", "32", "--batch", "4", "--iters", "2", "--warmup", "1",
            "--launches", "1", "--algorithm", "ring", "--timeout", "120"]
    result = CliRunner().invoke(bench_sharded, args)
    assert result.exit_code == 0, result.output
    assert "[ddp] commlab stage 2 vs commlab DDP" in result.output and "commlab's ring all-reduce" in result.output
    assert "ratio commlab stage 2/commlab DDP:" in result.output
