"""Atomic writes: a failed write leaves the old file; a new file gets the ordinary umask mode."""

import os

import pytest

from lmstack.utils import atomic_path, atomic_write_text


def test_failed_write_keeps_previous_file(tmp_path):
    f = tmp_path / "x.txt"
    atomic_write_text(f, "good")
    with pytest.raises(RuntimeError):
        with atomic_path(f) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert f.read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]  # no temp file left behind


def test_new_file_mode_follows_umask(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "y.txt", "data")
    finally:
        os.umask(umask)
    assert (tmp_path / "y.txt").stat().st_mode & 0o777 == 0o644
