"""AWQ: the scale search is never worse than int4 RTN on its objective (both errors recomputed here as
plain ‖X Ŵᵀ − X Wᵀ‖² in float64), folding keeps the float function, and bad calibration input."""

import copy

import pytest
import torch

from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.quant import Int4Linear, dequantize_int4, quantize_int4, quantize_model
from lmstack.quant.awq import ScaledInputLinear, awq_quantize_model, awq_search
from lmstack.quant.gptq import CalibrationError

pytestmark = pytest.mark.usefixtures("one_thread")


def data(seed, loud=10.0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(400, 64, generator=g, dtype=torch.float64)
    X[:, [2, 17, 40]] *= loud  # activation outlier channels
    Ws = [
        torch.randn(48, 64, generator=g, dtype=torch.float64),
        torch.randn(16, 64, generator=g, dtype=torch.float64),
    ]
    return X, Ws


def output_error(X, Ws, s):
    total = 0.0
    for W in Ws:
        w_hat = dequantize_int4(*quantize_int4((W * s).float(), 16)).double() / s
        total += float(((X @ w_hat.t()) - X @ W.t()).pow(2).sum())
    return total


@pytest.mark.parametrize("seed,loud", [(0, 10.0), (1, 3.0), (2, 1.0)])
def test_awq_never_worse_than_rtn(seed, loud):
    X, Ws = data(seed, loud)
    s, alpha, losses = awq_search(Ws, X, group_size=16, grid=10)
    rtn = sum(
        float((X @ (dequantize_int4(*quantize_int4(W.float(), 16)).double() - W).t()).pow(2).sum())
        for W in Ws
    )
    assert output_error(X, Ws, torch.ones(64, dtype=torch.float64)) == pytest.approx(rtn)
    assert output_error(X, Ws, s) <= rtn * (1 + 1e-9)
    assert losses[0.0] == pytest.approx(rtn, rel=1e-9)  # α = 0 is RTN
    assert output_error(X, Ws, s) == pytest.approx(min(losses.values()), rel=1e-9)
    if loud >= 10:
        assert alpha > 0 and output_error(X, Ws, s) < 0.9 * rtn  # loud channels: scaling pays


def test_awq_scale_is_normalised_mean_abs_power():
    X, Ws = data(0)
    s, alpha, _ = awq_search(Ws, X, group_size=16, grid=10)
    m = X.abs().mean(0) ** alpha
    torch.testing.assert_close(s, m / (m.max() * m.min()).sqrt())


def test_scaled_input_linear():
    W = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    s = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5
    lin = ScaledInputLinear(
        Int4Linear(*quantize_int4(W * s, 32), compute_dtype=torch.float32), 1 / s
    )
    x = torch.randn(3, 64)
    ref = (x / s) @ dequantize_int4(*quantize_int4(W * s, 32)).t()
    torch.testing.assert_close(lin(x), ref, atol=1e-4, rtol=1e-4)


def small_model():
    cfg = ModelConfig(
        vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    model = Transformer(cfg, seed=3).eval()
    with torch.no_grad():  # trained models have loud residual channels; give this one some
        model.embed.weight[:, [3, 30]] *= 20
    return model


def test_awq_model_folds_scales_and_beats_rtn():
    model = small_model()
    tokens = torch.randint(0, 128, (8, 48), generator=torch.Generator().manual_seed(0))
    held = torch.randint(0, 128, (4, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(held)
        rtn = quantize_model(copy.deepcopy(model), "int4", compute_dtype=torch.float32)(held)
        q = awq_quantize_model(
            copy.deepcopy(model), tokens, group_size=32, grid=10, compute_dtype=torch.float32
        )
        out = q(held)
    assert (
        q.quantization == "awq-int4" and len(q.awq_alphas) == 2 * 4 + 1
    )  # qkv, o, gate+up, down; head
    assert isinstance(q.blocks[0].attn.q_proj, Int4Linear)  # folded into attn_norm's γ
    assert isinstance(q.blocks[0].ffn.down_proj, ScaledInputLinear)  # kept as an input scale
    assert (out - ref).pow(2).mean() <= (rtn - ref).pow(2).mean()


def test_awq_bad_calibration():
    with pytest.raises(CalibrationError, match="need at least 128"):
        awq_quantize_model(small_model(), torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(CalibrationError, match="None"):
        awq_quantize_model(small_model(), None)
    X, Ws = data(0)
    with pytest.raises(CalibrationError, match="no"):
        awq_search(Ws, X[:0])
    with pytest.raises(ValueError, match="group_size=24"):
        awq_search(Ws, X, group_size=24)


def test_awq_alpha_grid_and_optimum_equal_a_hand_search():
    """The searched α are exactly {k/grid : k = 0..grid}; α* and s are those of a grid search written here
    (s = mean|x|^α / √(max · min), error ‖X (Q(W s)/s − W)ᵀ‖² in float64)."""
    X, Ws = data(0)
    grid = 10
    s, alpha, losses = awq_search(Ws, X, group_size=16, grid=grid)
    assert sorted(losses) == pytest.approx([k / grid for k in range(grid + 1)], abs=0)
    m = X.abs().mean(0)
    errs = {}
    for k in range(grid + 1):
        sk = m ** (k / grid)
        errs[k / grid] = output_error(X, Ws, sk / (sk.max() * sk.min()).sqrt())
    best = min(errs, key=errs.get)
    assert alpha == best and 0 < alpha < 1
    assert [losses[a] for a in sorted(losses)] == pytest.approx(
        [errs[a] for a in sorted(errs)], rel=1e-9
    )
