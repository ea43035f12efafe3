"""linear_cross_entropy (unembedding + CE + z-loss block by block) vs F.cross_entropy on the full logits."""

import pytest
import torch
import torch.nn.functional as F

from lmstack.train.losses import linear_cross_entropy


def _data(M=37, D=12, V=29, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, D, generator=g, dtype=dtype) * scale).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=dtype) * scale).requires_grad_()
    y = torch.randint(0, V, (M,), generator=g)
    y[3] = y[20] = -100
    return h, w, y


def _reference(h, w, y, alpha, c_ce=1.0, c_z=1.0):
    """Full logits, F.cross_entropy and an autograd z-loss (torch ops only)."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = F.linear(h, w)  # (M, V)
    ce = F.cross_entropy(logits, y, ignore_index=-100)
    lse = torch.logsumexp(logits, -1)
    z = alpha * lse[y != -100].square().mean()
    (c_ce * ce + c_z * z).backward()
    return ce.detach(), z.detach(), h.grad, w.grad


@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("alpha", [0.0, 1e-2])
def test_values_and_grads_match_full_logits(rows, alpha):
    h, w, y = _data()
    ce, z = linear_cross_entropy(h, w, y, z_loss=alpha, rows=rows)
    (ce + z).backward()
    ref_ce, ref_z, ref_gh, ref_gw = _reference(h, w, y, alpha)
    torch.testing.assert_close(ce, ref_ce)
    torch.testing.assert_close(z, ref_z)
    torch.testing.assert_close(h.grad, ref_gh)
    torch.testing.assert_close(w.grad, ref_gw)


def test_different_upstream_gradients_for_ce_and_z():
    # loss = 0.5·CE + 3·z: the precomputed CE + z gradient cannot be scaled, backward recomputes
    h, w, y = _data(seed=1, scale=2.0)
    ce, z = linear_cross_entropy(h, w, y, z_loss=5e-2, rows=8)
    (0.5 * ce + 3.0 * z).backward()
    _, _, ref_gh, ref_gw = _reference(h, w, y, 5e-2, 0.5, 3.0)
    torch.testing.assert_close(h.grad, ref_gh)
    torch.testing.assert_close(w.grad, ref_gw)


def test_scaled_loss_and_3d_inputs():
    # gradient accumulation divides the loss: both upstream gradients are 1/4
    h, w, y = _data(M=24, seed=2)
    ce, z = linear_cross_entropy(h.view(4, 6, -1), w, y.view(4, 6), z_loss=1e-3, rows=7)
    ((ce + z) / 4).backward()
    _, _, ref_gh, ref_gw = _reference(h, w, y, 1e-3, 0.25, 0.25)
    torch.testing.assert_close(h.grad, ref_gh)
    torch.testing.assert_close(w.grad, ref_gw)


def test_extreme_logits_stay_finite():
    h, w, y = _data(D=4, seed=3, scale=30.0)  # logits in the thousands
    ce, z = linear_cross_entropy(h, w, y, z_loss=1e-4, rows=9)
    ref_ce, ref_z, ref_gh, _ = _reference(h, w, y, 1e-4)
    assert F.linear(h, w).abs().max() > 1000
    torch.testing.assert_close(ce, ref_ce)
    torch.testing.assert_close(z, ref_z)
    (ce + z).backward()
    assert torch.isfinite(h.grad).all()
    torch.testing.assert_close(h.grad, ref_gh)


def test_all_targets_ignored_gives_zero():
    h, w, _ = _data(seed=4)
    y = torch.full((h.shape[0],), -100)
    ce, z = linear_cross_entropy(h, w, y, z_loss=1e-2)
    (ce + z).backward()
    assert ce.item() == 0.0 and z.item() == 0.0
    assert h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_bf16_autocast_matches_autocast_linear_then_cross_entropy():
    # fp32 master weights under bf16 autocast: same logits (bf16-rounded) and the loss in fp32
    h, w, y = _data(M=300, D=64, V=500, dtype=torch.float32, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, z = linear_cross_entropy(h, w, y, z_loss=1e-3, rows=64)
    (ce + z).backward()
    assert (
        ce.dtype == torch.float32
        and h.grad.dtype == torch.float32
        and w.grad.dtype == torch.float32
    )
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h2, w2)
    assert logits.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.float(), y, ignore_index=-100)
    lse = torch.logsumexp(logits.float(), -1)
    ref_z = 1e-3 * lse[y != -100].square().mean()
    (ref + ref_z).backward()
    torch.testing.assert_close(ce, ref.detach(), rtol=1e-6, atol=1e-6)  # the same bf16 logits
    torch.testing.assert_close(z, ref_z.detach(), rtol=1e-6, atol=1e-6)
    # gradients: bf16 ∂U and bf16 matmuls on both sides (lmstack sums ∂W over row groups in fp32)
    torch.testing.assert_close(h.grad, h2.grad, rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(w.grad, w2.grad, rtol=2e-2, atol=1e-4)


def test_no_grad_and_bad_inputs():
    h, w, y = _data(seed=6)
    with torch.no_grad():
        ce, _ = linear_cross_entropy(h, w, y)
    torch.testing.assert_close(ce, F.cross_entropy(F.linear(h, w), y, ignore_index=-100).detach())
    with pytest.raises(ValueError, match="does not match hidden size"):
        linear_cross_entropy(h, w[:, :5], y)
    with pytest.raises(ValueError, match="targets shape"):
        linear_cross_entropy(h, w, y[:5])
    with pytest.raises(ValueError, match="z_loss"):
        linear_cross_entropy(h, w, y, z_loss=-1.0)
    with pytest.raises(ValueError, match="rows=0"):
        linear_cross_entropy(h, w, y, rows=0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainer_fused_loss_trains_like_the_materialised_logits(token_file, tmp_path, precision):
    from conftest import tiny_config

    from lmstack.train import Trainer

    kw = dict(precision=precision, z_loss=1e-3, grad_accum=2, max_steps=3)
    a = Trainer(tiny_config(token_file, tmp_path / "a", fused_loss=True, **kw), progress=False)
    b = Trainer(tiny_config(token_file, tmp_path / "b", fused_loss=False, **kw), progress=False)
    tol = dict(rel=1e-6) if precision == "fp32" else dict(rel=1e-2)
    for _ in range(3):
        ma, mb = a.train_step(), b.train_step()
        assert ma["loss"] == pytest.approx(mb["loss"], **tol)
        assert ma["z_loss"] == pytest.approx(mb["z_loss"], **tol)
        assert ma["grad_norm"] == pytest.approx(
            mb["grad_norm"], rel=1e-5 if precision == "fp32" else 2e-2
        )
    for pa, pb in zip(a.raw_model.parameters(), b.raw_model.parameters()):
        torch.testing.assert_close(
            pa,
            pb,
            **(dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=1e-2, atol=1e-3)),
        )
