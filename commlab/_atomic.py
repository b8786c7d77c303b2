"""Atomic file writes: a reader (or a killed run) sees the old file or the new one, never a part.

Every result file commlab writes (sweep records and CSVs, benchmark tables, figures) goes through
here: the data is written to a temporary file in the same directory, flushed to disk, then
``os.replace``-d over the target, which POSIX makes atomic within one file system. The file gets
the permissions an ordinary ``open`` would give it under the user's umask (mkstemp's are 0600).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_via(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` to produce the file, then move it over ``path`` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        write(tmp)
        with open(tmp, "rb+") as f:  # make the bytes durable before the rename publishes them
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    write_via(path, lambda tmp: Path(tmp).write_text(text))


def _umask() -> int:
    """The process's umask (reading it means setting it; set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
