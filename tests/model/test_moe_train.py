"""MoE inside the trainer: the routers' auxiliary loss is added to the training loss, the per-step metrics
carry the expert loads, and aux-loss-free biases move after each optimizer step."""

import json

import numpy as np
import pytest
import torch

from lmstack.model.moe import moe_modules
from lmstack.train import TrainConfig, Trainer


@pytest.fixture
def token_file(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.where(
        rng.random(8000) < 0.1, rng.integers(1, 64, 8000), np.tile(np.arange(1, 33), 250)
    )
    path = tmp_path / "tokens.bin"
    ids.astype(np.uint16).tofile(path)
    (tmp_path / "tokens.bin.json").write_text(
        json.dumps({"n_tokens": 8000, "dtype": "uint16", "vocab_size": 64})
    )
    return path


def _config(token_file, out_dir, **model):
    m = dict(
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=64,
        n_experts=4,
        n_experts_per_token=2,
        d_ff_expert=32,
    )
    m.update(model)
    return TrainConfig(
        model=m,
        train_data=str(token_file),
        batch_size=4,
        seq_len=16,
        max_steps=4,
        warmup_steps=1,
        lr=1e-2,
        min_lr=1e-3,
        eval_interval=0,
        eval_batches=1,
        log_interval=1,
        out_dir=str(out_dir),
        device="cpu",
        precision="fp32",
    )


def test_aux_loss_reaches_the_gradient_and_metrics(token_file, tmp_path):
    torch.manual_seed(0)
    t = Trainer(_config(token_file, tmp_path / "a", moe_aux_loss_coef=0.5))
    grads = {}
    orig = t.optimizer_step

    def capture():
        grads["router"] = t.raw_model.blocks[0].ffn.router.weight.grad.clone()
        return orig()

    t.optimizer_step = capture
    m = t.train_step()
    mods = moe_modules(t.raw_model)
    expect = sum(0.5 * float(x.stats["balance"]) for x in mods)  # α·Σ_layers E·Σ_i f_i·P_i
    assert m["moe_aux_loss"] == pytest.approx(expect, rel=1e-5)
    assert sum(m[f"moe_load_{i}"] for i in range(4)) == 2 * 4 * 16 * 2  # layers x B x S x k
    assert m["moe_load_max_over_mean"] >= 1.0 and m["moe_dropped"] == 0
    # the same step without the balance term gives a different router gradient
    torch.manual_seed(0)
    t0 = Trainer(_config(token_file, tmp_path / "b", moe_aux_loss_coef=0.0))
    orig0 = t0.optimizer_step

    def capture0():
        grads["router0"] = t0.raw_model.blocks[0].ffn.router.weight.grad.clone()
        return orig0()

    t0.optimizer_step = capture0
    t0.train_step()
    assert (grads["router"] - grads["router0"]).abs().max() > 1e-6


def test_aux_free_bias_updates_each_step(token_file, tmp_path):
    t = Trainer(
        _config(
            token_file,
            tmp_path / "c",
            router_score="sigmoid",
            router_aux_free_bias=True,
            moe_bias_update_rate=1e-3,
        )
    )
    bias = t.raw_model.blocks[0].ffn.router.bias
    assert not bias.requires_grad and float(bias.abs().sum()) == 0
    load = None
    orig = t.optimizer_step

    def capture():
        nonlocal load
        load = t.raw_model.blocks[0].ffn.stats["load"].float().clone()
        return orig()

    t.optimizer_step = capture
    t.train_step()
    expected = 1e-3 * torch.sign(load.mean() - load)  # b_i += γ·sign(mean load − load_i)
    torch.testing.assert_close(bias.detach(), expected)


def test_hash_routed_model_trains(token_file, tmp_path):
    """A model configured with hash routing trains through the Trainer: the loss falls, the routers have no
    parameters in use (no gradient), and each MoE layer's load is the bincount of the hash of the batch."""

    t = Trainer(_config(token_file, tmp_path / "h", router="hash", moe_aux_loss_coef=0.1))
    seen = {}
    orig = t.optimizer_step

    def capture():
        mod = moe_modules(t.raw_model)[0]
        seen["router_grad"] = mod.router.weight.grad
        seen["expert_grad"] = mod.gate_proj.weight.grad.abs().sum()
        return orig()

    t.optimizer_step = capture
    next_batch = t.next_batch

    def grab():
        seen["batch"] = next_batch()
        return seen["batch"]

    t.next_batch = grab
    losses = [t.train_step()["loss"] for _ in range(4)]
    assert seen["router_grad"] is None and seen["expert_grad"] > 0
    assert losses[-1] < losses[0]
    hand = [
        ((tok * 2654435761 + j * 0x9E3779B1) % (2**31 - 1)) % 4
        for tok in seen["batch"].x.reshape(-1).tolist()
        for j in range(2)
    ]
    for mod in moe_modules(t.raw_model):
        assert mod.stats["load"].tolist() == np.bincount(hand, minlength=4).tolist()
