"""µP: every parameter kind follows Tensor Programs V Table 3 (Adam), the base width equals SP, the
output multiplier and 1/H attention reach the forward pass, and the coordinate check is flat."""

import math

import numpy as np
import pytest
import torch

from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.scaling.mup import MupTrainer, apply_mup, mup_table

# Yang et al. 2022 (TP V), Table 3, µP column for Adam: exponents of fan_in in the *effective* init
# variance and Adam learning rate (relative to the base model, so the ratio fan_in/base_fan_in).
TP5_TABLE3 = {"input": (0, 0), "hidden": (-1, -1), "output": (-2, -1)}
SIGMA = 0.02


def _model(width, tied=False, qk_norm=False, device=None):
    cfg = ModelConfig.from_dict(
        dict(
            d_model=width,
            n_layers=2,
            n_heads=4,
            d_ff=4 * width,
            vocab_size=128,
            tie_embeddings=tied,
            qk_norm=qk_norm,
            init_std=SIGMA,
        )
    )
    return Transformer(cfg, device=device)


def _effective(row, m, c_attn):
    """(effective init variance, effective Adam LR multiplier) of the function µP computes: the
    stored re-scalings (output gain 1/m, q × c) are undone here, independently of mup.py."""
    var, lr = row.init_std**2, row.lr_mult
    if row.kind == "output":  # logits = W·(γ x̂), γ = 1/m: W_eff = W/m
        var, lr = var / m**2, lr / m
    if row.name.endswith("q_proj.weight"):
        var, lr = var / c_attn**2, lr / c_attn
    return var, lr


@pytest.mark.parametrize("width", [64, 128, 256])
def test_every_kind_follows_tp5_table3(width):
    base = 64
    model = _model(width, device="meta")  # the table needs shapes only
    m = width / base
    H, H_base = width // 4, base // 4
    c_attn = math.sqrt(H_base / H)
    rows = mup_table(model, base)
    assert {r.kind for r in rows} == {"input", "hidden", "output", "vector"}
    for row in rows:
        if row.kind == "vector":
            assert row.lr_mult == (1 / m if row.name == "norm.weight" else 1.0)
            continue
        var_exp, lr_exp = TP5_TABLE3[row.kind]
        ratio = width / base  # every matrix's fan_in (D, or F = 4D) grows by the width ratio
        sp_std = (
            SIGMA / math.sqrt(4)
            if row.name.endswith(("o_proj.weight", "down_proj.weight"))
            else SIGMA
        )
        var, lr = _effective(row, m, c_attn)
        assert var == pytest.approx(sp_std**2 * ratio**var_exp, rel=1e-12), row
        assert lr == pytest.approx(ratio**lr_exp, rel=1e-12), row
    # attention scores: (c·q)·k/√H = q·k·√H_base/H, i.e. ∝ 1/H
    assert c_attn / math.sqrt(H) == pytest.approx(math.sqrt(H_base) / H)


def test_base_width_is_standard_parametrization():
    model = _model(64, device="meta")
    for row in mup_table(model, 64):
        assert row.lr_mult == 1.0 and row.wd_mult == 1.0
        if row.kind == "vector":
            assert row.init_value in (0.0, 1.0)
        else:
            sp = SIGMA / 2 if row.name.endswith(("o_proj.weight", "down_proj.weight")) else SIGMA
            assert row.init_std == pytest.approx(sp)


def test_stored_weights_have_the_table_statistics():
    model = _model(128)
    rows = {r.name: r for r in apply_mup(model, 32)}
    params = dict(model.named_parameters())
    for name in ("blocks.0.ffn.up_proj.weight", "blocks.0.attn.q_proj.weight", "embed.weight"):
        w = params[name].detach().numpy()
        # truncated at ±3σ: std = σ·0.98658 (scipy.stats.truncnorm(-3, 3).std())
        assert w.std() == pytest.approx(rows[name].init_std * 0.98658, rel=0.03), name
    assert torch.all(params["norm.weight"] == 0.25)


def test_output_multiplier_reaches_the_logits():
    torch.manual_seed(0)
    model = _model(128, tied=True)
    apply_mup(model, 32)
    tokens = torch.randint(0, 128, (2, 8))
    logits = model(tokens)
    with torch.no_grad():
        model.norm.weight.mul_(4.0)  # undo the stored 1/m: logits grow by exactly m = 4
    torch.testing.assert_close(model(tokens), logits * 4.0, rtol=1e-5, atol=1e-6)


def test_qk_norm_models_put_the_attention_factor_in_the_q_gain():
    rows = {r.name: r for r in mup_table(_model(256, qk_norm=True, device="meta"), 64)}
    c = math.sqrt(16 / 64)
    assert rows["blocks.0.attn.q_norm.weight"].init_value == pytest.approx(c)
    assert rows["blocks.0.attn.q_proj.weight"].lr_mult == pytest.approx(0.25)


@pytest.mark.slow
def test_coordinate_check_is_flat_under_mup_and_grows_under_sp():
    from lmstack.scaling.coord_check import coord_check

    torch.set_num_threads(1)
    widths = [32, 64, 128, 256]
    sp = coord_check(widths, 32, "sp", steps=3)
    mup = coord_check(widths, 32, "mup", steps=3)
    growth_sp = sp[256][-1, 1] / sp[32][-1, 1]
    growth_mup = mup[256][-1, 1] / mup[32][-1, 1]
    assert growth_sp > 5  # SP: the residual stream grows with width after a few Adam steps
    assert 0.7 < growth_mup < 1.4  # µP: flat
    np.testing.assert_allclose(sp[32], mup[32], rtol=1e-6)  # base width: µP == SP


def test_mup_trainer_groups_carry_the_multipliers(tmp_path):
    from lmstack.train import TrainConfig

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, 5000).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    (tmp_path / "t.bin.json").write_text('{"n_tokens": 5000, "dtype": "uint16", "vocab_size": 64}')
    cfg = TrainConfig(
        model=dict(d_model=64, n_layers=1, n_heads=2, d_ff=128, max_seq_len=16),
        train_data=str(tmp_path / "t.bin"),
        batch_size=2,
        seq_len=16,
        max_steps=3,
        warmup_steps=0,
        lr=1e-2,
        min_lr=1e-2,
        out_dir=str(tmp_path / "run"),
        device="cpu",
        precision="fp32",
        eval_interval=0,
        eval_batches=1,
    )
    tr = MupTrainer(cfg, base_width=16, progress=False)
    tr.train_step()
    lrs = {}
    for g in tr.optimizer.param_groups:
        for p in g["params"]:
            lrs[id(p)] = g["lr"]
    rows = {r.name: r for r in tr.mup_rows}
    for name, p in tr.raw_model.named_parameters():
        assert lrs[id(p)] == pytest.approx(1e-2 * rows[name].lr_mult), name
