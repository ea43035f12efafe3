"""Arithmetic intensity (CS336 notes "计算强度分析", "推理时注意力开销") and hardware ridge points."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmstack.accounting.hardware import get_hardware, ridge_point
from lmstack.accounting.intensity import (
    attention_flops_bytes,
    attention_intensity,
    ffn_flops_bytes,
    ffn_intensity,
    phase_verdicts,
    seed_attention_intensity,
    seed_ffn_intensity,
)
from lmstack.model.config import ModelConfig


def _mha(D, N=8):
    return ModelConfig(vocab_size=10, d_model=D, n_layers=1, n_heads=N, d_ff=4 * D)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 512), T=st.integers(1, 8192), k=st.integers(1, 64))
def test_ffn_matches_seed(B, T, k):
    D = 64 * k
    cfg = _mha(D)
    f, b = ffn_flops_bytes(cfg, B, T)
    assert f == 24 * B * T * D * D  # seed: 24BTD² FLOPs
    assert b == 20 * B * T * D + 24 * D * D  # seed: 20BTD + 24D² bytes
    assert ffn_intensity(cfg, B, T) == pytest.approx(seed_ffn_intensity(B, T, D), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 256), T=st.integers(1, 4096), S=st.integers(1, 8192), k=st.integers(1, 64))
def test_attention_matches_seed(B, T, S, k):
    D = 64 * k
    cfg = _mha(D)
    f, b = attention_flops_bytes(cfg, B, T, S)
    assert f == 6 * B * T * D * D + 4 * B * T * S * D  # seed FLOPs
    assert b == 8 * B * T * D + 6 * D * D + 4 * B * S * D  # seed bytes
    assert attention_intensity(cfg, B, T, S) == pytest.approx(
        seed_attention_intensity(B, T, S, D), rel=1e-12
    )


def test_limits_from_the_seed():
    D = 5120
    # prefill FFN intensity tends to 1.2D for large BT
    assert seed_ffn_intensity(10**9, 1, D) == pytest.approx(1.2 * D, rel=1e-4)
    # decode attention (T = 1) tends to 1 however large S is
    cfg = _mha(D, 40)
    assert attention_intensity(cfg, 64, 1, 10**8) == pytest.approx(1.0, rel=1e-3)
    # B=1 decode FFN: 6D / (5 + 6D) ≈ 1
    assert ffn_intensity(cfg, 1, 1) == pytest.approx(6 * D / (5 + 6 * D))


def test_gqa_reduces_decode_bytes():
    # CS336 notes: GQA cuts the KV-cache traffic by the group size.
    mha = ModelConfig(vocab_size=10, d_model=4096, n_layers=1, n_heads=32, d_ff=14336)
    gqa = mha.replace(n_kv_heads=8)
    assert attention_intensity(gqa, 16, 1, 8192) > 3 * attention_intensity(mha, 16, 1, 8192)


def test_h100_ridge():
    # CS336 notes: 9.89e14 / 3.35e12 ≈ 295 FLOPs/byte
    assert ridge_point(9.89e14, 3.35e12) == pytest.approx(295.2, abs=0.1)
    assert get_hardware("h100").ridge_point("bf16") == pytest.approx(295, abs=1)
    # CS336 notes also quotes ~156 for the A100 "满载" intensity (312 TF / 2.0 TB/s)
    assert get_hardware("a100-80gb").ridge_point("bf16") == pytest.approx(153, abs=4)


def test_verdicts_llama2_13b_h100():
    v = phase_verdicts(ModelConfig.from_preset("llama2-13b"), get_hardware("h100"), 1, 1024)
    assert v["prefill"]["ffn"] == v["prefill"]["attention"] == "compute-bound"
    assert v["decode"]["ffn"] == v["decode"]["attention"] == "memory-bound"
