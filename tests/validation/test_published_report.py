"""`commlab validate published`'s printing, summary, CSV and figure, on a small fake table."""

import csv

import pytest
from click.testing import CliRunner

from commlab.cli.validate import validate
from commlab.validation.published import report


def fake_rows():
    return [{"table": "fake", "case": c, "metric": "s", "published": p, "predicted": q, "error": q / p - 1,
             "source": "Table 0"} for c, p, q in (("a", 1.0, 1.1), ("b", 10.0, 9.0), ("c", 100.0, 100.0))]


def test_summary_and_lines():
    rows = fake_rows()
    s = report.summary(rows)["fake"]
    assert s["median"] == pytest.approx(0.1) and s["worst"] == pytest.approx(0.1) and s["rows"] == 3
    printed = report.lines(rows)
    assert len(printed) == 1 + 3 + 1 and "+10.0%" in printed[1] and "median |error| 10.0%" in printed[-1]
    fitted = [dict(rows[0], case="a (fitted)", error=0.0), *rows[1:]]  # a row a constant came from is not counted
    assert report.summary(fitted)["fake"]["rows"] == 2


def test_unknown_table_named_before_anything_runs():
    ran = []
    with pytest.raises(ValueError, match="unknown table.*nope.*the tables are fake"):
        report.collect({"fake": lambda: ran.append(1) or fake_rows()}, ["fake", "nope"])
    assert not ran
    with pytest.raises(ValueError, match="lacks source"):
        report.collect({"bad": lambda: [{k: v for k, v in fake_rows()[0].items() if k != "source"}]})


def test_the_command_prints_writes_the_csv_and_draws(tmp_path, monkeypatch):
    import commlab.validation.published as published

    monkeypatch.setattr(published, "SOURCES", {"fake": fake_rows})
    result = CliRunner().invoke(validate, ["published", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "fake: median |error| 10.0%" in result.output
    with open(tmp_path / "published.csv") as f:
        written = list(csv.DictReader(f))
    assert [r["case"] for r in written] == ["a", "b", "c"] and float(written[1]["error"]) == pytest.approx(-0.1)
    assert (tmp_path / "published.png").stat().st_size > 0 and (tmp_path / "published.pdf").exists()
    bad = CliRunner().invoke(validate, ["published", "--table", "nope", "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "the tables are fake" in bad.output
