"""The docs stay a guide: short, said once, speaking of the project, true to the code.

- README.md and docs/design.md stay within their line budgets;
- no paragraph of 200 characters or more appears twice in README, CHANGELOG or docs/;
- no tracked file names development rounds or tracker numbers (say the version, date or commit);
- docs/design.md's package map lists, per package, exactly the packages its modules import, and
  each package's section opens with a file map naming exactly the modules in its folder;
- the version in pyproject.toml is commlab.__version__.
"""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

import commlab
from tests.support.import_graph import import_graph

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Words that point into a tracker or a development round: "session" or "issue(s)" followed by a
# number, or a hash sign followed by digits. An upstream citation (owner/repo, a hash, a number)
# names another project's tracker, which the house style asks for, so a hash right after a word
# character or a slash is not counted.
TRACKER = re.compile(r"\bsessions? ?\d|\bissues? ?#?\d|(?<![\w/])#\d+\b", re.I)


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, whitespace collapsed."""
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", text) if block.strip()]


def repeated(docs: dict[str, str], min_chars: int = 200) -> dict[str, list[str]]:
    """Paragraphs of at least min_chars characters found more than once -> where each appears."""
    seen = defaultdict(list)
    for name, text in docs.items():
        for para in paragraphs(text):
            if len(para) >= min_chars:
                seen[para].append(name)
    return {para: where for para, where in seen.items() if len(where) > 1}


def tracker_references(text: str) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if TRACKER.search(line)]


def package_map(design: str) -> dict[str, set[str]]:
    """The table under the header ``package | depends on | what it holds and why``."""
    lines = design.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if re.fullmatch(r"\|\s*package\s*\|\s*depends on\s*\|.*\|\s*", line))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        package, depends, _ = (cell.strip() for cell in line.strip().strip("|").split("|", 2))
        names = re.findall(r"`(commlab(?:\.\w+)*)`", package)
        assert len(names) == 1, f"a package map row names one package: {line}"
        rows[names[0]] = set(re.findall(r"`(commlab(?:\.\w+)*)`", depends))
    return rows


def package_of(module: str, packages: list[str]) -> str | None:
    """The longest row name that is ``module`` or one of its parents."""
    matches = [p for p in packages if module == p or module.startswith(p + ".")]
    return max(matches, key=len, default=None)


def package_graph(modules: dict[str, set[str]], packages: list[str]) -> dict[str, set[str]]:
    """Package -> packages its modules import; a package's imports of its own modules ignored."""
    unmapped = sorted(m for m in modules if package_of(m, packages) is None)
    assert not unmapped, f"modules in no package of the map: {unmapped}"
    graph = {p: set() for p in packages}
    for module, targets in modules.items():
        source = package_of(module, packages)
        graph[source] |= {package_of(t, packages) for t in targets} - {source}
    return graph


def test_line_budgets():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    assert len((ROOT / "docs" / "design.md").read_text().splitlines()) <= 800  # one short section per package


def test_the_checks_find_what_they_look_for():
    long = "word " * 50
    assert repeated({"a": f"x\n\n{long}\n", "b": f"{long.replace(' ', chr(10))}\n\ny"}) == {long.strip(): ["a", "b"]}
    assert repeated({"a": "short\n\nshort\n"}) == {}
    hits = ["the sess" + "ion 4 figures", "see iss" + "ue 13", "Issues #" + "9, 10", "closes #" + "10"]
    assert all(tracker_references(h) for h in hits)
    assert not tracker_references("pytorch/pytorch#60733, #wrong, sessions of a sweep, issue a send")
    table = ("| package | depends on | what it holds and why |\n| --- | --- | --- |\n"
             "| `commlab.a` | `commlab.b`, `commlab` | ... |\n| `commlab.b` | — | ... |\n| `commlab` | — | |\n")
    assert package_map("# x\n\n" + table + "\nprose") == {
        "commlab.a": {"commlab.b", "commlab"}, "commlab.b": set(), "commlab": set()}
    modules = {"commlab.a.x": {"commlab.a.y", "commlab.b.z"}, "commlab.a.y": set(), "commlab.b.z": {"commlab.m"},
               "commlab.m": set()}
    assert package_graph(modules, ["commlab.a", "commlab.b", "commlab"]) == {
        "commlab.a": {"commlab.b"}, "commlab.b": {"commlab"}, "commlab": set()}


def test_no_long_paragraph_is_repeated():
    docs = {str(path.relative_to(ROOT)): path.read_text() for path in DOCS if path.exists()}
    assert "README.md" in docs and "docs/design.md" in docs
    dups = repeated(docs)
    assert not dups, "\n\n".join(f"{where}: {para[:160]}..." for para, where in dups.items())


def _tracked_text_files():
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        if name.startswith("results/"):  # measured data and figures, not prose
            continue
        data = (ROOT / name).read_bytes() if (ROOT / name).is_file() else b"\0"
        if b"\0" in data:
            continue  # binary
        try:
            yield name, data.decode()
        except UnicodeDecodeError:
            continue


def test_no_development_round_or_tracker_reference_in_tracked_files():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no tracked files to read")
    found = [f"{name}:{n}: {line[:120]}" for name, text in _tracked_text_files()
             for n, line in tracker_references(text)]
    assert not found, "say the version, date or commit instead:\n" + "\n".join(found)


def test_the_package_map_matches_the_imports():
    documented = package_map((ROOT / "docs" / "design.md").read_text())
    real = package_graph(import_graph(), list(documented))
    wrong = {p: {"documented": sorted(documented[p]), "imports": sorted(real[p])}
             for p in documented if documented[p] != real[p]}
    assert not wrong, f"docs/design.md's package map differs from the imports: {wrong}"


def test_the_version_is_one():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == commlab.__version__


def file_maps(design: str) -> dict[str, set[str]]:
    """Each ``## `commlab.x`: ...`` (or ``###``) section's package -> the files its ``Files:`` paragraph names."""
    maps = {}
    for match in re.finditer(r"^#{2,3} `(commlab(?:\.\w+)*)`:.*?\n\nFiles: (.*?)\n\n", design, re.M | re.S):
        maps[match.group(1)] = set(re.findall(r"`([\w.]+\.py)`", match.group(2)))
    return maps


def test_the_checks_read_file_maps():
    text = "## `commlab.a`: the a\n\nFiles: `x.py` one; `y.py`\ntwo.\n\nProse `z.py`.\n\n### `commlab.a.b`: b\n\nFiles: `w.py` w.\n\n"
    assert file_maps(text) == {"commlab.a": {"x.py", "y.py"}, "commlab.a.b": {"w.py"}}


def test_every_package_has_a_section_whose_file_map_is_its_folder():
    maps = file_maps((ROOT / "docs" / "design.md").read_text())
    folders = {".".join(p.relative_to(ROOT).parts): {f.name for f in p.glob("*.py")}
               for p in sorted((ROOT / "commlab").rglob("*")) if p.is_dir() and any(p.glob("*.py"))}
    folders["commlab"] = {f.name for f in (ROOT / "commlab").glob("*.py")}
    missing = sorted(set(folders) - set(maps))
    wrong = {pkg: {"unlisted": sorted(folders[pkg] - maps[pkg]), "gone": sorted(maps[pkg] - folders[pkg])}
             for pkg in folders if pkg in maps and maps[pkg] != folders[pkg]}
    assert not missing, f"packages without a section and file map in docs/design.md: {missing}"
    assert not wrong, f"file maps that differ from their folders: {wrong}"
