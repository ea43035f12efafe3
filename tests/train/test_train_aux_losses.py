"""The auxiliary-loss seam: a layer that declares ``aux_losses()`` has its term added to the training loss
and logged by name, without the trainer knowing the layer (``Transformer.aux_losses``)."""

import pytest
import torch
from conftest import tiny_config
from torch import nn

from lmstack.model import ModelConfig
from lmstack.model.transformer import Transformer, aux_loss_coefs
from lmstack.train import Trainer


class L2Penalty(nn.Module):
    """A toy layer-owned term: c·‖W_down‖² of its block's FFN, recomputed on each call."""

    def __init__(self, weight: torch.Tensor, coef: float):
        super().__init__()
        self._w, self.coef = [weight], coef

    def aux_losses(self):
        return {"toy_l2": self.coef * self._w[0].float().pow(2).sum()}


def _grads(trainer):
    captured = {}
    orig = trainer.optimizer_step

    def capture():
        captured.update(
            {
                n: p.grad.clone()
                for n, p in trainer.raw_model.named_parameters()
                if p.grad is not None
            }
        )
        return orig()

    trainer.optimizer_step = capture
    return captured


def test_a_layers_aux_term_is_added_to_the_loss_and_logged(token_file, tmp_path):
    coef = 0.05
    runs = {}
    for name, on in (("off", False), ("on", True)):
        t = Trainer(tiny_config(token_file, tmp_path / name, grad_accum=2), progress=False)
        w = t.raw_model.blocks[1].ffn.down_proj.weight
        w0 = w.detach().clone()  # the weights the step's forward sees
        expect = coef * float(w0.pow(2).sum())
        if on:
            t.raw_model.blocks[1].penalty = L2Penalty(w, coef)
        grads = _grads(t)
        runs[name] = (t.train_step(), grads, w0, expect)
    m_on, g_on, w0, expect = runs["on"]
    m_off, g_off, _, _ = runs["off"]
    assert "toy_l2" not in m_off
    assert m_on["toy_l2"] == pytest.approx(expect, rel=1e-6)  # mean over the 2 micro-batches
    assert m_on["loss"] == pytest.approx(m_off["loss"], rel=1e-6)  # logged loss is the LM loss
    # the gradient of c·‖W‖² is 2c·W, on that weight only (hand-worked; grad_accum averages it)
    key = "blocks.1.ffn.down_proj.weight"
    assert torch.allclose(g_on[key] - g_off[key], 2 * coef * w0, atol=1e-6)
    other = "blocks.0.ffn.down_proj.weight"
    assert torch.allclose(g_on[other], g_off[other], atol=1e-7)


def test_aux_loss_coefs_name_the_config_fields():
    dense = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    assert aux_loss_coefs(dense) == {}
    moe = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        n_experts=4,
        n_experts_per_token=2,
        moe_aux_loss_coef=0.01,
    )
    assert aux_loss_coefs(moe) == {
        "moe_aux_loss_coef": 0.01,
        "moe_device_loss_coef": 0.0,
        "moe_z_loss_coef": 0.0,
    }
    dsa = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        layer_types=["dsa", "attention"],
        dsa_indexer_loss=0.5,
    )
    assert aux_loss_coefs(dsa) == {"dsa_indexer_loss": 0.5}


def test_inference_forward_reports_no_aux_terms():
    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        n_experts=4,
        n_experts_per_token=2,
        moe_aux_loss_coef=0.5,
    )
    model = Transformer(cfg, seed=0)
    x = torch.randint(0, 64, (2, 8))
    model(x)
    (term,) = model.aux_losses().values()  # training forward: one summed MoE term
    assert term.requires_grad
    with torch.no_grad():
        model(x)
    assert model.aux_losses() == {}
