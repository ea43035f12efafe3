"""Softmax, log-sum-exp, cross-entropy + z-loss, and the MoE balance loss vs torch (CS336 notes "训练稳定性")."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmstack.train import (
    cross_entropy,
    load_balance_loss,
    log_softmax,
    logsumexp,
    softmax,
    z_loss_term,
)


@pytest.mark.parametrize("scale", [1.0, 100.0, 5000.0])
def test_softmax_family_matches_torch(scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 33, generator=g, dtype=torch.float64) * scale
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1))
    torch.testing.assert_close(log_softmax(x), torch.log_softmax(x, -1))
    torch.testing.assert_close(logsumexp(x), torch.logsumexp(x, -1))
    assert torch.isfinite(softmax(x)).all() and torch.isfinite(log_softmax(x)).all()


def test_softmax_extreme_logits_no_overflow():
    x = torch.tensor([[1000.0, 1000.0, -1000.0], [-5000.0, 3000.0, 3000.0]])
    naive = torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)
    assert torch.isnan(naive).any()  # why the max trick is needed
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1))
    torch.testing.assert_close(logsumexp(x), torch.logsumexp(x, -1))
    # the absolute log Z the z-loss needs: m + log Σ exp(u - m)
    torch.testing.assert_close(logsumexp(x)[0], torch.tensor(1000.0 + math.log(2.0)))


def test_logsumexp_all_minus_inf_row():
    x = torch.tensor([[-math.inf, -math.inf], [0.0, 0.0]])
    torch.testing.assert_close(logsumexp(x), torch.logsumexp(x, -1))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("scale", [1.0, 3000.0])
def test_cross_entropy_value_and_grad_match_torch(scale, fused):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * scale).requires_grad_()
    targets = torch.randint(0, 11, (3, 5), generator=g)
    targets[0, 0] = targets[2, 4] = -100
    ce, z = cross_entropy(logits, targets, fused=fused)
    assert z.item() == 0.0
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 11), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(ce, ref)
    ce.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


@pytest.mark.parametrize("fused", [True, False])
def test_z_loss_value_and_grad_vs_autograd_reference(fused):
    g = torch.Generator().manual_seed(2)
    alpha = 1e-2
    logits = (torch.randn(4, 6, 13, generator=g, dtype=torch.float64) * 10).requires_grad_()
    targets = torch.randint(0, 13, (4, 6), generator=g)
    targets[1, 2] = -100
    ce, z = cross_entropy(logits, targets, z_loss=alpha, fused=fused)
    (ce + 3 * z).backward()
    # reference: torch ops only, differentiated by autograd
    ref_logits = logits.detach().clone().requires_grad_()
    lse = torch.logsumexp(ref_logits, -1)
    mask = targets != -100
    ref_ce = F.cross_entropy(ref_logits.reshape(-1, 13), targets.reshape(-1), ignore_index=-100)
    ref_z = alpha * (lse[mask] ** 2).mean()
    (ref_ce + 3 * ref_z).backward()
    torch.testing.assert_close(ce, ref_ce)
    torch.testing.assert_close(z, ref_z)
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    # the unmasked helper: α·mean(log²Z)
    torch.testing.assert_close(
        z_loss_term(logits.detach(), alpha), alpha * (lse.detach() ** 2).mean()
    )


@pytest.mark.parametrize("fused", [True, False])
def test_cross_entropy_gradcheck(fused):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, -100, 6, 2])
    assert torch.autograd.gradcheck(
        lambda x: sum(cross_entropy(x, targets, z_loss=0.1, fused=fused)), (logits,)
    )


def test_cross_entropy_bf16_logits_computed_in_fp32():
    g = torch.Generator().manual_seed(4)
    logits32 = torch.randn(64, 50, generator=g) * 20
    logits = logits32.bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (64,), generator=g)
    ce, _ = cross_entropy(logits, targets)
    ref = F.cross_entropy(logits.detach().float(), targets)
    assert ce.dtype == torch.float32
    torch.testing.assert_close(ce, ref)
    ce.backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("fused", [True, False])
def test_cross_entropy_extreme_logits_finite(fused):
    logits = torch.tensor([[5000.0, -5000.0, 0.0], [-3000.0, -3000.0, -2999.0]], requires_grad=True)
    targets = torch.tensor([1, 2])
    ce, z = cross_entropy(logits, targets, z_loss=1e-4, fused=fused)
    ref = F.cross_entropy(logits.detach(), targets)
    torch.testing.assert_close(ce, ref)
    (ce + z).backward()
    assert torch.isfinite(logits.grad).all()


def test_cross_entropy_bad_shapes_and_alpha():
    with pytest.raises(ValueError, match="does not match logits"):
        cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="z_loss=-1"):
        cross_entropy(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), z_loss=-1)


def test_load_balance_loss_hand_computed():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    chosen = torch.tensor([0, 1, 0, 2])
    # f = (2/4, 1/4, 1/4); P = (0.4, 0.375, 0.225); E·Σ f·P = 3·(0.2 + 0.09375 + 0.05625)
    torch.testing.assert_close(load_balance_loss(probs, chosen, 3), torch.tensor(3 * 0.35))
    uniform = torch.full((6, 3), 1 / 3)
    torch.testing.assert_close(
        load_balance_loss(uniform, torch.tensor([0, 1, 2, 0, 1, 2]), 3), torch.tensor(1.0)
    )
