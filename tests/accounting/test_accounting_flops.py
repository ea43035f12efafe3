"""FLOPs (Book of LLMs §1.6 “forward and backward FLOPs”, §1.9) against torch's FlopCounterMode and hand-computed values."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from lmstack.accounting.flops import (
    attention_score_flops,
    attention_share,
    backward_flops,
    forward_flops,
    layer_forward_flops,
    mfu,
    seed_forward_flops,
    six_nd,
    six_nd_vs_exact,
    training_step_flops,
)
from lmstack.accounting.params import total_params
from lmstack.model.config import ModelConfig

# Matmul FLOPs are integers; FlopCounterMode counts 2·m·n·k per (m,k)x(k,n) product, the same
# convention as CS336 notes "张量计算". Tolerance: exact (0) for matmul FLOPs.
SMALL = [
    ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160),  # GQA
    ModelConfig(
        vocab_size=50, d_model=48, n_layers=3, n_heads=6, n_kv_heads=1, d_ff=96, tie_embeddings=True
    ),  # MQA
    ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=72, qkv_bias=True
    ),  # Qwen2-like
    ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=24, d_ff=40
    ),  # H ≠ D/N
]


def _count(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


@pytest.mark.parametrize("cfg", SMALL, ids=["gqa", "mqa-tied", "qkv-bias", "head_dim"])
def test_forward_equals_flop_counter_on_hf_model(cfg):
    from accounting_hf_ref import hf_model

    torch.manual_seed(0)
    model = hf_model(cfg, attn="eager").eval()
    B, S = 2, 11
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    with torch.no_grad():
        counted = _count(lambda: model(ids))
    assert counted == forward_flops(cfg, B, S)


def test_backward_is_twice_forward_on_hf_model():
    # Book of LLMs §1.6 “forward and backward FLOPs”: backward = 2 × forward (weight and input gradients, one matmul each).
    from accounting_hf_ref import hf_model

    cfg = SMALL[0]
    model = hf_model(cfg, attn="eager")
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with FlopCounterMode(display=False) as fc:
        out = model(ids).logits
        fwd = fc.get_total_flops()
        out.float().sum().backward()
        total = fc.get_total_flops()
    assert fwd == forward_flops(cfg, 2, 9)
    assert total - fwd == backward_flops(fwd)
    assert total == training_step_flops(cfg, 2, 9)


@pytest.mark.parametrize("cfg", SMALL[:2], ids=["gqa", "mqa-tied"])
def test_forward_equals_flop_counter_on_lmstack_model(cfg):
    from lmstack.model.seam import ReferenceAttention
    from lmstack.model.transformer import Transformer

    # The reference backend spells attention as explicit matmuls, which FlopCounterMode counts.
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    model.set_attention(ReferenceAttention())
    B, S = 2, 11
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    with torch.no_grad():
        counted = _count(lambda: model(ids))
    assert counted == forward_flops(cfg, B, S)


@settings(max_examples=50, deadline=None)
@given(
    B=st.integers(1, 8),
    S=st.integers(1, 4096),
    H=st.sampled_from([16, 64, 128]),
    N=st.integers(1, 16),
    L=st.integers(1, 48),
    V=st.integers(1, 200_000),
)
def test_seed_closed_form(B, S, H, N, L, V):
    # Book of LLMs §1.6 “forward and backward FLOPs”: 2LBSD(12D + 2S) + 2BSDV for MHA with F = 8/3·D (D = 3·k so F is an integer).
    D = 3 * H * N
    cfg = ModelConfig(
        vocab_size=V, d_model=D, n_layers=L, n_heads=N, head_dim=D // N, d_ff=8 * D // 3
    )
    assert forward_flops(cfg, B, S) == seed_forward_flops(B, S, D, L, V)
    assert layer_forward_flops(cfg, B, S) == 2 * B * S * D * (12 * D + 2 * S)


def test_llama2_7b_hand_count():
    # By hand, B=1, S=2048: per layer 2·S·D·(D + D + D + D) + 4·S²·D + 6·S·D·F, plus 2·S·D·V.
    D, F, L, V, S = 4096, 11008, 32, 32000, 2048
    per_layer = 8 * S * D * D + 4 * S * S * D + 6 * S * D * F
    expected = L * per_layer + 2 * S * D * V
    assert forward_flops(ModelConfig.from_preset("llama2-7b"), 1, S) == expected


def test_decode_step_flops():
    # T = 1 query against S = 1000 cached keys, Llama-3-8B (GQA), by hand.
    cfg = ModelConfig.from_preset("llama3-8b")
    D, F, L, V, KH, S = 4096, 14336, 32, 128256, 1024, 1000
    per_layer = 2 * D * D * 2 + 2 * 2 * D * KH + 4 * S * D + 6 * D * F
    assert forward_flops(cfg, 1, S, T=1) == L * per_layer + 2 * D * V


def test_sliding_window_caps_keys():
    # Book of LLMs §1.9 “sliding-window and sparse attention”: each query sees at most W keys: O(nW) instead of O(n²).
    cfg = ModelConfig.from_preset("mistral-7b")
    assert attention_score_flops(cfg, 1, 8192, 8192, window=4096) == attention_score_flops(
        cfg, 1, 8192, 4096
    )
    assert attention_score_flops(cfg, 1, 100, 100, window=4096) == attention_score_flops(
        cfg, 1, 100, 100
    )


def test_attention_share_grows_with_S():
    cfg = ModelConfig.from_preset("llama2-7b")
    shares = [attention_share(cfg, 1, s) for s in (256, 1024, 4096, 16384, 65536)]
    assert shares == sorted(shares) and shares[0] < 0.02 and shares[-1] > 0.5
    # hand: share = 4LS²D / forward
    S = 4096
    att = 32 * 4 * S * S * 4096
    assert attention_share(cfg, 1, S) == pytest.approx(att / forward_flops(cfg, 1, S), rel=1e-12)


def test_six_nd_vs_exact():
    cfg = ModelConfig.from_preset("llama2-7b")
    r = six_nd_vs_exact(cfg, 4, 2048)
    assert r["six_nd"] == 6 * total_params(cfg) * 4 * 2048 == six_nd(total_params(cfg), 8192)
    assert r["exact"] == 3 * forward_flops(cfg, 4, 2048)
    # the exact count exceeds 6ND by the attention term minus the embedding's 6·V·D·BS
    D, L, S, V = 4096, 32, 2048, 32000
    extra = 3 * L * 4 * 4 * S * S * D - 6 * V * D * 4 * S - 6 * (L * 2 * D + D) * 4 * S
    assert r["exact"] - r["six_nd"] == extra


def test_mfu_hand():
    # 6ND for a 7B model on 1M tokens in 100 s on 8 H100s at 989.4 TFLOP/s.
    flops = 6 * 7e9 * 1e6
    assert mfu(flops, 100.0, 989.4e12, n_devices=8) == pytest.approx(flops / 100 / (8 * 989.4e12))
    assert mfu(flops, 100.0, 989.4e12, 8) == pytest.approx(0.0530625, rel=1e-5)
    with pytest.raises(ValueError, match="step_time_s=0"):
        mfu(1.0, 0, 1.0)


def test_decode_step_equals_flop_counter_on_lmstack_model():
    # One decoding step (T = 1) against S cached keys, logits for the last position only.
    from lmstack.inference.kv_cache import KVCache
    from lmstack.model.seam import ReferenceAttention
    from lmstack.model.transformer import Transformer

    cfg = SMALL[0]
    model = Transformer(cfg).eval()
    model.set_attention(ReferenceAttention())  # explicit matmuls, which FlopCounterMode counts
    B, S = 2, 9
    cache = KVCache(cfg, B, S)
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    with torch.no_grad():
        model(ids[:, :-1], positions=torch.arange(S - 1), kv_cache=cache)
        counted = _count(
            lambda: model(ids[:, -1:], positions=torch.tensor([S - 1]), kv_cache=cache, last_n=1)
        )
    assert counted == forward_flops(cfg, B, S, T=1)
