"""`commlab bench collectives`: the pure arithmetic, input errors before spawning, one tiny run."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from commlab.costmodel.terms.alpha_beta import (
    bandwidths,
    busbw_factor,
    fit_alpha_beta,
    least_squares_line,
    size_sweep,
)
from commlab.runs.traffic import format_size, parse_size
from commlab.cli.bench import bench_collectives
from commlab.bench.collectives_report import combine_ranks, fit_line, fit_table, footer_lines, format_table
from commlab.bench.collectives_plugins import rank_data, reduced


def test_parse_and_format_sizes():
    assert parse_size("1K") == 1024 and parse_size("64M") == 64 << 20 and parse_size("1g") == 1 << 30
    assert parse_size("4096") == 4096 and parse_size("64MB") == 64 << 20 and parse_size(" 2KiB ") == 2048
    for bad in ("", "1.5M", "M", "-1K", "64T", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(64 << 20) == "64M" and format_size(1536) == "1536" and format_size(2048) == "2K"


def test_size_sweep_rounds_to_elements_and_stops_at_max():
    assert size_sweep(1024, 8192, 2, 4) == [1024, 2048, 4096, 8192]
    assert size_sweep(1000, 5000, 4, 8) == [1000, 4000]
    assert size_sweep(1, 16, 2, 4) == [4, 8, 16]  # 1 and 2 bytes round up to one element (deduplicated)
    with pytest.raises(ValueError, match="larger than max"):
        size_sweep(10, 5, 2, 4)
    with pytest.raises(ValueError, match="step factor"):
        size_sweep(1, 5, 1, 4)


def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("all_reduce", 1) == 0.0
    assert busbw_factor("all_reduce", 2) == 1.0
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("reduce_scatter", 4) == 0.75 and busbw_factor("all_gather", 8) == 7 / 8
    assert busbw_factor("broadcast", 8) == 1.0 and busbw_factor("reduce", 3) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        busbw_factor("all_to_all", 4)
    algbw, busbw = bandwidths(2_000_000, 1e-3, "all_reduce", 4)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(3.0)


def test_least_squares_line_matches_numpy_polyfit():
    rng = np.random.default_rng(0)
    for x in ([8, 16], [1 << k for k in range(10, 31, 2)], [0.0, 1.0, 1.0, 3.0, 7.5]):
        y = 2e-5 + np.asarray(x, float) * 4e-10 * rng.uniform(0.5, 1.5, len(x)) + rng.normal(0, 1e-6, len(x))
        slope, intercept = np.polyfit(np.asarray(x, float), y, 1)
        assert least_squares_line(x, y) == pytest.approx((intercept, slope), rel=1e-9, abs=1e-15)
    assert least_squares_line([1, 3], [5.0, 1.0]) == (7.0, -2.0)  # unclamped: callers clamp in their own way
    assert all(math.isnan(v) for v in least_squares_line([4, 4, 4], [1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="same length"):
        least_squares_line([1, 2], [1.0])


def test_alpha_beta_fit_recovers_a_known_model():
    sizes = [1 << k for k in range(10, 27, 2)]
    alpha, beta = 50e-6, 2.5e9  # 50 us, 2.5 GB/s
    times = [alpha + s / beta for s in sizes]
    a, b, r2 = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(50.0, rel=1e-6) and b == pytest.approx(2.5, rel=1e-6) and r2 == pytest.approx(1.0)
    noisy = [t * (1.1 if i % 2 else 0.9) for i, t in enumerate(times)]
    assert 0.5 < fit_alpha_beta(sizes, noisy)[2] < 1.0
    assert all(math.isnan(v) for v in fit_alpha_beta([8, 8], [1.0, 2.0]))
    assert fit_alpha_beta([8, 16], [2.0, 1.0])[1] == math.inf  # time falls with size: no bandwidth term


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.float32])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_bench_data_reduce_exactly_to_the_closed_form(dtype, op):
    world, count = 8, 23
    inputs = torch.stack([rank_data(r, world, count, dtype, "cpu").double() for r in range(world)])
    full = {"sum": inputs.sum(0), "avg": inputs.sum(0) / world, "max": inputs.max(0).values, "min": inputs.min(0).values}[op]
    if op == "avg" and not dtype.is_floating_point:
        full = torch.floor(full)
    assert torch.equal(reduced(world, count, dtype, op, "cpu"), full.to(dtype))


def test_time_averaged_over_ranks_slowest_extra_and_summed_wrong():
    per_rank = [
        [{"size_bytes": 8, "count": 2, "algorithm": "ring", "mean_s": 1e-3, "wrong": 0}],
        [{"size_bytes": 8, "count": 2, "algorithm": "ring", "mean_s": 4e-3, "wrong": 2}],
        [{"size_bytes": 8, "count": 2, "algorithm": "ring", "mean_s": 2e-3, "wrong": 1}],
    ]
    df = combine_ranks(per_rank, {"dtype": "float32", "op": "sum", "backend": "gloo"})
    assert df["time_us"].tolist() == [pytest.approx(7000.0 / 3)] and df["wrong"].tolist() == [3]
    assert df["slowest_us"].tolist() == [pytest.approx(4000.0)] and df["root"].tolist() == [-1]
    assert df["algbw_gbps"].iloc[0] == pytest.approx(8 / (7e-3 / 3) / 1e9)
    assert df["busbw_gbps"].iloc[0] == pytest.approx(df["algbw_gbps"].iloc[0] * 4 / 3)
    assert "N/A" in format_table(df.assign(wrong=-1))
    assert format_table(df).splitlines()[-1].split()[6:11] == ["N/A"] * 5  # no out-of-place row given
    footer = footer_lines(df)
    assert footer[0].startswith("# Avg bus bandwidth (ring) : ") and footer[-1] == "# Out of bounds values : 3 FAILED"


def test_a_fit_without_a_bandwidth_term_prints_na():
    import pandas as pd

    df = pd.DataFrame({"algorithm": "ring", "backend": "gloo", "world_size": 2, "size_bytes": [8, 16],
                       "time_us": [2.0, 1.0]})
    line = fit_line(next(fit_table(df).itertuples(index=False)))
    assert "beta n/a" in line and "inf" not in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["-b", "1.5M"], "cannot read size"),
        (["-b", "64M", "-e", "1K"], "larger than max"),
        (["--algorithm", "ring,butterfly"], "unknown algorithm(s) butterfly"),
        (["--world-size", "0"], "expected integers >= 1"),
        (["--world-size", "two"], "comma-separated integers"),
        (["-f", "1"], "-f"),
        (["--dtype", "int8"], "int8"),
        (["--collective", "all_reduce,gather"], "unknown collective(s) gather"),
        (["--collective", "all_gather,broadcast", "--algorithm", "ring"], "broadcast has none of ring"),
    ],
)
def test_bad_input_is_a_click_error_before_any_spawn(args, message):
    result = CliRunner().invoke(bench_collectives, args)
    assert result.exit_code == 2 and message in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown when there is no GPU")
def test_nccl_without_gpus_is_a_click_error():
    result = CliRunner().invoke(bench_collectives, ["--backend", "nccl"])
    assert result.exit_code == 2 and "CUDA device" in result.output


@pytest.mark.slow
def test_tiny_run_table_csv_fit_and_figure(tmp_path):
    # World 3 rather than 2: its bus-bandwidth factor is 4/3, so the busbw check can fail.
    out = tmp_path / "out"
    lines = _bench_collectives("-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1",
                               "--world-size", "3", "--op", "avg", "--timeout", "120", "--out", str(out))  # fmt: skip
    spans = next(i for i, line in enumerate(lines) if "out-of-place" in line)
    assert "in-place" in lines[spans]
    assert lines[spans + 1].split() == ["size(B)", "count", "type", "redop", "root", "algorithm"] + [
        "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "slowest(us)"] * 2
    table_rows = [line.split() for line in lines if line.split()[:1] in (["1024"], ["4096"])]
    assert len(table_rows) == 8 and all(row[9] == "0" and row[14] == "0" for row in table_rows)
    assert [row[0] for row in table_rows] == ["1024"] * 4 + ["4096"] * 4 and all(row[4] == "-1" for row in table_rows)
    assert sum(line.startswith("# Avg bus bandwidth (") for line in lines) == 4
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["command"].startswith("commlab bench collectives -b 1024 -e 4096 -f 4") and meta["environment"]["torch"] == torch.__version__
    df = pd.read_csv(out / "collectives.csv")
    assert {"world_size", "size_bytes", "count", "dtype", "op", "root", "algorithm", "placement", "time_us",
            "slowest_us", "algbw_gbps", "busbw_gbps", "wrong", "backend", "iters", "warmup", "timestamp", "torch"} <= set(df.columns)  # fmt: skip
    assert sorted(df["size_bytes"].unique()) == [1024, 4096] and set(df["count"]) == {256, 1024}
    assert set(df["algorithm"]) == {"ring", "tree", "halving_doubling", "native"} and len(df) == 16
    assert set(df["placement"]) == {"out-of-place", "in-place"}
    assert (df["wrong"] == 0).all() and (df["time_us"] > 0).all() and (df["op"] == "avg").all()
    assert (df["slowest_us"] >= df["time_us"] - 1e-9).all()
    assert (df["busbw_gbps"] - df["algbw_gbps"] * 4 / 3).abs().max() < 1e-9
    assert (df["algbw_gbps"] - df["size_bytes"] / df["time_us"] / 1e3).abs().max() < 1e-9
    fits = pd.read_csv(out / "alpha_beta.csv")
    assert list(fits.columns)[:6] == ["algorithm", "backend", "world_size", "alpha_us", "beta_gbps", "r2"]
    assert len(fits) == 4 and (fits["n_sizes"] == 2).all() and (fits["world_size"] == 3).all()
    assert (out / "busbw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".tmp-*"))  # atomic writes leave no temporary file behind


def test_ratios_to_native_per_run_and_their_geomean():
    from commlab.bench.collectives_ratio import geomeans, ratio_lines, ratio_table

    rows = []
    for run, (r4, r8) in enumerate([(1.0, 1.21), (1.1, 0.9)]):
        for size, ratio in ((4 << 20, r4), (8 << 20, r8)):
            for placement, extra in (("in-place", 0.0), ("out-of-place", 50.0)):  # out of place is ignored
                rows += [{"run": run, "world_size": 2, "size_bytes": size, "algorithm": "native", "placement": placement, "time_us": 100.0 + extra},
                         {"run": run, "world_size": 2, "size_bytes": size, "algorithm": "ring", "placement": placement, "time_us": 100.0 * ratio + extra}]  # fmt: skip
    df = pd.DataFrame(rows)
    ratios = ratio_table(df)
    assert set(ratios["algorithm"]) == {"ring"} and len(ratios) == 4
    assert ratios.set_index(["run", "size_bytes"])["ratio"][(1, 8 << 20)] == pytest.approx(0.9)
    g = geomeans(ratios).set_index("run")["geomean"]
    assert g[0] == pytest.approx(1.1) and g[1] == pytest.approx(math.sqrt(0.99))
    lines = ratio_lines(df, loads={(0, 2): 0.5, (1, 2): 3.25})
    assert lines[0].startswith("# ring / native, in-place time, world size 2, 2 run(s)")
    assert lines[1].split() == ["#", "4M", "1.050", "[1.000-1.100]", "1.000", "1.100"]
    assert lines[3].split()[1:3] == ["geomean", f"{(1.1 + math.sqrt(0.99)) / 2:.3f}"] and lines[3].split()[-2:] == ["1.100", "0.995"]
    assert lines[4].split() == ["#", "load", "0.50", "3.25"]
    assert ratio_lines(df[df["algorithm"] == "ring"]) == []  # no baseline: nothing to print
    # With CPU time per call, its ratios' geomean follows the time geomean line.
    with_cpu = df.assign(cpu_us=df["time_us"].where(df["algorithm"] == "native", df["time_us"] * 2) / 4)
    cpu_line = ratio_lines(with_cpu)[4].split()
    assert cpu_line[1:3] == ["cpu", "geo"] and cpu_line[-2:] == ["2.200", "1.990"]  # twice the time ratios
    assert ratio_table(with_cpu)["cpu_ratio"].tolist() == pytest.approx((2 * ratio_table(df)["ratio"]).tolist())


@pytest.mark.slow
def test_repeat_runs_the_sweep_again_and_prints_the_ratios(tmp_path):
    out = tmp_path / "out"
    lines = _bench_collectives("-b", "4K", "-e", "4K", "-n", "2", "-w", "1", "--algorithm", "ring,native",
                               "--world-size", "2", "--repeat", "2", "--timeout", "120", "--out", str(out))  # fmt: skip
    assert sum("run 1 of 2" in line for line in lines) == 1 and sum("run 2 of 2" in line for line in lines) == 1
    head = lines.index(next(line for line in lines if line.startswith("# ring / native")))
    assert "world size 2, 2 run(s)" in lines[head]
    assert lines[head + 1].split()[1] == "4K" and len(lines[head + 1].split()) == 6  # median, range, 2 runs
    assert lines[head + 2].split()[1] == "geomean"
    df = pd.read_csv(out / "collectives.csv")
    assert sorted(df["run"].unique()) == [0, 1] and len(df) == 2 * 2 * 2 and (df["wrong"] == 0).all()
    assert "load_avg_1min" in df.columns and (df["cpu_us"] > 0).all()
    assert lines[head + 3].split()[1:3] == ["cpu", "geo"]


def _bench_collectives(*args: str) -> list[str]:
    """`commlab bench collectives ARGS` in a subprocess (rank 0 prints each size's rows itself as
    the size completes, which CliRunner would not capture); its stdout lines."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", "from commlab.cli import main; main()", "bench", "collectives", *args],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.splitlines()
