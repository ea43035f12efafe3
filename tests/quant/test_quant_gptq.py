"""GPTQ against a slow plain implementation of the algorithm (the paper's explicit inverse-Hessian
elimination in float64, no Cholesky, no lazy batches), against RTN on its own objective, on a small
model, and its bad inputs."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.quant import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from lmstack.quant.gptq import (
    CalibrationError,
    HessianAccumulator,
    gptq_quantize,
    gptq_quantize_model,
    layer_error,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def layer(o=24, i=64, n=512, seed=0):
    """W (O, I) and H = 2XᵀX/n from correlated inputs with a few loud channels and one dead input."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(o, i, generator=g, dtype=torch.float64)
    A = torch.randn(i, i, generator=g, dtype=torch.float64) / i**0.5 + torch.eye(
        i, dtype=torch.float64
    )
    X = torch.randn(n, i, generator=g, dtype=torch.float64) @ A
    X[:, :3] *= 8.0  # outlier channels
    X[:, 5] = 0.0  # a dead input
    H = 2 * X.t() @ X / n
    return W, H


def reference_gptq(W, H, bits, G, act_order, damp=0.01):
    """Plain GPTQ: visit columns in order; e = (w_j − q(w_j)) / Hinv_jj; W −= e Hinv_j,: ; then remove
    column j from the inverse by Gaussian elimination, Hinv −= Hinv_:,j Hinv_j,: / Hinv_jj."""
    W, H = W.double().clone(), H.double().clone()
    O, I = W.shape
    dead = torch.diag(H) == 0
    for j in torch.nonzero(dead).flatten().tolist():
        H[j, j] = 1.0
        W[:, j] = 0.0
    order = sorted(range(I), key=lambda j: -float(H[j, j])) if act_order else list(range(I))
    Hinv = torch.linalg.inv(H + damp * torch.diag(H).mean() * torch.eye(I, dtype=torch.float64))
    Q = torch.zeros(O, I, dtype=torch.float64)
    if bits == 8:
        s8 = W.abs().amax(1) / 127
    else:
        S = torch.zeros(O, I // G, dtype=torch.float64)
        M = torch.zeros(O, I // G, dtype=torch.float64)

        def params(block):
            lo, hi = block.min(1).values, block.max(1).values
            s = (hi - lo) / 15
            return torch.where(s > 0, s, torch.ones_like(s)), lo

        if act_order:
            for g in range(I // G):
                S[:, g], M[:, g] = params(W[:, g * G : (g + 1) * G])
    for j in order:
        w = W[:, j]
        if bits == 8:
            q = torch.clamp(torch.round(w / s8), -127, 127)
            wq = q * s8
        else:
            g = j // G
            if not act_order and j % G == 0:
                S[:, g], M[:, g] = params(W[:, j : j + G])
            q = torch.clamp(torch.round((w - M[:, g]) / S[:, g]), 0, 15)
            wq = q * S[:, g] + M[:, g]
        Q[:, j] = q
        e = (w - wq) / Hinv[j, j]
        W -= torch.outer(e, Hinv[j])
        Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j]) / Hinv[j, j]
    if bits == 8:
        return Q, s8
    return Q, S, M


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_int4_equals_plain_reference(act_order):
    W, H = layer()
    q, s, lo = gptq_quantize(W, H, 4, 16, act_order=act_order, block_size=32)
    q_ref, s_ref, lo_ref = reference_gptq(W, H, 4, 16, act_order)
    assert (
        q.double() != q_ref
    ).sum() <= 2  # a rounding tie may fall either way in a different summation order
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lo.double(), lo_ref, rtol=1e-5, atol=1e-6)


def test_gptq_int8_equals_plain_reference():
    W, H = layer(seed=1)
    q, s = gptq_quantize(W, H, 8, None, block_size=16)
    q_ref, s_ref = reference_gptq(W, H, 8, None, False)
    assert q.dtype == torch.int8 and (q.double() != q_ref).sum() <= 2
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_error_at_most_rtn(seed, act_order):
    """On its objective tr((W − Ŵ) H (W − Ŵ)ᵀ), GPTQ beats round-to-nearest in the same format."""
    W, H = layer(seed=seed)
    W[:, 5] = 0.0  # the dead input's weight does not count in the objective either way
    rtn4 = dequantize_int4(*quantize_int4(W.float(), 16)).double()
    g4 = dequantize_int4(*gptq_quantize(W, H, 4, 16, act_order=act_order)).double()
    assert layer_error(W, g4, H) <= layer_error(W, rtn4, H)
    rtn8 = dequantize_int8(*quantize_int8(W.float())).double()
    g8 = dequantize_int8(*gptq_quantize(W, H, 8, None, act_order=act_order)).double()
    assert layer_error(W, g8, H) <= layer_error(W, rtn8, H)


def test_gptq_output_runs_on_the_int4_kernel_format():
    W, H = layer(o=32)
    q, s, lo = gptq_quantize(W, H, 4, 32)
    lin = Int4Linear(q, s, lo, compute_dtype=torch.float32)
    assert torch.equal(lin._codes(), q)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(lin(x), F.linear(x, dequantize_int4(q, s, lo)), atol=1e-4, rtol=1e-5)


def test_hessian_accumulator_is_2xtx_over_n():
    X = torch.randn(2, 7, 8, generator=torch.Generator().manual_seed(0))
    acc = HessianAccumulator(8)
    acc.add(X[0])
    acc.add(X[1])
    X2 = X.reshape(-1, 8).double()
    torch.testing.assert_close(acc.hessian(), 2 * X2.t() @ X2 / 14)


def test_gptq_bad_inputs():
    W, H = layer()
    with pytest.raises(ValueError, match="group_size=24"):
        gptq_quantize(W, H, 4, 24)
    with pytest.raises(CalibrationError, match=r"\(64, 64\)"):
        gptq_quantize(W, H[:32, :32], 4, 16)
    with pytest.raises(ValueError, match="bits=3"):
        gptq_quantize(W, H, 3, 16)
    with pytest.raises(CalibrationError, match="no calibration rows"):
        HessianAccumulator(8).hessian()
    model = small_model()
    with pytest.raises(CalibrationError, match="None"):
        gptq_quantize_model(model, None)
    with pytest.raises(CalibrationError, match="need at least 128"):
        gptq_quantize_model(model, torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(CalibrationError, match="integer"):
        gptq_quantize_model(model, torch.zeros(4, 64))
    with pytest.raises(ValueError, match="group_size=48"):
        gptq_quantize_model(model, calib_tokens(), group_size=48)


def small_model():
    cfg = ModelConfig(
        vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    return Transformer(cfg, seed=3).eval()


def calib_tokens(seed=0):
    return torch.randint(0, 128, (8, 48), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_model_beats_rtn_on_logits(bits):
    model = small_model()
    tokens = calib_tokens()
    held_out = calib_tokens(seed=1)
    with torch.no_grad():
        ref = model(held_out)
        rtn = quantize_model(copy.deepcopy(model), f"int{bits}", compute_dtype=torch.float32)(
            held_out
        )
        g = gptq_quantize_model(
            copy.deepcopy(model), tokens, bits=bits, group_size=32, compute_dtype=torch.float32
        )
        out = g(held_out)
    cls = Int4Linear if bits == 4 else Int8Linear
    assert sum(isinstance(m, cls) for m in g.modules()) == 2 * 7 + 1
    assert g.quantization == f"gptq-int{bits}"
    assert (out - ref).pow(2).mean() < (rtn - ref).pow(2).mean()


def test_shrink_grid_never_worse_and_clips_an_outlier():
    """The groups' range search (``shrink_grid``): its objective Σ|w − ŵ|^2.4, recomputed in numpy float64,
    is ≤ the min/max range's on every row, lower on the row with an outlier, and 5% lower in all."""
    import numpy as np

    from lmstack.quant.gptq import _int4_params

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g, dtype=torch.float64)
    w[0, 5] = 12.0  # an outlier in row 0

    def objective(s, lo):
        wn, sn, lon = w.numpy(), s.numpy()[:, None], lo.numpy()[:, None]
        q = np.clip(np.round((wn - lon) / sn), 0, 15)
        return (np.abs(q * sn + lon - wn) ** 2.4).sum(1)

    plain = objective(*_int4_params(w))
    searched = objective(*_int4_params(w, shrink_grid=20))
    assert (
        (searched <= plain + 1e-12).all()
        and searched[0] < plain[0]
        and searched.sum() < 0.95 * plain.sum()
    )
    q, s, lo = gptq_quantize(w.float(), torch.eye(64, dtype=torch.float64), 4, 32, shrink_grid=20)
    assert q.max() <= 15 and s.shape == (64, 2)


def _api_error_cases():
    from lmstack.quant.awq import awq_quantize_model, awq_search

    W, X = torch.randn(4, 32), torch.randn(8, 32)
    return {
        "gptq group_size=0": (lambda m, t: gptq_quantize_model(m, t, group_size=0), "group_size=0"),
        "gptq bits=3": (lambda m, t: gptq_quantize_model(m, t, bits=3), "bits=3"),
        "gptq damp=-1": (lambda m, t: gptq_quantize_model(m, t, damp=-1), "damp=-1"),
        "gptq id = V": (lambda m, t: gptq_quantize_model(m, t + 64), "id 64 at .* 0..63"),
        "gptq id < 0": (lambda m, t: gptq_quantize_model(m, t - 1), "id -1 at .* 0..63"),
        "gptq no blocks": (lambda m, t: gptq_quantize_model(_no_blocks(m), t), "no block linears"),
        "awq group_size=0": (lambda m, t: awq_quantize_model(m, t, group_size=0), "group_size=0"),
        "awq grid=0": (lambda m, t: awq_quantize_model(m, t, grid=0), "grid=0"),
        "awq id = V": (lambda m, t: awq_quantize_model(m, t + 64), "id 64 at .* 0..63"),
        "awq no blocks": (lambda m, t: awq_quantize_model(_no_blocks(m), t), "no block linears"),
        "awq_search grid=0": (lambda m, t: awq_search([W], X, grid=0), "grid=0"),
        "awq_search group_size=0": (lambda m, t: awq_search([W], X, group_size=0), "group_size=0"),
        "awq_search no weights": (lambda m, t: awq_search([], X), "at least one"),
    }


def _no_blocks(model):
    model.blocks = torch.nn.ModuleList()
    return model


@pytest.mark.parametrize("case", list(_api_error_cases()))
def test_quantiser_api_errors_name_the_argument(case):
    """Issue #31: ZeroDivisionError (group_size=0, grid=0), IndexError (out-of-vocabulary calibration ids),
    "max() arg is an empty sequence" (no block linears): each a ValueError naming the argument or value,
    raised before any calibration work. Ids 0..63 shifted by +1 put the largest at V = 64; by -1, the
    smallest at -1."""
    fn, message = _api_error_cases()[case]
    cfg = dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, vocab_size=64, max_seq_len=64)
    model = Transformer(ModelConfig.from_dict(cfg), seed=0).eval()
    tokens = torch.arange(128).reshape(4, 32) % 64  # ids 0..63, each twice
    with pytest.raises(ValueError, match=message):
        fn(model, tokens)
