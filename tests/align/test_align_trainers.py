"""SFT and DPO on lmstack's Trainer loop, with tiny models: SFT memorises a tiny set (and exports a model that
``load_model`` + the engine reproduce), resume is exact, DPO's margin and accuracy rise with either reference."""

import sys
from pathlib import Path

import pytest
import torch

from lmstack.align.data import encode_example
from lmstack.align.dpo import DPOTrainer
from lmstack.align.sft import SFTTrainer
from lmstack.inference import LLM
from lmstack.inference.sampling import SamplingParams
from lmstack.model.io import load_model
from lmstack.train.config import TrainConfig, TrainConfigError

sys.path.insert(0, str(Path(__file__).parent))
from align_helpers import byte_chat_tokenizer, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

QA = [("2+3", "5"), ("7*6", "42"), ("9-4", "5"), ("8+8", "16")]


def _config(tmp_path, **kw):
    base = dict(
        train_data="sft.jsonl",
        out_dir=str(tmp_path / "run"),
        batch_size=4,
        seq_len=64,
        lr=3e-3,
        min_lr=3e-3,
        warmup_steps=0,
        max_steps=60,
        precision="fp32",
        weight_decay=0.0,
        eval_interval=0,
        log_interval=10,
        device="cpu",
        seed=0,
    )
    return TrainConfig(**(base | kw))


@pytest.mark.slow
def test_sft_memorises_a_tiny_set_and_exports_a_servable_model(tmp_path):
    tok = byte_chat_tokenizer()
    exs = [encode_example(tok, q, a, max_len=65) for q, a in QA]
    trainer = SFTTrainer(
        _config(tmp_path, lr=1e-2, min_lr=1e-2, max_steps=80),
        tiny_model(),
        exs,
        exs,
        tokenizer=tok,
        pad_id=tok.pad_token_id,
        progress=False,
    )
    before = trainer.evaluate()["val_loss"]
    summary = trainer.fit()
    assert before > 3.0 and summary["val_loss"] < 0.02
    d = trainer.export()
    served = LLM(load_model(d).model, tok)  # the exported weights, through the engine
    for (_q, a), ex in zip(QA, exs):
        out = served.generate([ex.prompt], SamplingParams(temperature=0, max_tokens=8))[0]
        assert tok.decode(out.token_ids).startswith(a + "<|im_end|>")


def test_sft_resume_is_exact(tmp_path):
    tok = byte_chat_tokenizer()
    exs = [encode_example(tok, q, a) for q, a in QA]
    straight = SFTTrainer(
        _config(tmp_path / "a", max_steps=6, batch_size=2),
        tiny_model(),
        exs,
        tokenizer=tok,
        progress=False,
    )
    straight.fit()
    first = SFTTrainer(
        _config(tmp_path / "b", max_steps=6, batch_size=2, stop_after=3),
        tiny_model(),
        exs,
        tokenizer=tok,
        progress=False,
    )
    first.fit()
    second = SFTTrainer(
        _config(tmp_path / "b", max_steps=6, batch_size=2),
        tiny_model(seed=5),
        exs,
        tokenizer=tok,
        progress=False,
    )
    assert second.resume() == 3
    second.fit()
    for p, q in zip(straight.raw_model.parameters(), second.raw_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_sft_refuses_examples_longer_than_the_context(tmp_path):
    tok = byte_chat_tokenizer()
    with pytest.raises(TrainConfigError, match="example 0 needs more than seq_len=16"):
        SFTTrainer(
            _config(tmp_path, seq_len=16),
            tiny_model(),
            [encode_example(tok, "a long prompt", "x")],
            progress=False,
        )


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["precomputed", "model"])
def test_dpo_margin_and_accuracy_rise(tmp_path, reference):
    tok = byte_chat_tokenizer()
    pairs = [(encode_example(tok, q, a), encode_example(tok, q, str(int(a) + 1))) for q, a in QA]
    trainer = DPOTrainer(
        _config(tmp_path, max_steps=15, lr=1e-3, min_lr=1e-3),
        tiny_model(),
        pairs,
        tokenizer=tok,
        beta=0.5,
        reference=reference,
        pad_id=tok.pad_token_id,
        progress=False,
    )
    start = trainer.evaluate()
    assert start["val_rewards/margins"] == pytest.approx(
        0.0, abs=1e-5
    )  # policy = reference at step 0
    end = trainer.fit()
    assert end["val_rewards/accuracies"] == 1.0 and end["val_rewards/margins"] > 1.0
    assert end["val_loss"] < start["val_loss"]
    assert (trainer.ref_model is None) == (reference == "precomputed")


def test_packed_and_padded_sft_batches_give_the_same_loss(tmp_path):
    """Token-normalised NLL over the same examples: packed rows (per-document attention) = padded rows."""
    tok = byte_chat_tokenizer()
    exs = [encode_example(tok, q, a) for q, a in QA]
    packed = SFTTrainer(
        _config(tmp_path / "p", packing=True, sep_id=0, seq_len=96),
        tiny_model(),
        exs,
        progress=False,
    )
    padded = SFTTrainer(_config(tmp_path / "q", seq_len=96), tiny_model(), exs, progress=False)
    pb = packed.make_batch(exs)
    assert pb.x.shape[0] < len(exs)  # several examples share a row
    with torch.no_grad():
        torch.testing.assert_close(
            packed.forward_loss(pb)[0], padded.forward_loss(padded.make_batch(exs))[0]
        )


@pytest.mark.parametrize("plan", ["tp=2", "dp=1,pp=2", "zero3"])
def test_plans_other_than_data_parallel_are_refused_by_name(tmp_path, plan):
    tok = byte_chat_tokenizer()
    with pytest.raises(TrainConfigError, match="data parallel only"):
        SFTTrainer(
            _config(tmp_path, parallel=plan),
            tiny_model(),
            [encode_example(tok, "2+3", "5")],
            progress=False,
        )
