"""`commlab bench ddp`: its summary arithmetic, its input checks, and one tiny end-to-end run."""

import math

import pytest
import torch
from click.testing import CliRunner

from commlab.bench.ddp_bench import spread, summarise
from commlab.cli.bench import bench_ddp


def test_summary_takes_the_slowest_rank_per_iteration_then_medians():
    per_rank = [
        {"times": {"commlab": [1.0, 4.0, 2.0], "torch": [1.0, 2.0, 2.0]}},
        {"times": {"commlab": [3.0, 1.0, 2.0], "torch": [2.0, 2.0, 1.0]}},
    ]
    s = summarise(per_rank)
    # slowest per iteration: commlab [3, 4, 2] -> median 3; torch [2, 2, 2] -> median 2
    assert s["commlab"] == 3.0 and s["torch"] == 2.0 and s["ratio"] == 1.5
    assert s["paired_ratio"] == 1.5  # median of [1.5, 2.0, 1.0]
    assert s["spread"]["commlab"] == pytest.approx((2.2, 3.0, 3.8)) and s["max"]["commlab"] == 4.0


def test_spread_interpolates_p10_median_p90():
    assert spread(list(range(11))) == (1.0, 5.0, 9.0)
    assert spread([7.0]) == (7.0, 7.0, 7.0)
    assert spread([0, 0, 0, 12261]) == pytest.approx((0.0, 0.0, 12261 * 0.7))


def test_fault_counts_of_zero_summarise_without_dividing_by_zero():
    per_rank = [{"faults": {"commlab": [0, 4], "torch": [0, 0]}}, {"faults": {"commlab": [2, 0], "torch": [0, 0]}}]
    s = summarise(per_rank, "faults")
    assert s["max"] == {"commlab": 4, "torch": 0} and s["commlab"] == 3  # per iteration the worst rank
    assert math.isnan(s["ratio"]) and math.isnan(s["paired_ratio"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--algorithm", "carrier-pigeon"], "--algorithm"),
        (["--model", "no-such-model"], "--model"),
        (["--bucket-mb", "0"], "--bucket-mb"),
        (["--iters", "0"], "--iters"),
        (["--world-size", "0"], "--world-size"),
    ],
)
def test_bad_options_fail_before_any_rank_starts(args, message):
    result = CliRunner().invoke(bench_ddp, args)
    assert result.exit_code == 2 and message in result.output


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the error shown without enough GPUs")
def test_nccl_without_gpus_is_a_clear_error():
    result = CliRunner().invoke(bench_ddp, ["--backend", "nccl"])
    assert result.exit_code == 2 and "CUDA device" in result.output


@pytest.mark.slow
def test_a_tiny_run_prints_both_medians_and_the_ratio():
    args = ["--depth", "2", "--width", "32", "--batch", "4", "--iters", "3", "--warmup", "1", "--bucket-mb", "0.001"]
    result = CliRunner().invoke(bench_ddp, args + ["--timeout", "120"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.strip().startswith("commlab DDP") for line in lines)
    assert any(line.strip().startswith("torch DDP") for line in lines)
    ratio = next(line for line in lines if "ratio commlab/torch" in line)
    assert float(ratio.split(":")[1].split()[0]) > 0
    assert "world 2, gloo" in result.output and "all-reduce native" in result.output
    assert "p10 / median / p90" in result.output and "minor faults/iter" in result.output
    assert "memory: fixed glibc trim/mmap thresholds" in result.output or "default heap" in result.output
    row = next(line for line in lines if line.strip().startswith("commlab DDP")).split()
    assert len(row) == 2 + 2 + 5 + 5  # label, wall, cpu, p10/median/p90, faults median/p90/max
    assert float(row[4]) <= float(row[6]) <= float(row[8])  # p10 <= median <= p90
