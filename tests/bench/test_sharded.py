"""`commlab bench sharded`: its per-launch arithmetic, its input checks, and one tiny run of each pair."""

import pytest
from click.testing import CliRunner

from commlab.bench.sharded_bench import compare, launch_summary
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


BAD = [(["--compare", "deepspeed"], "--compare"), (["--compare", ","], "--compare"), (["--launches", "0"], "--launches"),
       (["--prefetch", "-1"], "--prefetch"), (["--bucket-mb", "0"], "--bucket-mb"), (["--algorithm", "tree"], "--algorithm")]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_options_fail_before_any_rank_starts(args, message):
    result = CliRunner().invoke(bench_sharded, args)
    assert result.exit_code == 2 and message in result.output


@pytest.mark.slow
def test_a_tiny_run_prints_both_comparisons_with_their_rows():
    args = ["--depth", "2", "--width", "32", "--batch", "4", "--iters", "2", "--warmup", "1", "--launches", "1",
            "--algorithm", "ring", "--timeout", "120"]
    result = CliRunner().invoke(bench_sharded, args)
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.output.splitlines()]
    assert "world 2, gloo, commlab's collectives ring" in result.output and "1 launches each" in result.output
    for label in ("commlab stage 3", "torch fully_shard", "commlab stage 2", "commlab DDP"):
        row = next(line for line in lines if line.startswith(label) and " vs " not in line)
        assert len(row[len(label):].split()) == 3 and all(float(v) >= 0 for v in row[len(label):].split())
    for ours, theirs in (("commlab stage 3", "torch fully_shard"), ("commlab stage 2", "commlab DDP")):
        ratio = next(line for line in lines if line.startswith(f"ratio {ours}/{theirs}:"))
        assert float(ratio.split(":")[1].split()[0]) > 0 and "p10 / median / p90" in ratio and "min-max" in ratio
    assert sum(line.startswith("cpu-time ratio:") for line in lines) == 2
