"""One test of torch's own suites (DDP's, FSDP2's) run in this process, and what came of it.

Both opt-in suites (tests/ddp/torch_suite/run.py, tests/sharded/torch_fsdp2/run.py) record the
same facts per test: passed / failed / error / skipped with the message, the classes each rank
built (the lines the harness logs under ``log``, one file per rank named after the test) and
the seconds it took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import unittest
from typing import Any


def run_case(cls: type, name: str, log: str, keep: int = 3000) -> dict[str, Any]:
    """Run ``cls(name)`` and return its outcome, the message's last ``keep`` characters, what the
    ranks built and the seconds."""
    result = unittest.TestResult()
    start = time.monotonic()
    cls(name).run(result)
    seconds = time.monotonic() - start
    if result.skipped:
        outcome, text = "skipped", result.skipped[0][1]
    elif result.failures:
        outcome, text = "failed", result.failures[0][1]
    elif result.errors:
        outcome, text = "error", result.errors[0][1]
    else:
        outcome, text = "passed", ""
    built = sorted({line.strip() for f in os.listdir(log) if f.startswith(name + ".")
                    for line in open(os.path.join(log, f))})  # fmt: skip
    return {"outcome": outcome, "text": text[-keep:], "built": built, "seconds": round(seconds, 1)}


def show(key: str, row: dict[str, Any]) -> None:
    """One line per test as it finishes (the suites take minutes: progress matters)."""
    print(f"{row['outcome']:8s} {row['seconds']:6.1f}s {key} {row['built']}", flush=True)


def write_results(path: str, results: dict[str, Any]) -> None:
    """The outcomes so far, written whole or not at all (a killed run keeps the last complete file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def run_runner(script: str, args: list[str], env: dict[str, str], log_path, out_path) -> dict[str, Any]:
    """A suite's runner script in its own process (stdout and stderr to ``log_path``; a hang costs
    an hour at most), then the outcomes it wrote to ``out_path`` (runners merge into that file)."""
    with open(log_path, "w") as log:
        subprocess.run([sys.executable, script, *args, "--out", str(out_path)], env=env, stdout=log,
                       stderr=subprocess.STDOUT, timeout=3600, check=True)  # fmt: skip
    with open(out_path) as f:
        return json.load(f)
