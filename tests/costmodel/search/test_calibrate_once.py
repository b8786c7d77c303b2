"""The README's "calibrate once": `commlab calibrate SPEC` makes every entry that the README's
`predict` and `tune` of that spec use, and a missing entry is named with why the cached ones do not
serve (calibration replaced by a synthetic entry: no process is spawned)."""

import re
import shlex
from pathlib import Path

import pytest

from commlab.collectives import algorithm_names
from commlab.costmodel.calibration import cache as prof
from commlab.costmodel.calibration import driver as cal
from tests.support.calibrations import invoke, synthetic_entry

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def calls(monkeypatch):
    """Every calibration asked for: (world size, batch per rank, algorithms)."""
    made = []

    def fake(workload, *, backend, world_size, threads=None, algorithms=(), sharded=False, **_):
        made.append((world_size, workload.batch_per_rank, set(algorithms)))
        entry = synthetic_entry()
        entry["key"] = prof.make_key(backend=backend, world_size=world_size, threads=threads, model=workload.model,
                                     model_args=workload.model_args, batch_per_rank=workload.batch_per_rank)
        entry["collectives"] = {a: entry["collectives"]["native"] for a in algorithms}
        return entry

    monkeypatch.setattr(cal, "calibrate", fake)
    return made


def readme_commands() -> list[list[str]]:
    """The README's calibrate, predict and tune commands, in order, as it writes them."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(commlab calibrate .*?)```", readme, re.S).group(1)
    commands = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    return [c[1:] for c in commands if c and c[1] in ("calibrate", "predict", "tune") and "--hardware" not in c]


def test_the_readmes_calibrate_covers_its_predict_and_tune(calls, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # sweeps/smoke.yaml as the README names it
    commands = readme_commands()
    assert [c[0] for c in commands] == ["calibrate", "predict", "tune"]
    profile = ["--calibration", str(tmp_path / "calibration.json")]
    first, *rest = commands
    assert invoke(*first, *profile).exit_code == 0
    made = list(calls)
    assert made and all(algos >= set(algorithm_names()) for _, _, algos in made)  # what tune searches
    for command in rest:
        if "--against" in command:  # the measured sweep it compares with is not here
            i = command.index("--against")
            command = command[:i] + command[i + 2:]
        out = ["--out", str(tmp_path / "results")] if command[0] == "predict" else []
        r = invoke(*command, *profile, *out)
        assert r.exit_code == 0, r.output
        assert "calibrating" not in r.output
    assert calls == made  # predict and tune calibrated nothing more


def test_a_missing_entry_says_which_cached_ones_exist_and_why_they_do_not_serve(calls, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "calibration.json"
    prof.store(path, synthetic_entry())  # world size 2, batch per rank 32: the old README's calibrate
    r = invoke("predict", "sweeps/smoke.yaml", "--calibration", str(path), "--out", str(tmp_path), "--no-figures")
    assert r.exit_code == 0, r.output
    assert re.search(r"no calibration of mlp-gloo-w2-t\d+-bs4-\w+ .*holds .*mlp-gloo-w2-t\d+-bs32-\w+: "
                     r"batch per rank 32, not 4", r.output), r.output
    assert re.search(r"no calibration of mlp-gloo-w1-\S+ .*world size 2, not 1, .*batch per rank 32, not 8", r.output)
    assert "a calibration serves one backend, world size, threads per rank, batch per rank and optimizer" in r.output
    # A cache made by predict (native only) is completed for tune, saying what it lacked and why.
    r = invoke("tune", "sweeps/smoke.yaml", "--world-size", "2", "--json", "--calibration", str(path))
    assert r.exit_code == 0 and "lacks ring, tree, halving_doubling (calibrated for native;" in r.output, r.output
