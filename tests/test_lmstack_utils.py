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


def test_torch_dtype_maps_short_names_and_names_the_choices():
    import pytest
    import torch

    from lmstack.utils import dtype_name, torch_dtype

    # torch's own dtype objects, not the table's output, are the reference
    assert torch_dtype("bf16") is torch.bfloat16
    assert torch_dtype("fp16", allowed=("bf16", "fp16")) is torch.float16
    assert torch_dtype("fp64") is torch.float64
    assert dtype_name(torch.float32) == "fp32" and dtype_name(torch.int8) is None
    with pytest.raises(ValueError, match=r"dtype='fp64'; expected one of \['bf16', 'fp32'\]"):
        torch_dtype("fp64", allowed=("fp32", "bf16"))
    with pytest.raises(ValueError, match=r"param_dtype='int4'; expected one of"):
        torch_dtype("int4", what="param_dtype")


def test_numeric_flag_converters_share_one_rule_set():
    import argparse

    import pytest

    from lmstack.utils import nonneg_float, nonneg_int, positive_float, positive_int

    assert (nonneg_int("0"), positive_int("3"), nonneg_float("0"), positive_float("2.5")) == (
        0,
        3,
        0.0,
        2.5,
    )
    for convert, text, message in [
        (nonneg_int, "-1", "-1: expected an integer >= 0"),
        (positive_int, "0", "0: expected an integer >= 1"),
        (positive_int, "1.5", "'1.5' is not an integer"),
        (positive_float, "0", "0.0: expected a number > 0"),
        (nonneg_float, "-0.5", "-0.5: expected a number >= 0"),
        (positive_float, "inf", "inf: expected a finite number"),
        (nonneg_float, "x", "'x' is not a number"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            convert(text)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's builder waits forever on build_dir/lock; one left by a killed build (old mtime) goes."""
    import os
    import time

    from lmstack.utils import STALE_LOCK_S, clear_stale_build_lock

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not clear_stale_build_lock(tmp_path) and lock.exists()  # a build may be running
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert clear_stale_build_lock(tmp_path) and not lock.exists()
    assert not clear_stale_build_lock(tmp_path)  # nothing to remove
