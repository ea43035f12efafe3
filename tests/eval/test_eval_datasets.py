"""The shipped evaluation sets: the held-out text is outside the demo's corpus (checked with the demo's own
corpus code), every docstring item's answer is the function whose docstring it quotes, the files load."""

import importlib
import inspect
import json
import sysconfig
from pathlib import Path

import pytest

from lmstack.eval.datasets import stdlib_docstring_mc, stdlib_heldout_text
from lmstack.eval.tasks import load_task

REPO_DATA = Path(__file__).resolve().parents[2] / "data" / "eval"


def test_heldout_is_outside_the_demo_corpus(tmp_path):
    from lmstack.demo import SEP, collect_corpus

    corpus = tmp_path / "corpus.txt"
    n_files, _ = collect_corpus([], "*.py", 6.0, corpus)
    text, files = stdlib_heldout_text(20_000)
    root = Path(sysconfig.get_paths()["stdlib"])
    trained = corpus.read_text(encoding="utf-8").split(SEP)
    for name in files:
        assert (root / name).read_text(encoding="utf-8") not in trained
    assert text.split(SEP)[0] == (root / files[0]).read_text(encoding="utf-8")


def test_docstring_items_are_right():
    items = stdlib_docstring_mc(seed=0)
    assert len(items) > 200
    for it in items:
        fn = getattr(importlib.import_module(it["module"]), it["name"])
        assert " ".join(inspect.getdoc(fn).split()).startswith(it["docstring"].rstrip(".")[:30])
        assert it["choices"][it["answer"]] == f"{it['module']}.{it['name']}"
        assert len(set(it["choices"])) == 4
    assert stdlib_docstring_mc(seed=0) == items  # seeded: the same file every time


def test_make_data_and_the_shipped_copy(tmp_path):
    """Built in a fresh interpreter, as `lmstack eval make-data` builds the shipped copy: a library imported
    by another test can rebind a stdlib function (importing ray replaces inspect.isgenerator), which changes
    which docstrings the generator sees in this process."""
    import subprocess
    import sys

    code = (
        "import json, sys; from lmstack.eval.datasets import make_data; "
        "print(json.dumps(make_data(sys.argv[1], heldout_bytes=10_000)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    prov = json.loads(out.stdout.strip().splitlines()[-1])
    task = load_task(tmp_path / "stdlib_docstring_mc.yaml")
    assert (
        task.kind == "multiple_choice"
        and len(task.items) == prov["stdlib_docstring_mc.jsonl"]["items"]
    )
    assert task.items[0].context.startswith("Python standard library.\nDocstring: ")
    shipped = json.loads((REPO_DATA / "provenance.json").read_text())
    if shipped["python"] != prov["python"]:
        pytest.skip(
            f"data/eval was generated with Python {shipped['python']}, this is {prov['python']}"
        )
    for name in ("stdlib_docstring_mc.jsonl", "stdlib_docstring_mc.yaml"):
        assert (REPO_DATA / name).read_text() == (tmp_path / name).read_text()
