"""The trainer adds DSA's indexer loss (model/dsa.py) to the step and reports it; it trains the indexer only."""

import json
import math

import pytest
import torch
from conftest import tiny_config

from lmstack.train import Trainer


def _run(token_file, out_dir, weight):
    cfg = tiny_config(
        token_file,
        out_dir,
        max_steps=3,
        model=dict(
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=64,
            max_seq_len=64,
            layer_types=["dsa", "attention"],
            dsa_top_k=4,
            dsa_index_heads=2,
            dsa_index_head_dim=8,
            dsa_indexer_loss=weight,
        ),
    )
    t = Trainer(cfg, progress=False)
    before = {n: p.detach().clone() for n, p in t.raw_model.named_parameters() if "idx_" in n}
    t.fit()
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    moved = {n: not torch.equal(p, t.raw_model.get_parameter(n)) for n, p in before.items()}
    return [r for r in rows if r["kind"] == "train"], moved


def test_indexer_loss_is_reported_and_trains_the_indexer(token_file, tmp_path):
    rows, moved = _run(token_file, tmp_path / "on", 1.0)
    assert all(math.isfinite(r["dsa_indexer_loss"]) and r["dsa_indexer_loss"] > 0 for r in rows)
    assert all(moved.values())
    rows, moved = _run(token_file, tmp_path / "off", 0.0)
    assert all("dsa_indexer_loss" not in r for r in rows)
    assert not any(moved.values())  # no gradient reaches the indexer from the LM loss


@pytest.mark.parametrize("field, value", [("dsa_indexer_loss", 0.5), ("moe_aux_loss_coef", 0.01)])
def test_pipeline_refuses_auxiliary_losses(field, value):
    """The pipeline schedule carries one loss per micro-batch; an auxiliary loss would be dropped without a word,
    so a pipelined step refuses it by name (Trainer.pipeline_train_step reads only the model's config first)."""
    from types import SimpleNamespace

    from lmstack.model.config import ModelConfig
    from lmstack.train.config import TrainConfigError
    from lmstack.train.trainer import Trainer

    extra = (
        dict(n_experts=4, n_experts_per_token=2)
        if field.startswith("moe")
        else dict(layer_types=["dsa", "attention"])
    )
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, **extra, **{field: value}
    )
    fake = SimpleNamespace(raw_model=SimpleNamespace(config=cfg))
    with pytest.raises(TrainConfigError, match=f"model.{field}.*pipeline parallelism"):
        Trainer.pipeline_train_step(fake)
