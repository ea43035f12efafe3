"""int8 / int4 weight-only quantisation against reference formulas written in numpy, and the
quantised linears against F.linear on the dequantised weight."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear
from lmstack.model.transformer import Transformer
from lmstack.quant import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantized_weight_bytes,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def weight(o=96, i=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, i, generator=g) * torch.rand(o, 1, generator=g)  # rows of different ranges
    w[3] = 0.0  # an all-zero row
    return w


def test_int8_matches_numpy_formula_and_error_bound():
    w = weight()
    q, s = quantize_int8(w)
    wn = w.numpy().astype(np.float64)
    s_ref = np.abs(wn).max(axis=1) / 127.0
    s_ref[s_ref == 0] = 1.0
    q_ref = np.clip(np.round(wn / s_ref[:, None]), -127, 127)
    np.testing.assert_allclose(s.numpy(), s_ref, rtol=1e-6)
    assert (
        q.numpy().astype(np.int64) != q_ref
    ).sum() <= 2  # fp32 vs fp64 division: a rare half-way tie
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()  # |W − Ŵ| ≤ s/2
    assert dequantize_int8(q, s)[3].abs().max() == 0


def test_int4_matches_numpy_formula_and_error_bound():
    w = weight()
    G = 32
    q, s, lo = quantize_int4(w, G)
    wn = w.numpy().astype(np.float64).reshape(96, 128 // G, G)
    lo_ref, hi_ref = wn.min(-1), wn.max(-1)
    s_ref = (hi_ref - lo_ref) / 15.0
    s_ref[s_ref == 0] = 1.0
    q_ref = np.clip(np.round((wn - lo_ref[..., None]) / s_ref[..., None]), 0, 15).reshape(96, 128)
    np.testing.assert_allclose(s.numpy(), s_ref, rtol=1e-5)
    np.testing.assert_allclose(lo.numpy(), lo_ref, rtol=1e-6)
    assert (q.numpy().astype(np.int64) != q_ref).sum() <= 2
    assert q.max() <= 15
    deq = dequantize_int4(q, s, lo)
    bound = np.repeat(s.numpy(), G, axis=1) / 2 + 1e-6
    assert ((deq - w).abs().numpy() <= bound).all()
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(w, 48)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_linear_on_dequantized_weight(bias):
    w = weight()
    b = torch.randn(96) if bias else None
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(1))
    exact = Int8Linear(*quantize_int8(w), b, compute_dtype=torch.float32)
    ref = F.linear(x, dequantize_int8(*quantize_int8(w)), b)
    torch.testing.assert_close(exact(x), ref, atol=1e-4, rtol=1e-5)
    fast = Int8Linear(*quantize_int8(w), b)  # the CPU kernel's fast path
    assert fast(x).dtype == torch.float32
    if fast.kernel == "aten":  # torch's kernel: bf16 activations
        ref_bf16 = F.linear(x.bfloat16().float(), dequantize_int8(*quantize_int8(w)), b)
        torch.testing.assert_close(fast(x), ref_bf16, atol=0.05, rtol=0.02)
    else:  # lmstack's AVX2 kernel: one int8 term per group of G inputs, each off by <= s_x,g / 2
        G = fast.act_group
        xg = x.double().reshape(-1, 128 // G, G)
        half_step = (xg.abs().amax(-1, keepdim=True) / 127 / 2).expand_as(xg).reshape(-1, 128)
        bound = half_step @ dequantize_int8(*quantize_int8(w)).double().abs().T  # (rows, O)
        err = (fast(x).double().reshape(-1, 96) - ref.double().reshape(-1, 96)).abs()
        assert bool((err <= bound * 1.001 + 1e-5).all()) and float(err.max()) > 0


def test_int8_linear_many_rows_dequantizes(monkeypatch):
    monkeypatch.setenv(
        "LMSTACK_QUANT_GEMM_ROWS", "never"
    )  # not oneDNN's int8 GEMM (test_quant_int8_onednn)
    monkeypatch.setenv(
        "LMSTACK_INT8_KERNEL", "aten"
    )  # torch's kernel's path (AVX2's: test_quant_int8_avx2)
    w = weight()
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(3))  # >= DEQUANT_ROWS rows
    m = Int8Linear(*quantize_int8(w))
    torch.testing.assert_close(
        m(x), F.linear(x, dequantize_int8(*quantize_int8(w))), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_equals_linear_on_dequantized_weight(compute_dtype):
    w = weight()
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    q, s, lo = quantize_int4(w, 32)
    m = Int4Linear(
        q, s, lo, compute_dtype=compute_dtype, kernel="aten"
    )  # torch's kernel (VNNI: test_quant_int4_vnni)
    assert torch.equal(m._codes(), q)  # the packed layout holds exactly the codes
    ref = F.linear(x.to(compute_dtype).float(), dequantize_int4(q, s, lo))
    tol = (
        dict(atol=1e-4, rtol=1e-5) if compute_dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    )
    torch.testing.assert_close(m(x), ref, **tol)
    torch.testing.assert_close(m.dequantized_weight(), dequantize_int4(q, s, lo))


def small_model(tie=True):
    cfg = ModelConfig(
        vocab_size=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        max_seq_len=64,
        tie_embeddings=tie,
    )
    return Transformer(cfg, seed=3).eval()


@pytest.mark.parametrize("method,min_cos", [("int8", 0.9999), ("int4", 0.99)])
@pytest.mark.parametrize("tie", [True, False])
def test_quantize_model_swaps_linears_and_keeps_logits(method, min_cos, tie):
    model = small_model(tie)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        emb = model.embed.weight.clone()
        quantize_model(model, method)
        out = model(tokens)
    cls = Int8Linear if method == "int8" else Int4Linear
    n_linear = sum(isinstance(m, Linear) for m in model.modules())
    assert n_linear == 0 and sum(isinstance(m, cls) for m in model.modules()) == 2 * 7 + 1
    assert torch.equal(model.embed.weight, emb)  # the lookup table stays in floating point
    cos = F.cosine_similarity(out.flatten(0, 1), ref.flatten(0, 1), dim=-1)
    assert cos.min() > min_cos


def test_quantize_model_without_lm_head_and_bad_method():
    model = small_model()
    quantize_model(model, "int8", lm_head=False)
    assert model.lm_head is None
    with pytest.raises(ValueError, match="int3"):
        quantize_model(small_model(), "int3")
    with pytest.raises(ValueError, match="fp8"):
        quantize_model(small_model(), "int4", lm_head="fp8")
    mixed = quantize_model(small_model(), "int4", lm_head="int8")
    assert isinstance(mixed.lm_head, Int8Linear) and isinstance(
        mixed.blocks[0].ffn.up_proj, Int4Linear
    )
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model(mixed, "int8")


def test_quantized_weight_bytes_worked_number(monkeypatch):
    # D = 64, F = 128, K·H = 32, L = 2, V = 128, tied; int8 with bf16 scales (2 bytes per output row): torch's
    # kernel's layout (lmstack's AVX2 kernel keeps fp32 scales)
    monkeypatch.setenv("LMSTACK_INT8_KERNEL", "aten")
    model = quantize_model(small_model(), "int8")
    per_layer = (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 128) + 2 * (
        64 + 32 + 32 + 64 + 128 + 128 + 64
    )
    norms = 4 * (2 * 64 * 2 + 64)  # fp32 γ: two per layer + the final one
    lm_head = 128 * 64 + 2 * 128
    assert quantized_weight_bytes(model) == 2 * per_layer + norms + lm_head


def test_saving_a_quantised_model_is_refused_with_a_clear_error(tmp_path):
    """Quantised weights are buffers: a float checkpoint would silently miss them, so saving refuses."""
    from lmstack.model.hf import save_hf
    from lmstack.model.io import save_pretrained
    from lmstack.quant import quantize_model

    cfg = ModelConfig(
        vocab_size=64, d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=128, max_seq_len=32
    )
    model = quantize_model(Transformer(cfg), "int8")
    for save in (save_pretrained, save_hf):
        with pytest.raises(ValueError, match="quantised linears"):
            save(model, tmp_path / save.__name__)
        assert not (tmp_path / save.__name__ / "model.safetensors").exists()


def test_int4_fallback_is_logged_and_exact(caplog):
    """O = 40 is not a multiple of 16: the CPU kernel cannot take it; the layer says so and dequantises."""
    import logging

    import lmstack.quant.int4 as int4

    int4._logged.clear()
    w = weight(o=40)
    q, s, lo = quantize_int4(w, 32)
    with caplog.at_level(logging.WARNING, logger="lmstack.quant.int4"):
        m = Int4Linear(q, s, lo, compute_dtype=torch.float32)
    assert not m.use_kernel and "out_features=40 is not a multiple of 16" in caplog.text
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(m(x), F.linear(x, dequantize_int4(q, s, lo)), atol=1e-5, rtol=1e-5)
    assert torch.equal(m._codes(), q)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_mla_models_quantise_and_decode(method):
    """Issue #31: `--dtype int8/int4` crashed every MLA model ('Int8Linear' object has no attribute 'weight':
    the absorbed form reads kv_b_proj as a matrix). kv_b_proj stays float; the quantised model's logits and its
    cached greedy decode equal a float model carrying the dequantised weights (the fake-quant reference)."""
    import copy

    from lmstack.inference import SamplingParams, generate
    from lmstack.quant import quantize_model

    cfg = ModelConfig(
        vocab_size=80,
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        head_dim=16,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_seq_len=64,
    )
    model = Transformer(cfg, seed=0).eval()
    q = quantize_model(
        copy.deepcopy(model), method, lm_head=False, group_size=32, compute_dtype=torch.float32
    )
    ref = copy.deepcopy(model)
    qmods = dict(q.named_modules())
    n_quant = 0
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if (
                isinstance(mod, Linear)
                and name.startswith("blocks.")
                and hasattr(qmods[name], "dequantized_weight")
            ):
                mod.weight.copy_(qmods[name].dequantized_weight(torch.float32))
                n_quant += 1
    assert n_quant > 0 and not hasattr(qmods["blocks.0.attn.kv_b_proj"], "dequantized_weight")
    x = torch.randint(0, 80, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(q(x), ref(x), rtol=1e-4, atol=1e-4)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    assert list(generate(q, x[0].tolist(), greedy)) == list(generate(ref, x[0].tolist(), greedy))
