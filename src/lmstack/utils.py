"""Small shared helpers: atomic file writes (nothing lmstack writes is ever left half-written), the
one guard every writing command calls so that an output never overwrites an input, and the one way to
build a C++ extension on first use."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import numbers
import os
import re
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
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


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed); imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | os.PathLike, **savefig_kw) -> Path:
    """Write ``fig`` to ``path`` as a PNG atomically and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", **savefig_kw)
    plt.close(fig)
    return path


# ---- native extensions built on first use ---------------------------------------------------------


_QUOTED_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def source_text_with_headers(source: Path) -> bytes:
    """The bytes of ``source`` followed by those of every header it includes with quotes (``#include "x.h"``,
    looked up beside the file including it, recursively, each once): what a build's hash must cover, so that a
    change in a shared header rebuilds every source that includes it."""
    seen, out, todo = set(), [], [source]
    while todo:
        path = todo.pop(0).resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        data = path.read_bytes()
        out.append(data)
        todo += [path.parent / m.decode() for m in _QUOTED_INCLUDE.findall(data)]
    return b"".join(out)


STALE_LOCK_S = (
    900  # a build takes 1-5 minutes here; a lock older than this was left by a killed build
)


def clear_stale_build_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir/lock`` when it is older than ``max_age_s``: torch's extension builder waits for
    that file forever, and a build killed midway leaves it behind (every later load would hang). True when
    a lock was removed."""
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    logging.getLogger("lmstack").warning(
        "removed a stale build lock %s (%.0f s old: a build was killed midway)", lock, age
    )
    return True


def cxx_compiler() -> str | None:
    """The C++ compiler torch's extension builder and inductor would use: ``$CXX`` if set and on the PATH,
    else the first of c++ / g++ / clang++ found; None without one."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)


def build_extension(
    name: str,
    source: Path,
    cflags: Iterable[str] = (),
    ldflags: Iterable[str] = (),
    python_module: bool = False,
):
    """Compile one C++ ``source`` on first use with ``torch.utils.cpp_extension.load`` (ninja) and load it:
    ``(module, None)``, or ``(None, reason)`` when it cannot be built (no compiler, missing source, a compile
    error), so the caller falls back to its Python or torch path and can say why.

    The build folder is named by a digest of the source (with the headers it includes in quotes, `source_text_with_headers`), the flags and the Python ABI: two checkouts (or an
    upgrade) never load each other's build. ``python_module=True``: a plain CPython extension (its init
    function ``PyInit_<TORCH_EXTENSION_NAME>``) linked ``--as-needed``, so it depends on no torch library and
    a process that finds it already built loads it directly, without importing torch. Otherwise the library
    registers torch ops when loaded (``torch.ops.*``) and ``module`` is None on success.
    """
    cflags, ldflags = list(cflags), list(ldflags)
    if not source.is_file():
        return None, f"{source} is missing"
    if python_module:
        ldflags = [
            "-Wl,--as-needed",
            *ldflags,
        ]  # before the torch libraries load() appends: none is kept
    tag = " ".join(cflags + ldflags) + str(sysconfig.get_config_var("EXT_SUFFIX"))
    text = source_text_with_headers(source)
    full = f"{name}_{hashlib.sha256(text + tag.encode()).hexdigest()[:12]}"
    try:
        kw = {}
        if python_module:
            root = (
                os.environ.get("TORCH_EXTENSIONS_DIR")
                or Path.home() / ".cache" / "torch_extensions"
            )
            build = Path(root) / "lmstack" / full
            so = build / f"{full}.so"
            if (
                so.is_file() and not (build / "lock").exists()
            ):  # built before (and not being rebuilt now)
                spec = importlib.util.spec_from_file_location(full, so)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module, None
            kw["build_directory"] = str(build)
        if cxx_compiler() is None:
            return None, f"no C++ compiler ({os.environ.get('CXX', 'c++, g++ or clang++')}) on PATH"
        if python_module:
            Path(kw["build_directory"]).mkdir(parents=True, exist_ok=True)
        from torch.utils.cpp_extension import _get_build_directory, load

        clear_stale_build_lock(Path(kw.get("build_directory") or _get_build_directory(full, False)))

        module = load(
            name=full,
            sources=[str(source)],
            is_python_module=python_module,
            verbose=False,
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            **kw,
        )
    except Exception as e:  # noqa: BLE001 — any build or load failure means: the caller's fallback
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return None, f"building {source.name} failed: {type(e).__name__}: {first}"
    return (module if python_module else None), None


# ---- outputs never overwrite inputs -------------------------------------------------------------


class OutputError(ValueError):
    """An output path that would overwrite one of the command's inputs, or a file of another kind."""


def _same(a: Path, b: Path) -> bool:
    """True when ``a`` and ``b`` are the same file: same st_dev/st_ino when both exist (symlinks
    followed, hard links), else the same resolved path (an input the command would create)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _inside(path: Path, folder: Path) -> bool:
    """True when ``path`` (resolved) lies inside the directory ``folder`` (resolved)."""
    try:
        path.resolve().relative_to(folder.resolve())
    except (ValueError, OSError):
        return False
    return True


Labeled = Iterable[tuple[str, "str | os.PathLike | None"]]


def check_outputs(
    outputs: Labeled,
    inputs: Labeled,
    kinds: dict[str, tuple[str, Callable[[Path], bool]]] | None = None,
    force: bool = False,
) -> None:
    """Refuse to write an output that is, or resolves to, one of the inputs; call before writing anything.

    ``outputs`` and ``inputs`` are (label, path) pairs, the label saying what the path is
    (``"--out"``, ``"the input"``, ``"train_data"``); None paths are skipped. Commands that take
    directories pass the files they expand to (the files they will read). An output directory
    (one the command writes into or replaces) may not contain any input. ``kinds`` maps an
    output label to (description, predicate): an existing output the predicate does not
    recognise as the command's own kind of file is refused unless ``force``. Raises OutputError
    (a ValueError: the CLI exits 2) naming both paths.
    """
    outs = [(k, Path(v)) for k, v in outputs if v is not None]
    ins = [(k, Path(v)) for k, v in inputs if v is not None]
    for olabel, out in outs:
        for ilabel, src in ins:
            if _same(out, src):
                how = "is" if os.path.abspath(out) == os.path.abspath(src) else "resolves to"
                raise OutputError(
                    f"{olabel} {str(out)!r} {how} {ilabel} {str(src)!r}; refusing to overwrite an "
                    "input (choose another output path)"
                )
            if out.is_dir() and src.exists() and _inside(src, out):
                raise OutputError(
                    f"{ilabel} {str(src)!r} lies inside {olabel} {str(out)!r}, which this command "
                    "writes into; move the input or choose another output"
                )
        if kinds and olabel in kinds and out.exists() and not force:
            what, is_kind = kinds[olabel]
            if not is_kind(out):
                raise OutputError(
                    f"{olabel} {str(out)!r} exists and is not {what}; refusing to replace it "
                    "(choose another path, or pass --force to replace it)"
                )


# ---- the default corpus: Python's own standard library, on every machine, nothing downloaded ----
STDLIB_SKIP = ("test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__")


def stdlib_root() -> Path:
    """The folder of this Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list[Path]:
    """The stdlib ``.py`` files in the demo's corpus order: the top-level modules sorted, then the
    packages' files sorted, skipping test suites (``STDLIB_SKIP``). The demo trains on the first
    ones, ``lmstack.eval.datasets`` holds out the ones after."""
    root = stdlib_root()
    top = sorted(root.glob("*.py"))
    pkgs = sorted(
        f
        for f in root.rglob("*.py")
        if f.parent != root and not any(part in STDLIB_SKIP for part in f.relative_to(root).parts)
    )
    return top + pkgs


# ---- optional extras: a feature whose dependencies are not installed names the extra to install ----
class MissingExtraError(ModuleNotFoundError):
    """A feature's optional dependency is not installed; the message names the extra."""


def import_extra(module: str, extra: str, feature: str):
    """``importlib.import_module(module)``, or a ``ModuleNotFoundError`` that says which extra of
    pyproject's ``[project.optional-dependencies]`` brings it (``pip install 'lmstack[serve]'``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise MissingExtraError(
            f"{feature} needs the {module!r} package ({e}); install it with: "
            f"pip install 'lmstack[{extra}]'",
            name=module,
        ) from e


# ---- dtype names: the one table of the short names flags and configs use ----------------------
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
FLOAT_DTYPES = (
    "fp32",
    "bf16",
    "fp16",
)  # what models load and train in (fp64 only for kernel checks)


def torch_dtype(name: str, allowed: Iterable[str] | None = None, what: str = "dtype"):
    """The ``torch.dtype`` for a short name ("fp32", "bf16", "fp16", "fp64"), refused with the value
    and the choices unless it is in ``allowed`` (default: every name of ``DTYPE_NAMES``). torch is
    imported here, so that this module stays light."""
    choices = tuple(DTYPE_NAMES if allowed is None else allowed)
    if name not in choices or name not in DTYPE_NAMES:
        raise ValueError(f"{what}={name!r}; expected one of {sorted(choices)}")
    import torch

    return getattr(torch, DTYPE_NAMES[name])


def dtype_name(dtype) -> str | None:
    """The short name of a ``torch.dtype`` (``torch.bfloat16`` -> "bf16"); None for any other dtype."""
    return next((k for k, v in DTYPE_NAMES.items() if str(dtype) == f"torch.{v}"), None)


# ---- argparse ``type=`` converters: the one rule set of every command's numeric flags ----------
# An integer flag is an int; a float flag a finite number (nan and inf refused); counts and sizes are
# > 0 (``positive_*``) or >= 0 (``nonneg_*``, where 0 means off). argparse names the flag in the
# error: exit 2, no traceback.
def _integer(text: str, minimum: int | None) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if minimum is not None and v < minimum:
        raise argparse.ArgumentTypeError(f"{v}: expected an integer >= {minimum}")
    return v


def _number(text: str, low: float | None, strict: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text}: expected a finite number")
    if low is not None and (v <= low if strict else v < low):
        raise argparse.ArgumentTypeError(
            f"{v}: expected a number {'>' if strict else '>='} {low:g}"
        )
    return v


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    return _integer(text, 1)


def nonneg_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0 (0: off)."""
    return _integer(text, 0)


def finite_float(text: str) -> float:
    """argparse ``type=``: a finite number (nan and inf refused)."""
    return _number(text, None, strict=False)


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number > 0 (a size, a time budget)."""
    return _number(text, 0.0, strict=True)


def nonneg_float(text: str) -> float:
    """argparse ``type=``: a finite number >= 0 (0: off)."""
    return _number(text, 0.0, strict=False)


def unit_interval(text: str) -> float:
    """argparse ``type=``: a level strictly between 0 and 1 (an interval's coverage)."""
    v = finite_float(text)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{v}: expected a level in (0, 1), e.g. 0.9")
    return v


def own_folder(path: str | os.PathLike, *markers: str) -> bool:
    """True when a command may write into folder ``path`` without ``--force``: it does not exist, is empty, or
    holds one of ``markers`` (a file only that command writes, so the folder is an earlier run of its own).
    A folder holding anything else — another model, another run — is not the command's to overwrite."""
    p = Path(path)
    if not p.exists():
        return True
    if not p.is_dir():
        return False
    return not any(p.iterdir()) or any((p / m).exists() for m in markers)


def own_folder_kind(command: str, *markers: str) -> tuple[str, Callable[[Path], bool]]:
    """A ``check_outputs`` ``kinds`` entry for an output folder of ``lmstack {command}``: refused unless
    ``own_folder(path, *markers)`` (absent, empty, or an earlier output of the same command) or ``--force``."""
    mark = markers[0] + (" or its run folders" if len(markers) > 1 else "")
    return (
        f"an empty folder or an earlier `lmstack {command}` output (one with {mark})",
        lambda p: own_folder(p, *markers),
    )


def read_jsonl(
    path: str | os.PathLike, error: type[Exception] = ValueError
) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file; a line that is not a JSON object
    raises ``error`` naming ``path:line`` (tasks, battles, sweep runs all read through here)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(
                    f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}): {line.strip()[:80]!r}"
                ) from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            yield n, obj


def is_json_file(path: Path) -> bool:
    """A regular file holding a JSON object (what lmstack's own JSON outputs are)."""
    if not path.is_file():
        return False
    try:
        return isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
    except (OSError, UnicodeDecodeError, ValueError):
        return False


def file_starts_with(path: Path, prefix: bytes) -> bool:
    """A readable file whose first bytes are ``prefix`` (a format's signature)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(prefix)) == prefix
    except OSError:
        return False


def is_png_file(path: Path) -> bool:
    """A file starting with the PNG signature."""
    return file_starts_with(path, b"\x89PNG\r\n\x1a\n")


# ---- strict field checks for configs read from JSON/TOML (model and train configs share them) ----
def check_bool(name: str, value: object, error: type[Exception] = ValueError) -> bool:
    """``value`` if it is a real boolean; the strings "false"/"no" and the numbers 0/1 are refused,
    since ``bool("false")`` is True."""
    if not isinstance(value, bool):
        raise error(
            f"{name}={value!r} must be true or false (a boolean, not {type(value).__name__})"
        )
    return value


def check_int(
    name: str,
    value: object,
    error: type[Exception] = ValueError,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    """``value`` as an int: an int (not a bool) or a float with an integral value (JSON's ``64.0``);
    ``64.9``, strings and ``None`` are refused rather than truncated or parsed."""
    expected = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}"
    )
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(
        value, numbers.Integral
    ):  # numpy integers are Integral
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
