"""tools.fileio.write_atomic: whole files only, modes as a user expects, no temp files left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.fileio import write_atomic


def test_new_file_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.json", "{}\n")
        os.umask(0o077)
        write_atomic(tmp_path / "b.json", b"{}\n")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0o600
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "a.json").read_text() == "{}\n"


def test_existing_mode_kept_and_explicit_mode_wins(tmp_path: Path) -> None:
    target = tmp_path / "f.py"
    target.write_text("old\n")
    target.chmod(0o640)
    write_atomic(target, "new\n")
    assert (target.read_text(), target.stat().st_mode & 0o777) == ("new\n", 0o640)
    write_atomic(target, "newer\n", mode=0o600)
    assert target.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["f.py"]  # no temp file left


def test_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    target.write_text("old\n")
    with pytest.raises(TypeError):
        write_atomic(target, 12345)  # type: ignore[arg-type]
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_root_keeps_the_owner(tmp_path: Path) -> None:
    target = tmp_path / "site.py"
    target.write_text("old\n")
    os.chown(target, 1234, 2345)
    write_atomic(target, "new\n")
    st = target.stat()
    assert (st.st_uid, st.st_gid, target.read_text()) == (1234, 2345, "new\n")
