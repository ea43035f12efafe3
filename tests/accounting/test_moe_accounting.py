"""MoE / MLA accounting: total vs active parameters vs the models themselves and the published totals,
FLOPs vs torch's FLOP counter, MLA KV bytes vs the latent cache, all-to-all bytes by hand."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmstack.accounting import comm, flops, memory, params
from lmstack.accounting.hardware import get_hardware
from lmstack.accounting.plan import build_plan
from lmstack.inference.kv_cache import LatentKVCache
from lmstack.kernels.backends import attention_impl
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer

MOE_PRESETS = [
    "mixtral-8x7b",
    "olmoe-1b-7b",
    "qwen1.5-moe-a2.7b",
    "deepseek-v2-lite",
    "deepseek-v3",
]


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_total_params_equal_the_model(name):
    c = ModelConfig.from_preset(name)
    with torch.device("meta"):
        m = Transformer(c)
    assert params.total_params(c) == sum(p.numel() for p in m.parameters())


# Published figures (model cards / papers), in billions. DeepSeek count the activated parameters without the
# input embedding table; the others count it.
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9, False),
    "olmoe-1b-7b": (6.9, 1.3, False),
    "qwen1.5-moe-a2.7b": (14.3, 2.7, False),
    "deepseek-v2-lite": (15.7, 2.4, True),
    "deepseek-v3": (671.0, 37.0, True),
}


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_total_and_active_vs_published(name):
    c = ModelConfig.from_preset(name)
    total, active, minus_embedding = PUBLISHED[name]
    got_active = params.active_params(c) - (params.embedding_params(c) if minus_embedding else 0)
    assert params.total_params(c) / 1e9 == pytest.approx(total, abs=0.05 if total < 100 else 0.5)
    # published figures are rounded (V2-Lite: 2.45B here is its "2.4B")
    assert got_active / 1e9 == pytest.approx(active, abs=0.06 if active < 10 else 0.6)


def test_seed_routed_active_shared_table_rows():
    rows = {n: params.moe_summary(ModelConfig.from_preset(n)) for n in MOE_PRESETS}
    assert [
        (rows[n]["routed"], rows[n]["active"], rows[n]["shared"])
        for n in ("mixtral-8x7b", "olmoe-1b-7b", "deepseek-v3")
    ] == [(8, 2, 0), (64, 8, 0), (256, 8, 1)]  # the seed's table
    assert (
        rows["olmoe-1b-7b"]["fine_grained_ratio"] == 1.0
    )  # OLMoE: F = F_e = 1024 (its table's 1/8 is vs 8·F)


def _tiny_moe(**kw):
    base = dict(
        vocab_size=64,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        n_experts=4,
        n_experts_per_token=2,
        d_ff_expert=16,
        n_shared_experts=1,
        moe_first_dense=1,
    )
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("mla", [False, True])
def test_forward_flops_match_torch_flop_counter(mla):
    extra = (
        dict(
            kv_lora_rank=12,
            q_lora_rank=10,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=8,
            rope_layout="interleaved",
        )
        if mla
        else {}
    )
    c = _tiny_moe(**extra)
    m = Transformer(c)
    m.set_attention(attention_impl("reference"))  # explicit matmuls, which torch's counter sees
    B, S = 2, 10
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m(torch.randint(0, 64, (B, S)))
    # the counter sees every matmul; the scores are the full S x S product, as the formula counts them
    assert fc.get_total_flops() == flops.forward_flops(c, B, S)


def test_six_n_active_d():
    c = ModelConfig.from_preset("mixtral-8x7b")
    r = flops.six_nd_vs_exact(c, 1, 128)
    assert r["six_nd"] == 6 * params.active_params(c) * 128
    assert 0.95 < r["ratio_exact_over_6nd"] < 1.05


def test_mla_kv_bytes_equal_cache_and_formula():
    c = ModelConfig.from_preset("deepseek-v3")
    assert memory.kv_cache_bytes(c, 1, 1, "bf16") == (512 + 64) * 61 * 2
    gqa = ModelConfig.from_preset("llama3-70b")
    assert memory.kv_cache_bytes(c, 1, 1, "bf16") < memory.kv_cache_bytes(gqa, 1, 1, "bf16") / 4
    tiny = _tiny_moe(kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8)
    cache = LatentKVCache(tiny, batch_size=1, max_len=8)
    assert cache.nbytes_per_token == memory.kv_cache_bytes(tiny, 1, 1, "fp32") == (12 + 4) * 3 * 4


def test_all_to_all_bytes_by_hand():
    c = _tiny_moe()  # 2 MoE layers, k = 2, D = 32
    # per layer: dispatch + combine of 100 tokens x 2 experts x 32 x 2 bytes, 3/4 leaving the device; x2 backward
    assert comm.moe_all_to_all_bytes(c, 100, 4, "bf16") == 2 * 2 * (2 * 100 * 2 * 32 * 2 * 3 / 4)
    assert comm.moe_all_to_all_bytes(c, 100, 1, "bf16") == 0


def test_plan_has_moe_section():
    plan = build_plan(ModelConfig.from_preset("deepseek-v3"), get_hardware("h100"), [1], 1024)
    e = plan["moe"]
    assert e["total_params"] > 6.7e11 and e["active_params"] < 3.8e10
    assert e["kv_bytes_per_token"] == 70272
    assert e["six_n_active_per_token"] == 6 * e["active_params"]


def test_decode_reads_only_the_experts_the_batch_touches():
    """Mixtral-8x7B (V = 32000 untied, D = 4096, L = 32, N = 32, K = 8, H = 128, E = 8, k = 2, F_e = 14336):
    a decode step reads embedding + LM head 2·32000·4096 = 262,144,000, attention (2·4096·4096 + 2·4096·1024)·32
    = 1,342,177,280, routers 8·4096·32 = 1,048,576, and E·(1 − (1 − k/E)^B) experts of 3·4096·14336 =
    176,160,768 per layer: B = 1 -> 2 experts, B = 4 -> 8·(1 − 0.75⁴) = 5.46875 experts."""
    from lmstack.accounting.roofline import decode_point

    c = ModelConfig.from_preset("mixtral-8x7b")
    rest = 262_144_000 + 1_342_177_280 + 1_048_576
    assert params.expected_experts_touched(8, 2, 1) == 2.0
    assert params.expected_experts_touched(8, 2, 4) == pytest.approx(5.46875, rel=1e-12)
    assert params.decode_params(c, 1) == rest + 2 * 176_160_768 * 32 == 12_879_659_008
    assert params.decode_params(c, 4) == pytest.approx(rest + 5.46875 * 176_160_768 * 32, rel=1e-12)
    assert params.decode_params(c, 4) == pytest.approx(32_433_504_256, rel=1e-12)
    # a large batch touches every expert: all matrices, i.e. the total minus the norm gammas (2·D per layer + D)
    assert params.decode_params(c, 10**6) == pytest.approx(
        params.total_params(c) - (2 * 32 + 1) * 4096, rel=1e-12
    )
    h100 = get_hardware("h100")
    p1, p4 = decode_point(c, h100, 1, 1024), decode_point(c, h100, 4, 1024)
    assert p1.num_params == 12_879_659_008 and p4.num_params == pytest.approx(
        32_433_504_256, rel=1e-12
    )
    assert p1.memory_bytes == 2 * 12_879_659_008 + memory.kv_cache_bytes(c, 1, 1024, "bf16")
    assert (
        params.decode_params(c, None) == params.total_params(c) - (2 * 32 + 1) * 4096
    )  # resident: every expert
    assert (
        not p1.fits
    )  # 46.7B bf16 weights do not fit one 80 GB H100, though a B = 1 step reads 12.9B of them
    # a dense model keeps the seed's Param (Llama-2-13B: 13,015,449,600) at every B
    dense = ModelConfig.from_preset("llama2-13b")
    assert (
        decode_point(dense, h100, 8, 1024).num_params
        == params.matmul_params(dense)
        == 13_015_449_600
    )


def test_decode_params_shared_experts_and_dense_layers():
    """DeepSeek-V3: 3 dense layers (F = 18432), 58 MoE layers of 256 routed (k = 8, F_e = 2048) + 1 shared expert;
    B = 1 reads 8 routed + 1 shared expert per MoE layer — the active parameters less embedding and norms."""
    c = ModelConfig.from_preset("deepseek-v3")
    D = 7168
    moe_layer = 256 * D + (8 + 1) * 3 * D * 2048  # router + 8 routed + the shared expert
    dense_layer = 3 * D * 18432
    attn = params.mla_params_per_layer(c)
    vocab = 2 * c.vocab_size * D
    assert params.decode_params(c, 1) == pytest.approx(
        vocab + 61 * attn + 3 * dense_layer + 58 * moe_layer, rel=1e-12
    )
    touched = 256 * (1 - (1 - 8 / 256) ** 64)  # B = 64: ≈ 222.6 of 256 experts
    assert params.decode_params(c, 64) == pytest.approx(
        vocab + 61 * attn + 3 * dense_layer + 58 * (256 * D + (touched + 1) * 3 * D * 2048),
        rel=1e-12,
    )
    with pytest.raises(ValueError, match="k=9 must be between 1 and n_experts=8"):
        params.expected_experts_touched(8, 9, 1)


def test_moe_ffn_intensity_counts_touched_experts():
    """Mixtral-8x7B decode (T = 1), bf16: B = 1 touches k = 2 experts: FLOPs 6·2·4096·14336 = 704,643,072, bytes
    2·(2·2·4096 + 2·2·14336 + 2·3·4096·14336) = 704,790,528 -> I ≈ 0.99979. B = 64: 128 assignments, touched
    8·(1 − 0.75⁶⁴) ≈ 8 -> FLOPs 45,097,156,608, bytes ≈ 2·(1,048,576 + 3,670,016 + 8·176,160,768) ≈ 2.828e9 ->
    I ≈ 15.95, a quarter (k/E) of a dense FFN of the same width at B = 64 (6·64·D·F / 2·(2·64·(D + F) + 3DF) ≈ 63.2)."""
    from lmstack.accounting.intensity import ffn_flops_bytes, ffn_intensity

    c = ModelConfig.from_preset("mixtral-8x7b")
    assert ffn_flops_bytes(c, 1, 1) == (704_643_072, 704_790_528)
    f, b = ffn_flops_bytes(c, 64, 1)
    touched = 8 * (1 - 0.75**64)
    assert f == 45_097_156_608
    assert b == pytest.approx(2 * (1_048_576 + 3_670_016 + touched * 176_160_768), rel=1e-12)
    assert ffn_intensity(c, 64, 1) == pytest.approx(15.9466, abs=1e-4)
    dense = c.replace(n_experts=0, n_experts_per_token=1)
    assert ffn_intensity(dense, 64, 1) == pytest.approx(
        6 * 64 * 4096 * 14336 / (2 * (2 * 64 * (4096 + 14336) + 3 * 4096 * 14336))
    )


def test_ffn_intensity_counts_shared_experts():
    # by hand, B = T = 1, bf16 (P = 2), E = 4, k = 2, F_e = 16, one shared expert of width 16, D = 32:
    # routed: FLOPs 6·2·32·16, bytes 2·(2·2·32 + 2·2·16 + touched·3·32·16) with touched = 4·(1 − (1 − 2/4)^1) = 2;
    # shared: FLOPs 6·32·16, bytes 2·(2·32 + 2·16 + 3·32·16)
    from lmstack.accounting.intensity import ffn_flops_bytes

    c = _tiny_moe()
    flops, nbytes = ffn_flops_bytes(c, 1, 1, "bf16")
    assert flops == 6 * 2 * 32 * 16 + 6 * 32 * 16
    assert nbytes == 2 * (2 * 2 * 32 + 2 * 2 * 16 + 2 * 3 * 32 * 16) + 2 * (
        2 * 32 + 2 * 16 + 3 * 32 * 16
    )
