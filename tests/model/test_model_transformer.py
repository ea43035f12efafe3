"""The Transformer's behaviours: init, meta construction, cache seam, variants."""

import math

import pytest
import torch

from lmstack.inference import KVCache, SamplingParams, generate
from lmstack.model.config import ModelConfig
from lmstack.model.seam import AttentionMetadata
from lmstack.model.transformer import Transformer

TINY = dict(
    vocab_size=97, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=128
)


def test_init_is_seeded_and_follows_the_documented_scheme():
    cfg = ModelConfig(**TINY, init_std=0.02)
    a, b, c = Transformer(cfg, seed=0), Transformer(cfg, seed=0), Transformer(cfg, seed=1)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if "norm" not in n:
            assert not torch.equal(pa, pc), n
    big = Transformer(ModelConfig(**{**TINY, "d_model": 256, "d_ff": 512, "n_heads": 4}), seed=0)
    emb = big.embed.weight
    # std of N(0, σ²) truncated at ±3σ: σ·sqrt(1 - 2·3·φ(3) / (2Φ(3) - 1)) ≈ 0.9866σ
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    trunc_factor = math.sqrt(1 - 6 * phi3 / math.erf(3 / math.sqrt(2)))
    assert abs(emb.std().item() / 0.02 - trunc_factor) < 0.01
    assert emb.abs().max().item() <= 3 * 0.02 + 1e-7
    o = big.blocks[0].attn.o_proj.weight
    sigma_o = 0.02 / math.sqrt(2 * 3)
    assert o.abs().max().item() <= 3 * sigma_o + 1e-7
    assert abs(o.std().item() / sigma_o - trunc_factor) < 0.02
    assert torch.equal(big.blocks[1].ffn_norm.weight, torch.ones(256))


def test_meta_construction_then_materialize():
    cfg = ModelConfig(**TINY)
    with torch.device("meta"):
        m = Transformer(cfg)
    m.to_empty(device="cpu")
    m.init_weights(seed=0)
    ref = Transformer(cfg, seed=0)
    tokens = torch.randint(0, 97, (1, 8))
    torch.testing.assert_close(m(tokens), ref(tokens))


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"sliding_window": 5},
        {"qk_norm": True},
        {"qkv_bias": True},
        {"n_kv_heads": 1},
        {"parallel_block": True},
        {"rope_layout": "interleaved"},
    ],
)
def test_kv_cache_matches_full_recompute(extra):
    """Prefill + step-by-step decode through the cache equals recomputing the whole sequence."""
    model = Transformer(ModelConfig(**{**TINY, **extra}), seed=3).eval()
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.config, 2, 20)
        pieces = [model(tokens[:, :7], torch.arange(7), kv_cache=cache)]
        for t in range(7, 20):
            pieces.append(model(tokens[:, t : t + 1], torch.tensor([t]), kv_cache=cache))
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)
    assert (
        cache.nbytes == 2 * 2 * 20 * model.config.n_kv_heads * model.config.head_dim * 3 * 4
    )  # 2·B·S·K·H·L·bytes


def test_greedy_generation_with_cache_equals_without():
    model = Transformer(ModelConfig(**TINY), seed=5).eval()
    prompt = [3, 14, 15, 92, 65]
    params = SamplingParams(temperature=0, max_tokens=12)
    assert list(generate(model, prompt, params)) == list(
        generate(model, prompt, params, use_cache=False)
    )


def test_variants_change_the_function():
    base = ModelConfig(**TINY)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = Transformer(base, seed=0)(tokens)
    for extra in ({"parallel_block": True}, {"qk_norm": True}, {"sliding_window": 3}):
        other = Transformer(base.replace(**extra), seed=0)(tokens)
        assert (other - ref).abs().max() > 1e-4, extra


def test_parallel_block_formula():
    """GPT-J block: y = x + Attn(Norm(x)) + MLP(Norm(x)) (CS336 notes "层并行")."""
    model = Transformer(ModelConfig(**{**TINY, "parallel_block": True}), seed=0)
    block = model.blocks[0]
    assert block.ffn_norm is None
    x = torch.randn(2, 6, 64)
    meta = AttentionMetadata(torch.arange(6), is_causal=True)
    h = block.attn_norm(x)
    torch.testing.assert_close(block(x, meta), x + block.attn(h, meta) + block.ffn(h))


def test_tied_embeddings_share_storage():
    model = Transformer(ModelConfig(**{**TINY, "tie_embeddings": True}))
    assert model.lm_head is None and model.unembedding is model.embed.weight
    assert model.num_params() == Transformer(ModelConfig(**TINY)).num_params() - 97 * 64


def test_last_n_and_bad_input():
    model = Transformer(ModelConfig(**TINY))
    tokens = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(model(tokens, last_n=1), model(tokens)[:, -1:])
    with pytest.raises(ValueError, match=r"tokens must have shape \(B, S\)"):
        model(tokens[0])


def test_packed_documents_equal_separate_sequences():
    """Two documents packed in one row with document_ids give each document's own logits."""
    model = Transformer(ModelConfig(**TINY), seed=0).eval()
    a = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    b = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    packed = torch.cat([a, b], 1)
    docs = torch.tensor([[0] * 7 + [1] * 5])
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        out = model(packed, positions, document_ids=docs)
        torch.testing.assert_close(out[:, :7], model(a), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[:, 7:], model(b), rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_gives_same_gradients():
    tokens = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    grads = []
    for ckpt in (False, True):
        model = Transformer(ModelConfig(**TINY), seed=0)
        model.activation_checkpointing = ckpt
        model(tokens).logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1)


def test_position_beyond_rope_tables_is_a_clear_error():
    model = Transformer(ModelConfig(**{**TINY, "max_seq_len": 16}))
    with pytest.raises(ValueError, match="position 16 is beyond max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
