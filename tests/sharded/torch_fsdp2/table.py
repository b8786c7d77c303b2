"""The outcome table of a torch and a commlab run of torch's FSDP2 tests (run.py's JSON files).

    python tests/sharded/torch_fsdp2/table.py /tmp/torch.json /tmp/commlab.json

Prints the counts, then one markdown row per test: its file, torch's outcome (with the skip
reason or the first error line), commlab's outcome and first error line.
"""

from __future__ import annotations

import json
import re
import sys

# The line a failure ends on: "ValueError: ...", "AssertionError: ...", "torch.x.Error: ...".
ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b.*$")


def first_error(text: str) -> str:
    """The exception line of the first rank's traceback (MultiProcessTestCase repeats it per rank)."""
    for line in text.splitlines():
        line = line.strip()
        if ERROR_LINE.match(line) and not line.startswith(("RuntimeError: Process", "AssertionError: Expected zero exit")):
            return line[:160]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def describe(result: dict | None) -> str:
    if result is None:
        return "not run"
    if result["outcome"] == "passed":
        return "pass"
    if result["outcome"] == "skipped":
        return f"skip: {result['text'].strip()[:120]}"
    return f"fail: {first_error(result['text'])}"


def counts(results: dict) -> dict[str, int]:
    out = {"passed": 0, "failed": 0, "skipped": 0}
    for r in results.values():
        out["failed" if r["outcome"] == "error" else r["outcome"]] += 1
    return out


def table(theirs: dict, ours: dict) -> str:
    t, o = counts(theirs), counts(ours)
    both = sum(r["outcome"] == "passed" and ours.get(k, {}).get("outcome") == "passed" for k, r in theirs.items())
    lines = [
        f"{len({**ours, **theirs})} tests; torch's fully_shard: {t['passed']} pass, {t['failed']} fail, {t['skipped']} skip; "
        f"commlab's shim: {o['passed']} pass ({both} of torch's passes), {o['failed']} fail, {o['skipped']} skip.",
        "",
        "| file | test | torch | commlab |",
        "|---|---|---|---|",
    ]
    for key in sorted({**ours, **theirs}, key=lambda k: ({**ours, **theirs}[k]["file"], k)):
        torch_result, mine = theirs.get(key), ours.get(key)
        skipped = torch_result is not None and torch_result["outcome"] == "skipped"
        file = (torch_result or mine)["file"]
        cell = "(skipped)" if skipped else describe(mine)
        lines.append(f"| {file} | {key} | {describe(torch_result)} | {cell} |".replace("\n", " "))
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f1, open(sys.argv[2]) as f2:
        print(table(json.load(f1), json.load(f2)))
