"""`lmstack demo` end to end on a tiny corpus (no SmolLM2): every stage runs and writes its outputs."""

import pytest


@pytest.mark.slow
def test_demo_tour_on_a_tiny_corpus(tmp_path, capsys):
    from lmstack.cli import main

    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"m{i}.py").write_text(
            f"def f{i}(x):\n    return x + {i}\n\n\nclass C{i}:\n    pass\n" * 20
        )
    out = tmp_path / "demo"
    assert (
        main(
            [
                "demo",
                str(src),
                "--out",
                str(out),
                "--vocab-size",
                "300",
                "--train-seconds",
                "3",
                "--skip-smollm2",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for section in (
        "1. corpus",
        "2. tokenizer",
        "3. data",
        "4. accounting",
        "5. training",
        "6. sampling",
        "outputs",
    ):
        assert section in text
    assert "unigram baseline" in text and "Training memory" in text
    for f in (
        "tokenizer.json",
        "tokens.bin",
        "run/metrics.jsonl",
        "run/loss_curve.png",
        "run/model/model.safetensors",
    ):
        assert (out / f).is_file(), f


def test_demo_refuses_an_out_folder_of_something_else(tmp_path, capsys):
    """The demo replaces --out's run/: a folder holding another run or model is refused without --force."""
    from lmstack.cli import main

    other = tmp_path / "theirs"
    (other / "run").mkdir(parents=True)
    (other / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["demo", "--out", str(other), "--skip-smollm2"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (other / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'
