"""Every option of every command says what it does, in plain text, and the help, the figures
and the README name bucket sizes with one unit word and --resume as the CLI takes it."""

import re
from pathlib import Path

import click
from click.testing import CliRunner

from commlab.cli import main
from commlab.models import model_names

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def commands():
    """(path, command) of the group and every command under it, the lazily loaded ones too."""
    def walk(cmd, ctx, path):
        yield path, cmd
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                yield from walk(sub, click.Context(sub, parent=ctx, info_name=name), [*path, name])

    return list(walk(main, click.Context(main, info_name="commlab"), ["commlab"]))


def test_every_option_has_help_and_no_help_holds_rst_markup():
    missing, markup = [], []
    for path, cmd in commands():
        for p in cmd.get_params(click.Context(cmd)):
            if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip():
                missing.append(f"{' '.join(path)} {'/'.join(p.opts)}")
            if isinstance(p, click.Option) and "``" in (p.help or ""):
                markup.append(f"{' '.join(path)} {'/'.join(p.opts)}")
        if "``" in (cmd.help or "") or "``" in CliRunner().invoke(main, [*path[1:], "--help"]).output:
            markup.append(" ".join(path))
    assert len(commands()) > 15  # the walk reached the lazy groups' commands
    assert missing == [] and markup == [], (missing, markup)


def test_model_help_names_every_builtin_model():
    for path, cmd in commands():
        for p in cmd.get_params(click.Context(cmd)):
            if "--model" in getattr(p, "opts", ()) and "package.module:factory" in (p.help or "") and path[-1] != "plan":
                absent = [m for m in model_names() if m not in p.help]
                assert absent == [], (path, absent)


def test_bucket_sizes_are_mib_everywhere():
    """torch's bucket_cap_mb is MiB (bucket_cap_mb * 1024 * 1024) though named MB: commlab says MiB."""
    for path, cmd in commands():
        for p in cmd.get_params(click.Context(cmd)):
            help_text = getattr(p, "help", None) or ""
            if any("bucket" in o for o in getattr(p, "opts", ())):
                assert "MiB" in help_text and not re.search(r"\bMB\b", help_text), (path, p.opts, help_text)
    assert not re.search(r"\d MB\b|\bMB\)", README), re.findall(r".{30}\bMB\b.{10}", README)


def test_readme_uses_resume_as_a_flag():
    assert "--resume NAME" not in README and "--resume --name NAME" in README
    resume = next(p for p in commands()[0][1].get_command(click.Context(main), "sweep").params if p.name == "resume")
    assert resume.is_flag
