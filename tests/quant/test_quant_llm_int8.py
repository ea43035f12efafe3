"""LLM.int8() against the paper's decomposition written plainly in numpy float64, its outlier statistics, and
bitsandbytes' own Linear8bitLt where its CPU backend runs."""

import importlib.util

import numpy as np
import pytest
import torch

from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.quant import quantize_int8
from lmstack.quant.llm_int8 import LLMInt8Linear, llm_int8_model, outlier_stats

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(x, W, threshold=6.0):
    """C_f16 = X^C W^C + diag(c) (X_i8 W_i8ᵀ) diag(s) / 127², with Ŵ^C from the int8 weights."""
    x, W = np.asarray(x, np.float64), np.asarray(W, np.float32).astype(np.float64)
    sw = np.abs(W).max(axis=1) / 127.0
    sw[sw == 0] = 1.0
    Wq = np.clip(np.round(np.asarray(W, np.float32) / sw.astype(np.float32)[:, None]), -127, 127)
    C = np.abs(x).max(axis=0) > threshold
    xr = x.copy()
    xr[:, C] = 0.0
    cx = np.abs(xr).max(axis=1) / 127.0
    cx[cx == 0] = 1.0
    xq = np.clip(np.round(xr / cx[:, None]), -127, 127)
    y = (xq @ Wq.T) * cx[:, None] * sw[None, :]
    y += x[:, C] @ (Wq[:, C] * sw[:, None]).T
    return y, C


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 96, generator=g)
    x[:, [7, 50]] *= 12.0  # outlier features: beyond 6.0 in some row
    x[2, 80] = -9.0
    W = torch.randn(40, 96, generator=g) * 0.1
    return x, W


def test_llm_int8_equals_plain_decomposition():
    x, W = inputs()
    lin = LLMInt8Linear(*quantize_int8(W), outlier_dtype=torch.float32)
    y_ref, C = reference(x.numpy(), W.numpy())
    assert set(np.nonzero(C)[0]) == {7, 50, 80}
    np.testing.assert_allclose(lin(x).numpy(), y_ref, rtol=1e-4, atol=1e-4)
    lin16 = LLMInt8Linear(*quantize_int8(W), outlier_dtype=torch.float16)  # the 16-bit outlier part
    np.testing.assert_allclose(lin16(x).numpy(), y_ref, rtol=2e-2, atol=2e-2)
    assert lin.outlier_hits.sum() == 3 and lin.calls == 1 and lin.rows == 5


def test_without_outliers_it_is_plain_vectorwise_int8_and_better_than_int8_with_them():
    x, W = inputs(1)
    lin = LLMInt8Linear(*quantize_int8(W), outlier_dtype=torch.float32)
    plain = LLMInt8Linear(*quantize_int8(W), threshold=float("inf"), outlier_dtype=torch.float32)
    y = (x.double() @ W.double().t()).numpy()
    err_mixed = np.abs(lin(x).double().numpy() - y).mean()
    err_plain = np.abs(plain(x).double().numpy() - y).mean()
    assert err_mixed < err_plain  # outlier columns in int8 spoil every row's scale
    y_ref, C = reference(x.numpy(), W.numpy(), threshold=float("inf"))
    assert not C.any()
    np.testing.assert_allclose(plain(x).numpy(), y_ref, rtol=1e-4, atol=1e-4)


def test_model_swap_and_outlier_stats():
    cfg = ModelConfig(
        vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    model = Transformer(cfg, seed=3).eval()
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        llm_int8_model(model, threshold=1.5)
        out = model(tokens)
    stats = outlier_stats(model)
    assert len(stats) == 2 * 7 + 1 and all(s["calls"] == 1 and s["rows"] == 24 for s in stats)
    assert any(s["outlier_columns"] > 0 for s in stats)
    assert (
        torch.nn.functional.cosine_similarity(out.flatten(0, 1), ref.flatten(0, 1), -1).min()
        > 0.999
    )


def _bnb_cpu():
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        import bitsandbytes as bnb

        lin = bnb.nn.Linear8bitLt(8, 8, bias=False, has_fp16_weights=False, threshold=6.0)
        lin.weight = bnb.nn.Int8Params(
            torch.randn(8, 8), requires_grad=False, has_fp16_weights=False
        )
        lin = lin.to("cpu")
        lin(torch.randn(2, 8))
        return bnb
    except Exception:  # noqa: BLE001 — any failure means the CPU backend does not run here
        return None


@pytest.mark.skipif(_bnb_cpu() is None, reason="bitsandbytes' CPU backend does not run here")
def test_against_bitsandbytes_linear8bitlt():
    import bitsandbytes as bnb

    x, W = inputs(2)
    lin = bnb.nn.Linear8bitLt(96, 40, bias=False, has_fp16_weights=False, threshold=6.0)
    lin.weight = bnb.nn.Int8Params(W.clone(), requires_grad=False, has_fp16_weights=False)
    lin = lin.to("cpu")
    with torch.no_grad():
        y_bnb = lin(x).float()
    ours = LLMInt8Linear(*quantize_int8(W))(x)
    y = x @ W.t()
    # the same decomposition up to rounding: both within the int8 error of the exact product
    assert (
        ours - y_bnb
    ).abs().max() < 0.01 * y.abs().max()  # measured 0.47% (bitsandbytes 0.50.2, CPU)
