"""KV cache, activations, inference and training memory (Book of LLMs §1.5 “activation memory”, §1.7, §1.8, §2.5, §6.4-6.6)."""

import pytest

from lmstack.accounting.memory import (
    inference_memory,
    kv_cache_bytes,
    kv_cache_elements,
    kv_cache_variants,
    mla_kv_cache_bytes,
    peak_activation_elements,
    train_activation_bytes,
    train_activation_elements_per_layer,
    training_memory,
    training_memory_per_device,
)
from lmstack.accounting.params import total_params
from lmstack.model.config import ModelConfig


def test_kv_cache_llama2_13b_seed_table():
    # CS336 notes table: B=1 memory 26,869,760,000 = 2·13,015,449,600 + KV; KV = 2·2·1·1024·40·5120.
    cfg = ModelConfig.from_preset("llama2-13b")
    assert (
        kv_cache_bytes(cfg, 1, 1024, "bf16") == 838_860_800 == 26_869_760_000 - 2 * 13_015_449_600
    )


def test_kv_cache_llama3_8b_gqa():
    # Llama-3-8B: 2·K·H·L = 2·8·128·32 = 65,536 elements = 128 KiB per token in bf16.
    cfg = ModelConfig.from_preset("llama3-8b")
    assert kv_cache_bytes(cfg, 1, 1, "bf16") == 128 * 1024
    assert kv_cache_bytes(cfg, 4, 8192, "fp16") == 4 * 8192 * 128 * 1024
    assert kv_cache_bytes(cfg, 1, 1, "fp32") == 256 * 1024
    assert kv_cache_bytes(cfg, 1, 1, "int8") == 64 * 1024


def test_kv_variants_mha_mqa_gqa_mla():
    # Book of LLMs §2.5 “shrinking the KV cache”: MQA shrinks the MHA cache N times; GQA by G = N/K; MLA caches 512 + 64 per layer.
    cfg = ModelConfig.from_preset("llama3-8b")
    v = kv_cache_variants(cfg, 2, 100, "bf16")
    assert v["mha"] == 32 * v["mqa"] == 4 * v["gqa"]
    assert v["mla"] == 2 * 100 * 32 * 576 * 2
    assert (
        mla_kv_cache_bytes(1, 1, 60, 512, 64, "bf16") == 60 * 576 * 2
    )  # DeepSeek-V2: 576 elements/token/layer


def test_sliding_window_caps_kv():
    # Book of LLMs §1.9 “sliding-window and sparse attention” / §2.5: tokens that leave the window W are dropped.
    cfg = ModelConfig.from_preset("mistral-7b")
    assert kv_cache_elements(cfg, 1, 32768, window=4096) == kv_cache_elements(cfg, 1, 4096)
    assert kv_cache_elements(cfg, 1, 1000, window=4096) == 2 * 1000 * 8 * 128 * 32


def test_activations_seed_14BSD():
    # Book of LLMs §1.5 “activation memory”: 14BSD + BNS² per layer (the 14 is reached at K = N, F = 3D); FlashAttention: BNS.
    cfg = ModelConfig(vocab_size=10, d_model=64, n_layers=5, n_heads=4, d_ff=192)
    B, S, D, N = 3, 50, 64, 4
    assert train_activation_elements_per_layer(cfg, B, S) == 14 * B * S * D + B * N * S * S
    assert train_activation_elements_per_layer(cfg, B, S, flash=True) == 14 * B * S * D + B * N * S
    # F = 8/3·D: 6BSD + BNS² + 2BSD + 2BS(8/3)D
    cfg2 = cfg.replace(d_ff=8 * 64 // 3 + 1)  # 171
    assert (
        train_activation_elements_per_layer(cfg2, B, S)
        == 8 * B * S * D + 2 * B * S * 171 + B * N * S * S
    )


def test_activation_bytes_and_checkpointing():
    cfg = ModelConfig(vocab_size=10, d_model=64, n_layers=5, n_heads=4, d_ff=192)
    B, S, D, N = 2, 32, 64, 4
    per_layer = 14 * B * S * D + B * N * S * S
    assert train_activation_bytes(cfg, B, S, "bf16") == 2 * 5 * per_layer
    assert train_activation_bytes(cfg, B, S, "bf16", checkpoint=True) == 2 * (
        5 * B * S * D + per_layer
    )


def test_peak_inference_activations():
    # Book of LLMs §1.7 “inference memory”: BSD + 3BSD (QKV) + BNS² (BNS with FA) + BSF at K = N.
    cfg = ModelConfig.from_preset("llama2-13b")
    B, S, D, N, F = 1, 1024, 5120, 40, 13824
    assert (
        peak_activation_elements(cfg, B, S) == B * S * D + 3 * B * S * D + B * N * S * S + B * S * F
    )
    assert (
        peak_activation_elements(cfg, B, S, flash=True)
        == B * S * D + 3 * B * S * D + B * N * S + B * S * F
    )
    # decode: O(BNS + BF)
    assert peak_activation_elements(cfg, 8, 1, S) == 8 * D + 8 * 3 * D + 8 * N * S + 8 * F


def test_inference_memory_components():
    cfg = ModelConfig.from_preset("llama2-13b")
    m = inference_memory(cfg, 1, 1024, "bf16", flash=False)
    assert m.weights == 2 * 13_015_864_320
    assert m.kv_cache == 838_860_800
    assert m.activations == 2 * (1024 * 5120 * 4 + 40 * 1024 * 1024 + 1024 * 13824)
    assert m.total == m.weights + m.kv_cache + m.activations
    # "what fits on one H100 (80 GB)": 13B in bf16 with S=1024 fits at B=1, not at B=64 (CS336 notes table)
    assert m.total < 80e9
    assert inference_memory(cfg, 64, 1024, "bf16").total > 80e9


def test_training_memory_18P():
    # Book of LLMs §1.8 “training memory”: fp32 master 4P + bf16 copy 2P + AdamW 8P + fp32 grads 4P = 18P.
    cfg = ModelConfig.from_preset("llama2-7b")
    P = 6_738_415_616
    m = training_memory(cfg, 1, 4096, flash=True)
    assert m.states == 18 * P
    assert (m.master_weights, m.low_precision_weights, m.optimizer, m.gradients) == (
        4 * P,
        2 * P,
        8 * P,
        4 * P,
    )
    assert m.activations == train_activation_bytes(cfg, 1, 4096, "bf16", flash=True)
    assert training_memory(cfg, 1, 16, mixed_precision=False).states == 16 * P


def test_per_device_ddp_zero_hand():
    # Book of LLMs §6.4 “DDP and ZeRO”: ZeRO-1 shards AdamW states, ZeRO-2 + gradients, ZeRO-3 + weights, over M.
    cfg = ModelConfig.from_preset("llama2-7b")
    P, M, B, S = total_params(cfg), 8, 16, 2048
    act = train_activation_bytes(cfg, B // M, S, "bf16", flash=True)
    d = {
        s: training_memory_per_device(cfg, B, S, s, M, flash=True)
        for s in ("ddp", "zero1", "zero2", "zero3")
    }
    assert d["ddp"].states == 18 * P and d["ddp"].activations == act
    assert d["zero1"].states == pytest.approx(4 * P + 2 * P + 8 * P / M + 4 * P)
    assert d["zero2"].states == pytest.approx(4 * P + 2 * P + 8 * P / M + 4 * P / M)
    assert d["zero3"].states == pytest.approx(18 * P / M)
    assert all(x.activations == act for x in d.values())  # ZeRO does not shard activations


def test_per_device_tp_pp_hand():
    cfg = ModelConfig(vocab_size=1000, d_model=256, n_layers=8, n_heads=8, d_ff=768)
    P, M, B, S, D, N, F = total_params(cfg), 4, 2, 128, 256, 8, 768
    norms = 8 * 2 * D + D
    tp = training_memory_per_device(cfg, B, S, "tp", M)
    assert tp.states == pytest.approx(18 * (norms + (P - norms) / M))
    per_layer = 4 * B * S * D + (3 * B * S * D + B * N * S * S + B * S * D + 2 * B * S * F) / M
    assert tp.activations == pytest.approx(2 * 8 * per_layer)
    pp = training_memory_per_device(cfg, B, S, "pp", M, micro_batches=4)
    assert pp.states == pytest.approx(18 * P / M)
    # 1F1B with 4 micro-batches of B/4 on 4 stages: the first stage holds all 4 in flight for L/M layers
    assert pp.activations == pytest.approx(
        2 * (8 / M) * train_activation_elements_per_layer(cfg, B, S)
    )
    with pytest.raises(ValueError, match="strategy='fsdp'"):
        training_memory_per_device(cfg, B, S, "fsdp", M)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_kv_allocation_equals_formula(dtype):
    # The engine's preallocated cache must hold exactly 2·B·S·K·H·L elements (Book of LLMs §1.7 “inference memory”).
    import torch

    from lmstack.inference.kv_cache import KVCache

    cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96)
    B, S = 3, 40
    cache = KVCache(cfg, B, S, dtype=getattr(torch, dtype))
    allocated = cache.k.untyped_storage().nbytes() + cache.v.untyped_storage().nbytes()
    assert (
        allocated
        == kv_cache_bytes(cfg, B, S, dtype)
        == 2 * B * S * 2 * 16 * 3 * (2 if dtype == "bfloat16" else 4)
    )
    assert cache.nbytes == allocated
