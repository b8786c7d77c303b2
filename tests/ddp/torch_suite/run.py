"""Run torch's DDP tests (harness.py) with one DDP and write each test's outcome as JSON.

    PYTHONPATH=$PWD python tests/ddp/torch_suite/run.py --ddp commlab --out /tmp/commlab.json [-k NAME]

Gloo, world size 2, on CPU as torch's CI runs test_distributed_spawn.py; the outcome of each
test is passed / failed / error / skipped with the message, the classes each rank built (from
the log harness.install writes) and its seconds.
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
    parser.add_argument("--ddp", choices=["commlab", "torch"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("-k", action="append", default=[], help="run only tests whose name contains this")
    parser.add_argument("--skip-known", help="a JSON from an earlier run: leave out the tests it has")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="commlab-torch-suite-")
    log = os.path.join(work, "built")
    os.makedirs(log)
    os.environ.update(BACKEND="gloo", WORLD_SIZE="2", TEMP_DIR=work, COMMLAB_SUITE_DDP=args.ddp,
                      COMMLAB_SUITE_LOG=log)  # fmt: skip
    import harness  # reads the environment above at import, as torch's test modules do

    loader = unittest.TestLoader()
    names = [(cls, n) for cls in harness.CLASSES for n in loader.getTestCaseNames(cls) if harness.is_ddp_test(cls, n)]
    if args.k:
        names = [(c, n) for c, n in names if any(k in n for k in args.k)]
    if args.skip_known:
        with open(args.skip_known) as f:
            known = json.load(f)
        names = [(c, n) for c, n in names if f"{c.__name__}.{n}" not in known]
    results = {}
    for cls, name in names:
        results[f"{cls.__name__}.{name}"] = row = run_case(cls, name, log)
        show(f"{cls.__name__}.{name}", row)
    write_results(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
