"""Small shared helpers: atomic file writes (nothing lmstack writes is ever left half-written)."""

from __future__ import annotations

import contextlib
import numbers
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it over ``path``.

    A crash or exception before the rename leaves any previous file at ``path`` untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        # mkstemp makes the file 0600; give it the mode an ordinary new file would get
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


# ---- strict field checks for configs read from JSON/TOML (model and train configs share them) ----
def check_bool(name: str, value: object, error: type[Exception] = ValueError) -> bool:
    """``value`` if it is a real boolean; the strings "false"/"no" and the numbers 0/1 are refused,
    since ``bool("false")`` is True."""
    if not isinstance(value, bool):
        raise error(f"{name}={value!r} must be true or false (a boolean, not {type(value).__name__})")
    return value


def check_int(name: str, value: object, error: type[Exception] = ValueError, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """``value`` as an int: an int (not a bool) or a float with an integral value (JSON's ``64.0``);
    ``64.9``, strings and ``None`` are refused rather than truncated or parsed."""
    expected = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy integers are Integral
        raise error(f"{name}={value!r} must be {expected} (got {type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise error(f"{name}={value!r} must be {expected}")
    if maximum is not None and value > maximum:
        raise error(f"{name}={value!r} is too large; expected at most {maximum}")
    return value


def check_float(name: str, value: object, error: type[Exception] = ValueError) -> float:
    """``value`` as a finite float: an int or float (not a bool, not a string, not NaN/inf)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name}={value!r} must be a number (got {type(value).__name__})")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise error(f"{name}={value!r} must be a finite number")
    return value
