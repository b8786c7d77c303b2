"""`commlab bench tensor`: its input checks before any rank, its table from made-up launches, and
one tiny run whose rows, labels and collective counts are read back."""

import pytest
from click.testing import CliRunner

from commlab.bench import tensor_bench
from commlab.cli.bench import bench_tensor

BAD = [(["--algorithm", "carrier-pigeon"], "unknown all-reduce algorithm(s) carrier-pigeon"),
       (["--algorithm", ","], "unknown all-reduce algorithm(s) (none)"),
       (["--heads", "3", "--d-model", "96"], "does not divide the attention heads around layers.0.q (3)"),
       (["--heads", "4", "--d-model", "30"], "d_model 30 is not a multiple of heads 4"),
       (["--heads", "2", "--d-model", "6", "--world-size", "4"], "size 4 does not divide layers.0.q.out_features (6)"),
       (["--world-size", "1"], "--world-size"), (["--launches", "0"], "--launches")]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_options_fail_before_any_rank_starts(args, message):
    result = CliRunner().invoke(bench_tensor, args)  # a rank started here would fail the test (conftest)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def _table(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines()]


def test_the_like_for_like_row_comes_first_and_each_commlab_row_gets_its_ratio_to_torch(capsys):
    cfg = dict(algorithms=["native", "ring"], layers=4, d_model=512, heads=4, vocab=256, seq=32, batch=8, iters=2, warmup=1)
    done = {"native": [{"times": 0.2, "cpu": 0.1}, {"times": 0.3, "cpu": 0.1}],
            "torch": [{"times": 0.2, "cpu": 0.2}, {"times": 0.2, "cpu": 0.2}],
            "ring": [{"times": 0.4, "cpu": 0.2}, {"times": 0.4, "cpu": 0.2}]}
    per_block = {"forward": {"all_reduce": 2.0}, "backward": {"all_reduce": 2.0}}
    facts = {"params": 13e6, "torch": {"forward": {"all_reduce": 2.0}, "backward": {"all_reduce": 4.0}},
             "native": {**per_block, "comm_s": 0.05}, "ring": {**per_block, "comm_s": 0.07}}
    tensor_bench._report(done, facts, cfg, 2)
    lines = _table(capsys.readouterr().out)
    rows = [line for line in lines if line.startswith(("commlab TP (", "torch parallelize_module  "))]
    assert [r.split("  ")[0] for r in rows[-3:]] == ["commlab TP (native)", "torch parallelize_module", "commlab TP (ring)"]
    assert rows[-3].split()[-2:] == ["250.00", "100.00"]  # medians over the launches, ms
    assert lines[-2].startswith("ratio commlab TP (native)/torch: 1.250 (per launch p10 / median / p90")
    assert lines[-1].startswith("ratio commlab TP (ring)/torch: 2.000") and "cpu-time ratio 1.000" in lines[-1]
    assert "torch parallelize_module  forward 2 all_reduce; backward 4 all_reduce" in lines
    assert any(line.startswith("commlab TP (native)") and "50.0 ms/step in them" in line for line in lines)


@pytest.mark.slow
def test_a_tiny_run_prints_both_sides_rows_their_collectives_and_the_ratios():
    args = ["--layers", "1", "--d-model", "32", "--heads", "2", "--batch", "2", "--seq", "8", "--iters", "2",
            "--warmup", "1", "--launches", "1", "--algorithm", "native,ring", "--timeout", "120"]
    result = CliRunner().invoke(bench_tensor, args)
    assert result.exit_code == 0, result.output
    lines = _table(result.output)
    assert "world 2, gloo" in result.output and "1 launches each" in result.output
    # gpt_plan(): forward, the two row layers' outputs; backward, q (k and v share its input) and fc
    assert "torch parallelize_module  forward 2 all_reduce; backward 4 all_reduce" in lines
    for algorithm in ("native", "ring"):
        ran = next(line for line in lines if line.startswith(f"commlab TP ({algorithm})") and "forward" in line)
        assert "forward 2 all_reduce; backward 2 all_reduce;" in ran and "ms/step in them" in ran
        ratio = next(line for line in lines if line.startswith(f"ratio commlab TP ({algorithm})/torch:"))
        assert float(ratio.split(":")[1].split()[0]) > 0 and "min-max" in ratio and "cpu-time ratio" in ratio
    rows = [line for line in lines if line.startswith(("commlab TP (", "torch parallelize_module")) and "forward" not in line]
    assert [r.split("  ")[0] for r in rows] == ["commlab TP (native)", "torch parallelize_module", "commlab TP (ring)"]
    assert all(len(r.split("  ")[-1].split()) == 1 and float(v) > 0 for r in rows for v in r.split()[-2:])
