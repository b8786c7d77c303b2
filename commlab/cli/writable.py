"""Where a command will write: checked before it measures or calibrates anything."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click


def check_writable(target: Path | str, option: str = "--out") -> None:
    """click.UsageError unless files can be created at ``target`` (a directory, made if missing).

    The directory that would hold the new files is the nearest one that exists; a file there
    instead of a directory, or a failed write, is refused now, not as a traceback after minutes
    of work. A real file is created and removed: ``os.access`` answers yes to root on a
    directory without write permission and knows nothing of read-only mounts.
    """
    target = Path(target)
    nearest = target
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise click.UsageError(f"{option} {target}: {nearest} is a file, so no directory can be made under it; "
                               f"give {option} a directory")
    try:
        with tempfile.TemporaryFile(dir=nearest, prefix=".commlab-probe-"):
            pass
    except OSError as err:
        raise click.UsageError(f"{option} {target}: cannot write in {nearest} ({err.strerror}); give {option} a "
                               "directory you can write to") from None
