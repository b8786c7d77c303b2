"""Ctrl-C (or SIGTERM) in a measuring command: keep what was measured, say where, exit 130.

Every command that measures for a while behaves the same when stopped:

    rows = []
    with keep_partial(lambda: save(rows)):     # save writes atomically, returns where, or None
        for size in sizes:
            rows.append(measure(size))

On Ctrl-C inside the block, ``save()`` runs (it writes the rows measured so far through
:mod:`commlab._atomic` and returns where they are, or None when there is nothing yet), one line
goes to stderr, ``interrupted: partial results in WHERE``, and the command exits 130 (128 +
SIGINT, the shell's convention; 143 for SIGTERM, which inside the block unwinds like Ctrl-C so
that launched ranks and temporary directories are cleaned up on the way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import click

from commlab.runtime.orphans import sigterm_as_interrupt


@contextlib.contextmanager
def keep_partial(save: Callable[[], str | None], resume: str = "") -> Iterator[None]:
    """Run the block; on Ctrl-C or SIGTERM call ``save()``, print where, exit 130 (143).

    ``save`` returns where the partial results are (a path, or a phrase such as "the table
    above"), or None when nothing was measured yet. ``resume``, if given, is added to the line
    (e.g. "rerun with --resume to continue").
    """
    try:
        with sigterm_as_interrupt():
            yield
    except KeyboardInterrupt as stop:
        where = save()
        line = f"partial results in {where}" if where else "nothing measured yet"
        click.echo(f"interrupted: {line}" + (f"; {resume}" if resume else ""), err=True)
        raise click.exceptions.Exit(getattr(stop, "exit_code", 130)) from None
