"""MoE / MLA accounting: total vs active parameters vs the models themselves and the published totals,
FLOPs vs torch's FLOP counter, MLA KV bytes vs the latent cache, all-to-all bytes by hand."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmstack.accounting import comm, flops, memory, params
from lmstack.accounting.hardware import get_hardware
from lmstack.accounting.plan import build_plan
from lmstack.kernels.backends import attention_impl
from lmstack.model.config import ModelConfig
from lmstack.model.mla import LatentKVCache
from lmstack.model.transformer import Transformer

MOE_PRESETS = ["mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "deepseek-v2-lite", "deepseek-v3"]


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
    assert [(rows[n]["routed"], rows[n]["active"], rows[n]["shared"]) for n in ("mixtral-8x7b", "olmoe-1b-7b",
            "deepseek-v3")] == [(8, 2, 0), (64, 8, 0), (256, 8, 1)]  # the seed's table
    assert rows["olmoe-1b-7b"]["fine_grained_ratio"] == 1.0  # OLMoE: F = F_e = 1024 (its table's 1/8 is vs 8·F)


def _tiny_moe(**kw):
    base = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, n_experts=4,
                n_experts_per_token=2, d_ff_expert=16, n_shared_experts=1, moe_first_dense=1)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("mla", [False, True])
def test_forward_flops_match_torch_flop_counter(mla):
    extra = dict(kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8,
                 rope_layout="interleaved") if mla else {}
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
