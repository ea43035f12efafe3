"""MLA: the absorbed form (W_UK folded into the query, W_UV into the output, a cache of latents only) equals
the expanded per-head form; cached decoding equals full recomputation; the cache holds d_c + d_R per token."""

import pytest
import torch

from lmstack.inference.kv_cache import LatentKVCache
from lmstack.kernels.backends import attention_impl
from lmstack.model.config import ModelConfig
from lmstack.model.mla import MLA
from lmstack.model.seam import AttentionMetadata
from lmstack.model.transformer import Transformer


def _cfg(**kw):
    base = dict(
        vocab_size=80,
        d_model=48,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        head_dim=14,
        kv_lora_rank=12,
        q_lora_rank=10,
        qk_nope_head_dim=10,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_layout="interleaved",
    )
    return ModelConfig(**{**base, **kw})


def test_absorbed_equals_expanded_per_layer():
    torch.manual_seed(0)
    mla = MLA(_cfg()).double()
    x = torch.randn(2, 7, 48, dtype=torch.float64)
    pos = torch.arange(7)
    q_nope, q_rope = mla.queries(x, pos)
    c, k_rope = mla.latent(x, pos)
    meta = AttentionMetadata(pos, is_causal=True)
    expanded = mla.expanded(q_nope, q_rope, c, k_rope, meta)  # (B, N, T, H_v)
    # absorbed by hand: scores from [W_UKᵀ q_nope ; q_R]·[c ; k_R], values c, then W_UV per head
    w = mla.kv_b_proj.weight.view(4, 16, 12)
    w_uk, w_uv = w[:, :10], w[:, 10:]
    scores = (
        torch.einsum("bnth,nhc,bsc->bnts", q_nope, w_uk, c)
        + torch.einsum("bntr,bsr->bnts", q_rope, k_rope[:, 0])
    ) / (10 + 4) ** 0.5
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    absorbed = torch.einsum("bnts,bsc,nvc->bntv", scores.softmax(-1), c, w_uv)
    torch.testing.assert_close(expanded, absorbed, atol=1e-10, rtol=1e-10)
    # and the module's absorbed path (query / output helpers through an implementation)
    q_abs = mla.absorbed_query(q_nope, q_rope)
    k_lat = torch.cat([c[:, None], k_rope], dim=-1)
    o_lat = attention_impl("reference")(q_abs, k_lat, c[:, None], meta)
    torch.testing.assert_close(mla.absorbed_output(o_lat), expanded, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"q_lora_rank": 0},
        {"n_experts": 4, "n_experts_per_token": 2, "moe_first_dense": 1, "rope_layout": "half"},
    ],
)
def test_cached_decode_equals_full_recompute(extra):
    torch.manual_seed(0)
    m = Transformer(_cfg(**extra)).eval()
    tokens = torch.randint(0, 80, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(tokens)  # expanded form, no cache
        cache = LatentKVCache(m.config, batch_size=2, max_len=16)
        pre = m(tokens[:, :5], positions=torch.arange(5), kv_cache=cache)  # absorbed prefill
        torch.testing.assert_close(pre, full[:, :5], atol=1e-5, rtol=1e-5)
        for t in range(5, 12):  # absorbed decode, one token at a time
            step = m(tokens[:, t : t + 1], positions=torch.tensor([t]), kv_cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
    assert cache.data[0].shape == (2, 16, 12 + 4)  # only the latent and the RoPE key are stored
    assert cache.nbytes_per_token == (12 + 4) * 2 * 4


def test_mla_refuses_a_per_head_cache():
    from lmstack.inference.kv_cache import KVCache

    m = Transformer(_cfg())
    with pytest.raises(ValueError, match="MLA model needs a latent KV cache"):
        m(
            torch.zeros(1, 3, dtype=torch.long),
            positions=torch.arange(3),
            kv_cache=KVCache(m.config, 1, 8),
        )
