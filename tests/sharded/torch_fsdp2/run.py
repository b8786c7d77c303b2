"""Run torch's FSDP2 tests (harness.py) with one fully_shard and add each test's outcome to a JSON file.

    COMMLAB_TORCH_SRC=/path/to/pytorch PYTHONPATH=$PWD \\
        python tests/sharded/torch_fsdp2/run.py --impl commlab --files frozen --out /tmp/commlab.json [-k NAME]

One process per rank (Gloo, CPU, world size 2); the outcome of each test is passed / failed /
error / skipped with the message, the implementations its ranks built (from the log harness.install
has the shim or torch's recorded call write) and its seconds. Results are merged into ``--out``, so
one file at a time can run (each under the CPU lock) and add to the same table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import unittest

from tests.support.suite_runs import run_case, show, write_results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["commlab", "torch"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--files", help="comma-separated test_fully_shard_<name>.py names (default: all)")
    parser.add_argument("-k", action="append", default=[], help="run only tests whose Class.test_name contains this")
    parser.add_argument("--timeout", type=int, default=240, help="seconds before a test's ranks are killed")
    args = parser.parse_args()
    if not os.path.isdir(os.environ.get("COMMLAB_TORCH_SRC", "")):
        sys.exit("set COMMLAB_TORCH_SRC to a torch source checkout (its test/distributed/_composable/fsdp)")
    work = tempfile.mkdtemp(prefix="commlab-fsdp2-suite-")
    log = os.path.join(work, "built")
    os.makedirs(log)
    os.environ.update(COMMLAB_FSDP2_IMPL=args.impl, COMMLAB_SUITE_LOG=log, TEMP_DIR=work,
                      DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout))  # fmt: skip
    if args.files:
        os.environ["COMMLAB_FSDP2_FILES"] = args.files
    import harness  # reads the environment above at import, as torch's test modules do

    loader = unittest.TestLoader()
    names = [(cls, n) for cls in harness.CLASSES for n in loader.getTestCaseNames(cls)]
    if args.k:
        names = [(c, n) for c, n in names if any(k in f"{c.__name__}.{n}" for k in args.k)]
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    for cls, name in names:
        row = run_case(cls, name, log, keep=4000)
        results[f"{cls.__name__}.{name}"] = {"file": harness.file_of(cls), **row}
        for f in os.listdir(log):  # the next test's log starts empty (names repeat across classes)
            os.remove(os.path.join(log, f))
        show(f"{cls.__name__}.{name}", row)
        write_results(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
