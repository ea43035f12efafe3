"""Evaluation sets built offline from real text on this machine (no downloads), with their provenance.

- ``stdlib_heldout_text``: a perplexity set held out from the demo's default corpus. ``lmstack demo``
  trains on the running Python's standard-library ``.py`` files in a fixed order (top-level modules, then
  packages, test suites skipped) up to ``--corpus-mb`` (6 MB); this takes the files *after* that cut,
  so neither the demo's tokenizer nor its model saw them (the file order is restated here, because
  library code may not import the demo).
- ``stdlib_docstring_mc``: multiple-choice items from the docstrings of public functions in a fixed list
  of standard-library modules: "which function does this docstring describe?", the right
  ``module.name`` among three others of the same module, the options shuffled with a seeded RNG
  (``sys`` and ``warnings`` are left out: a running process, pytest for one, replaces some of their functions).

``lmstack eval make-data OUT`` writes both with a ``provenance.json`` (Python version, modules, byte
budgets, seed); ``data/eval/`` in the repository holds one such output.
"""

from __future__ import annotations

import importlib
import inspect
import json
import platform
import random
from pathlib import Path

from lmstack.utils import atomic_write_text, stdlib_root, stdlib_sources

SEP = "<|endoftext|>"
DEMO_CORPUS_BYTES = 6_000_000  # lmstack demo --corpus-mb default
MC_MODULES = (
    "os.path",
    "string",
    "json",
    "textwrap",
    "itertools",
    "functools",
    "collections",
    "math",
    "statistics",
    "random",
    "re",
    "shutil",
    "heapq",
    "bisect",
    "fnmatch",
    "glob",
    "difflib",
    "csv",
    "base64",
    "calendar",
    "operator",
    "pprint",
    "secrets",
    "struct",
    "zlib",
    "binascii",
    "copy",
    "html",
    "keyword",
    "locale",
    "tempfile",
    "urllib.parse",
    "inspect",
    "gzip",
    "hashlib",
    "time",
    "platform",
    "colorsys",
    "quopri",
    "shlex",
    "unicodedata",
    "zipfile",
    "tarfile",
    "socket",
    "subprocess",
    "ast",
    "dis",
    "codecs",
    "io",
    "posixpath",
    "datetime",
    "wave",
    "uuid",
    "mimetypes",
    "ntpath",
    "email.utils",
    "xml.sax.saxutils",
    "http.cookies",
    "traceback",
)


def stdlib_heldout_text(
    max_bytes: int = 48_000, skip_bytes: int = DEMO_CORPUS_BYTES
) -> tuple[str, list[str]]:
    """(text, source files): whole files after the first ``skip_bytes`` of the demo's corpus (counted as the
    demo counts them), in order, joined by ``<|endoftext|>``, up to ``max_bytes`` (a file that does not fit
    in what is left is skipped)."""
    seen = 0
    parts, names, size = [], [], 0
    root = stdlib_root()
    for f in stdlib_sources():  # the demo's corpus order
        try:
            text = f.read_text(encoding="utf-8").replace(SEP, "")
        except (UnicodeDecodeError, OSError):
            continue
        if seen < skip_bytes:
            seen += len(text.encode("utf-8")) + len(SEP)
            continue
        n = len(text.encode("utf-8"))
        if size + n > max_bytes:  # a file too big for what is left is skipped, the next may fit
            if size > 0.9 * max_bytes:
                break
            continue
        parts.append(text)
        names.append(str(f.relative_to(root)))
        size += n + len(SEP)
    if not parts:
        raise ValueError(
            f"no stdlib files after the first {skip_bytes} bytes fit in {max_bytes} bytes"
        )
    return SEP.join(parts), names


def _first_sentence(doc: str) -> str | None:
    lines = []
    for line in inspect.cleandoc(doc).splitlines():
        if not line.strip():
            break
        lines.append(line.strip())
    s = " ".join(lines)
    if "." in s:
        s = s[: s.index(".") + 1]
    if (
        len(s) < 20 or len(s) > 200 or "(" in s[: s.find(" ") + 1 or None]
    ):  # skip "f(x, y) -> z" signatures
        return None
    return s


def stdlib_docstring_mc(seed: int = 0, n_choices: int = 4, modules=MC_MODULES) -> list[dict]:
    """Items ``{"docstring", "choices", "answer", "module", "name"}``, sorted by module then name."""
    rng = random.Random(seed)
    items, seen_docs = [], set()
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        funcs = {}
        for name in sorted(dir(mod)):
            obj = getattr(mod, name)
            if name.startswith("_") or not callable(obj) or inspect.isclass(obj):
                continue
            if getattr(obj, "__module__", mod_name) not in (
                mod_name,
                None,
            ) and not mod_name.startswith("os.path"):
                continue
            doc = getattr(obj, "__doc__", None)
            s = _first_sentence(doc) if isinstance(doc, str) else None
            if s and s not in seen_docs and name.lower() not in s.lower():
                funcs[name] = s
                seen_docs.add(s)
        names = sorted(funcs)
        if len(names) < n_choices:
            continue
        for name in names:
            others = rng.sample([n for n in names if n != name], n_choices - 1)
            choices = others + [name]
            rng.shuffle(choices)
            items.append(
                {
                    "docstring": funcs[name],
                    "choices": [f"{mod_name}.{c}" for c in choices],
                    "answer": choices.index(name),
                    "module": mod_name,
                    "name": name,
                }
            )
    return items


MC_SPEC = """# Which standard-library function does a docstring describe? Generated by `lmstack eval make-data`
# (lmstack.eval.datasets.stdlib_docstring_mc); provenance.json says from which Python.
name: stdlib_docstring_mc
kind: multiple_choice
data: stdlib_docstring_mc.jsonl
prompt: "Python standard library.\\nDocstring: {docstring}\\nThe function is"
"""


def make_data(out, seed: int = 0, heldout_bytes: int = 48_000) -> dict:
    """Write the held-out text, the MC items + task spec and provenance.json into ``out``."""
    out = Path(out)
    text, files = stdlib_heldout_text(heldout_bytes)
    items = stdlib_docstring_mc(seed)
    atomic_write_text(out / "stdlib_heldout.txt", text)
    atomic_write_text(
        out / "stdlib_docstring_mc.jsonl", "".join(json.dumps(it) + "\n" for it in items)
    )
    atomic_write_text(out / "stdlib_docstring_mc.yaml", MC_SPEC)
    prov = {
        "generator": "lmstack eval make-data (lmstack.eval.datasets)",
        "python": platform.python_version(),
        "stdlib": str(stdlib_root()),
        "seed": seed,
        "stdlib_heldout.txt": {
            "what": "whole stdlib .py files after the demo corpus's first "
            f"{DEMO_CORPUS_BYTES} bytes, joined by {SEP}",
            "bytes": len(text.encode()),
            "files": files,
        },
        "stdlib_docstring_mc.jsonl": {
            "what": "first sentence of each public function's docstring; the right "
            "module.name among 3 others of its module",
            "items": len(items),
            "modules": sorted({it["module"] for it in items}),
        },
    }
    atomic_write_text(out / "provenance.json", json.dumps(prov, indent=1) + "\n")
    return prov
