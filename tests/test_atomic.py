"""Atomic writes: the whole file or none, and the permissions the user's umask asks for."""

import os
import stat

import pytest

from commlab._atomic import write_text, write_via


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_files_respect_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        write_text(tmp_path / "a.csv", "x\n")
        write_via(tmp_path / "b.bin", lambda p: open(p, "wb").write(b"\0"))
    finally:
        os.umask(old)
    for name in ("a.csv", "b.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    write_text(tmp_path / "r.json", "old")

    def boom(path):
        open(path, "w").write("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_via(tmp_path / "r.json", boom)
    assert (tmp_path / "r.json").read_text() == "old" and os.listdir(tmp_path) == ["r.json"]
