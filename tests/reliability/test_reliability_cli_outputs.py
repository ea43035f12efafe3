"""Issue 13, data loss: every lmstack command that writes refuses an output that is one of its inputs
— the same path, a symlink to it, or a hard link to it — with exit 2, and the input keeps its bytes.
An existing output of another kind is not replaced without --force."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from reliability_train_helpers import cli, run_config, snapshot

LINKS = ["same", "symlink", "hardlink"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """corpus.txt, a tokenizer trained on it, a model config, a run config and its token file."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    rc, _, err = cli(
        "tokenizer", "train", d / "corpus.txt", "--vocab-size", "300", "--out", d / "tok.json"
    )
    assert rc == 0, err
    (d / "model.json").write_text(
        json.dumps({"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256})
    )
    run_config(d, max_steps=2)
    return d


def _place(kind: str, src: Path, path: Path) -> Path:
    """Make ``path`` be the input ``src``: a copy of it that the command is told is the input (same),
    a symlink to it, or a hard link to it. Returns the input path the command is given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "same":
        path.write_bytes(src.read_bytes())
        return path
    if kind == "symlink":
        path.symlink_to(src.resolve())
    else:
        os.link(src, path)
    return src


def _case(name: str, files: Path, kind: str, work: Path) -> tuple[list, Path]:
    """(lmstack args, the input that must keep its bytes) for one writing command whose output is
    (or links to) one of its inputs."""
    corpus, tok, model, run = (
        files / "corpus.txt",
        files / "tok.json",
        files / "model.json",
        files / "run.json",
    )
    tokens = files / "tokens.bin"
    o = work / "out"
    if name == "tokenizer train --out":
        i = _place(kind, corpus, o / "a.json")
        return ["tokenizer", "train", i, "--vocab-size", "300", "--out", o / "a.json"], i
    if name == "tokenizer encode --out=corpus":
        i = _place(kind, corpus, o / "b.bin")
        return ["tokenizer", "encode", i, "--tokenizer", tok, "--out", o / "b.bin"], i
    if name == "tokenizer encode --out=tokenizer":
        i = _place(kind, tok, o / "c.bin")
        return ["tokenizer", "encode", corpus, "--tokenizer", i, "--out", o / "c.bin"], i
    if name == "tokenizer encode sidecar":  # --out X writes X.json: here the tokenizer
        i = _place(kind, tok, o / "d.json")
        return ["tokenizer", "encode", corpus, "--tokenizer", i, "--out", o / "d"], i
    if name == "tokenizer train --format gpt2":
        i = _place(kind, corpus, o / "vocab.json")
        return ["tokenizer", "train", i, "--vocab-size", "300", "--format", "gpt2", "--out", o], i
    if name == "plan --json":
        i = _place(kind, model, o / "e.json")
        return ["plan", "--model", i, "--json", o / "e.json"], i
    if name == "plan --plot":
        i = _place(kind, model, o / "f.png")
        return ["plan", "--model", i, "--plot", o / "f.png"], i
    if name == "bench model --json":
        i = _place(kind, model, o / "g.json")
        return ["bench", "model", "--config", i, "--n-layers", "1", "--json", o / "g.json"], i
    if name == "train --config":  # the run writes out_dir/config.json
        i = _place(kind, run, o / "config.json")
        return ["train", "--config", i, f"out_dir={o}", "--no-progress", "--threads", "1"], i
    if name == "train train_data":  # the run writes out_dir/metrics.jsonl
        i = _place(kind, tokens, o / "metrics.jsonl")
        if kind == "same":
            Path(str(i) + ".json").write_bytes(Path(str(tokens) + ".json").read_bytes())
        return [
            "train",
            "--config",
            run,
            f"out_dir={o}",
            f"train_data={i}",
            "--no-progress",
            "--threads",
            "1",
        ], i
    if name == "train tokenizer":  # the run writes out_dir/model/tokenizer.json
        i = _place(kind, tok, o / "model" / "tokenizer.json")
        return [
            "train",
            "--config",
            run,
            f"out_dir={o}",
            f"tokenizer={i}",
            "--no-progress",
            "--threads",
            "1",
        ], i
    if name == "demo --out":  # the demo writes --out/corpus.txt
        i = _place(kind, corpus, o / "corpus.txt")
        return ["demo", i, "--out", o, "--threads", "1"], i
    raise KeyError(name)


CASES = [
    "tokenizer train --out",
    "tokenizer encode --out=corpus",
    "tokenizer encode --out=tokenizer",
    "tokenizer encode sidecar",
    "tokenizer train --format gpt2",
    "plan --json",
    "plan --plot",
    "bench model --json",
    "train --config",
    "train train_data",
    "train tokenizer",
    "demo --out",
]


@pytest.mark.parametrize("kind", LINKS)
@pytest.mark.parametrize("name", CASES)
def test_output_that_is_an_input_is_refused_and_the_input_untouched(files, tmp_path, kind, name):
    before = snapshot(files)
    args, keep = _case(name, files, kind, tmp_path)
    keep_bytes = keep.read_bytes()
    rc, out, err = cli(*args)
    assert rc == 2, (out, err)
    assert err.startswith("lmstack: error: "), err
    assert "refusing to overwrite an input" in err or "lies inside" in err, err
    assert keep.read_bytes() == keep_bytes
    assert snapshot(files) == before  # nothing among the shared inputs changed either


def test_existing_output_of_another_kind_needs_force(files, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    rc, _, err = cli(
        "tokenizer", "train", files / "corpus.txt", "--vocab-size", "300", "--out", notes
    )
    assert rc == 2 and "is not a tokenizer JSON file" in err and "--force" in err
    assert notes.read_text() == "my notes\n"
    rc, _, err = cli(
        "tokenizer",
        "encode",
        files / "corpus.txt",
        "--tokenizer",
        files / "tok.json",
        "--out",
        notes,
    )
    assert rc == 2 and "is not a token file" in err
    assert notes.read_text() == "my notes\n"
    rc, _, err = cli("plan", "--model", files / "model.json", "--json", notes)
    assert rc == 2 and "is not a JSON file" in err
    assert notes.read_text() == "my notes\n"
    rc, _, err = cli(
        "tokenizer", "train", files / "corpus.txt", "--vocab-size", "300", "--out", notes, "--force"
    )
    assert rc == 0, err
    assert json.loads(notes.read_text())  # replaced, as asked


def test_rewriting_own_kind_of_output_is_allowed(files, tmp_path):
    out = tmp_path / "t.bin"
    for _ in range(
        2
    ):  # the second run replaces the first run's token file: same kind, no --force needed
        rc, _, err = cli(
            "tokenizer",
            "encode",
            files / "corpus.txt",
            "--tokenizer",
            files / "tok.json",
            "--out",
            out,
        )
        assert rc == 0, err
    assert json.loads(Path(str(out) + ".json").read_text())["n_tokens"] * 2 == out.stat().st_size


def test_console_script_refuses_too(files, tmp_path):
    """The real ``lmstack`` process: exit status 2 and the message on stderr."""
    import subprocess
    import sys

    corpus = files / "corpus.txt"
    link = tmp_path / "link.txt"
    link.symlink_to(corpus)
    before = corpus.read_bytes()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmstack",
            "tokenizer",
            "encode",
            str(corpus),
            "--tokenizer",
            str(files / "tok.json"),
            "--out",
            str(link),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    assert f"--out '{link}' resolves to the input '{corpus}'" in r.stderr
    assert corpus.read_bytes() == before
