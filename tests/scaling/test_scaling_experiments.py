"""The experiment commands run end to end on a tiny token file and write their PNG/JSON."""

import json

import numpy as np
import pytest
import torch

from lmstack.cli import main
from lmstack.utils import is_png_file


@pytest.fixture
def tokens(tmp_path):
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    ids = np.where(
        rng.random(20000) < 0.2, rng.integers(0, 64, 20000), np.tile(np.arange(64), 313)[:20000]
    )
    ids.astype(np.uint16).tofile(tmp_path / "t.bin")
    (tmp_path / "t.bin.json").write_text('{"n_tokens": 20000, "dtype": "uint16", "vocab_size": 64}')
    return tmp_path / "t.bin"


def test_coord_check_command(tmp_path, capsys):
    out = tmp_path / "cc.png"
    assert (
        main(
            [
                "scaling",
                "coord-check",
                "--widths",
                "16,32",
                "--base-width",
                "16",
                "--steps",
                "2",
                "--out",
                str(out),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert is_png_file(out)
    assert "mup" in capsys.readouterr().out


@pytest.mark.slow
def test_lr_transfer_and_batch_sweep_commands(tokens, tmp_path):
    out = tmp_path / "lt"
    assert (
        main(
            [
                "scaling",
                "lr-transfer",
                "--data",
                str(tokens),
                "--widths",
                "16,32",
                "--lrs",
                "1e-3,1e-2",
                "--base-width",
                "16",
                "--steps",
                "4",
                "--out",
                str(out),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    s = json.loads((out / "lr_transfer.json").read_text())
    assert set(s["results"]) == {"sp", "mup"} and is_png_file(out / "lr_transfer.png")
    # at the base width µP is SP: the same losses
    assert s["results"]["sp"]["16"] == s["results"]["mup"]["16"]
    out = tmp_path / "bs"
    assert (
        main(
            [
                "scaling",
                "batch-sweep",
                "--data",
                str(tokens),
                "--batches",
                "2,4",
                "--steps",
                "6",
                "--width",
                "16",
                "--out",
                str(out),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    s = json.loads((out / "batch_sweep.json").read_text())
    assert set(s["curves"]) == {"2", "4"} and is_png_file(out / "batch_sweep.png")


def test_outputs_never_swallow_the_input(tokens, capsys):
    # --out is the folder holding the token file: refused before anything is written
    assert main(["scaling", "batch-sweep", "--data", str(tokens), "--out", str(tokens.parent)]) == 2
    assert "lies inside --out" in capsys.readouterr().err
