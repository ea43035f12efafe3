"""The seam's import rule: ``model/`` imports nothing from ``kernels/``, and ``kernels/`` nothing from
``model/`` but the interface module ``lmstack.model.seam`` (docs/architecture.md, "Seams").
``kernels/cli.py`` is exempt: a CLI module wires the layers together (it builds the model it benchmarks)."""

import ast
import sys
from pathlib import Path

import lmstack

SRC = Path(lmstack.__file__).parent
INTERFACE = "lmstack.model.seam"


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` / ``from ... import`` in the file names, in-function imports included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(
                f"{node.module}.{a.name}" for a in node.names
            )  # from lmstack import kernels
    return names


def violations(
    package: str, forbidden: str, allowed: tuple[str, ...] = (), exempt: tuple[str, ...] = ()
) -> list[str]:
    bad = []
    for path in sorted((SRC / package).rglob("*.py")):
        if path.name in exempt:
            continue
        for name in sorted(imported_modules(path)):
            if (name == forbidden or name.startswith(forbidden + ".")) and not name.startswith(
                allowed or ("\0",)
            ):
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    return bad


def test_model_does_not_import_kernels():
    assert violations("model", "lmstack.kernels") == []


def test_kernels_import_only_the_seam_from_model():
    assert violations("kernels", "lmstack.model", allowed=(INTERFACE,), exempt=("cli.py",)) == []


def test_the_scan_catches_a_forbidden_import(tmp_path, monkeypatch):
    pkg = tmp_path / "model"
    pkg.mkdir()
    (pkg / "bad.py").write_text("def f():\n    from lmstack.kernels.backends import ATTENTION\n")
    (pkg / "ok.py").write_text("from lmstack.model.seam import AttentionMetadata\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert violations("model", "lmstack.kernels") == [
        "model/bad.py imports lmstack.kernels.backends",
        "model/bad.py imports lmstack.kernels.backends.ATTENTION",
    ]
    assert violations("model", "lmstack.model", allowed=(INTERFACE,)) == []
