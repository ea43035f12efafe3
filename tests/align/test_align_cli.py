"""``lmstack sft | dpo | grpo`` end to end on a tiny saved checkpoint: each writes metrics, a PNG and a model
directory that loads back (weights + tokenizer with its chat template)."""

import json
import sys
from pathlib import Path

import pytest

from lmstack.cli import main
from lmstack.model.io import load_model, save_pretrained
from lmstack.tokenizer import load_tokenizer, save_hf, save_hf_config

sys.path.insert(0, str(Path(__file__).parent))
from align_helpers import byte_chat_tokenizer, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def checkpoint(tmp_path):
    d = tmp_path / "tiny"
    save_pretrained(tiny_model(vocab_size=259, max_seq_len=256), d)
    save_hf(byte_chat_tokenizer(), d / "tokenizer.json")
    save_hf_config(byte_chat_tokenizer(), d / "tokenizer_config.json")
    return d


@pytest.mark.slow
def test_sft_dpo_grpo_commands(tmp_path, checkpoint, capsys):
    common = ["--model", str(checkpoint), "--steps", "2", "--lr", "1e-3", "--threads", "1"]
    sft = tmp_path / "sft"
    assert (
        main(
            [
                "sft",
                *common,
                "--task",
                "arithmetic",
                "--examples",
                "8",
                "--batch-size",
                "4",
                "--out",
                str(sft),
            ]
        )
        == 0
    )
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+1?", "chosen": str(a + 1), "rejected": str(a)}) + "\n"
            for a in range(4)
        )
    )
    assert (
        main(
            [
                "dpo",
                *common,
                "--data",
                str(pairs),
                "--batch-size",
                "2",
                "--out",
                str(tmp_path / "dpo"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "grpo",
                *common,
                "--prompts-per-step",
                "2",
                "--generations",
                "2",
                "--max-new-tokens",
                "4",
                "--eval-problems",
                "2",
                "--out",
                str(tmp_path / "grpo"),
            ]
        )
        == 0
    )
    runs = (
        ("sft", "loss_curve.png"),
        ("dpo", "loss_curve.png"),
        ("dpo", "dpo_margins.png"),
        ("grpo", "grpo.png"),
    )
    for run, png in runs:
        d = tmp_path / run
        assert (d / "metrics.jsonl").stat().st_size > 0 and (d / png).stat().st_size > 0, run
        assert load_model(d / "model").model.config.vocab_size == 259
        tok = load_tokenizer(d / "model")
        assert tok.chat_template == byte_chat_tokenizer().chat_template and tok.eos_token_id == 257
    rows = [
        json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert "rewards/margins" in rows[0] and "rewards/accuracies" in rows[0]


def test_bad_input_exits_2_naming_it(tmp_path, checkpoint, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n'
    )
    assert (
        main(["dpo", "--model", str(checkpoint), "--data", str(bad), "--out", str(tmp_path / "o")])
        == 2
    )
    assert "bad.jsonl:2: missing ['rejected']" in capsys.readouterr().err
    assert (
        main(
            ["grpo", "--model", str(checkpoint), "--generations", "1", "--out", str(tmp_path / "g")]
        )
        == 2
    )
    assert "num_generations=1 with advantage='group'" in capsys.readouterr().err


def test_grpo_eval_only_prints_the_held_out_accuracy(tmp_path, checkpoint, capsys):
    assert (
        main(
            [
                "grpo",
                "--model",
                str(checkpoint),
                "--eval-only",
                "--eval-problems",
                "3",
                "--max-new-tokens",
                "4",
                "--out",
                str(tmp_path / "g"),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["problems"] == 3 and out["eval_accuracy"] == 0.0  # a random tiny model
    assert not (tmp_path / "g" / "checkpoints").exists()
