"""`lmstack eval ...` end to end on the tiny HF folder: exit codes, JSON written, clear errors."""

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
