"""lmstack.kernels.matmul_attention vs an fp64 softmax(QKᵀ/√H + mask)V written with torch ops.

Values and gradients (q, k, v), MHA/GQA/MQA, causal (also T < S), sliding-window and packed-document
masks, several batch chunkings, bf16 autocast (within bf16 tolerance, and no worse than
F.scaled_dot_product_attention's bf16 error) and fp32 (1e-5); plus the backend selection. Both
forwards (SDPA's and the block-triangular matmul one) and the block-triangular backward: row
blocks of lengths that are not a multiple of the block, T == S and T < S, GQA/MQA, mask-derived
blocks, and the row-block bounds on worked numbers.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from lmstack.kernels import backends
from lmstack.kernels import matmul_attention as ma
from lmstack.model.attention import attention_mask
from lmstack.model.seam import AttentionMetadata


def reference64(q, k, v, mask, d_out):
    """fp64 attention with explicit GQA expansion; returns O and (dq, dk, dv) for upstream d_out."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = q @ kk.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, -math.inf)
    o = torch.softmax(s, dim=-1) @ vv
    o.backward(d_out.double())
    return o, (q.grad, k.grad, v.grad)


def make(B, N, K, T, S, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (B, T, N, H) transposed to (B, N, T, H): the strided layout the model's projections produce
    q = torch.randn(B, T, N, H, generator=g).transpose(1, 2)
    k = torch.randn(B, S, K, H, generator=g).transpose(1, 2)
    v = torch.randn(B, S, K, H, generator=g).transpose(1, 2)
    d_out = torch.randn(B, N, T, H, generator=g)
    return q, k, v, d_out


def run(q, k, v, d_out, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = ma.matmul_attention(q, k, v, **kw)
    o.backward(d_out.to(o.dtype))
    return o, (q.grad, k.grad, v.grad)


def rel_err(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize(
    "chunk", [1 << 18, 1 << 10]
)  # whole batch in one chunk / one row per chunk
def test_fp32_causal_matches_fp64(N, K, chunk, monkeypatch, forward_path):
    monkeypatch.setattr(ma, "CHUNK_SCORES", chunk)
    B, T, H = 3, 16, 8
    q, k, v, d_out = make(B, N, K, T, T, H)
    o, grads = run(q, k, v, d_out, causal=True)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    o_ref, grads_ref = reference64(q, k, v, mask, d_out)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


def test_fp32_causal_fewer_queries_than_keys(forward_path):
    """Bottom-right aligned causal mask (a suffix of queries against all keys)."""
    B, N, K, T, S, H = 2, 4, 2, 5, 12, 8
    q, k, v, d_out = make(B, N, K, T, S, H)
    o, grads = run(q, k, v, d_out, causal=True)
    mask = attention_mask(torch.arange(S - T, S), torch.arange(S))
    o_ref, grads_ref = reference64(q, k, v, mask, d_out)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


def test_fp32_window_and_documents(forward_path):
    """Per-row (B, 1, T, S) masks: a sliding window plus packed documents."""
    B, N, K, T, H = 3, 4, 2, 20, 8
    q, k, v, d_out = make(B, N, K, T, T, H, seed=1)
    pos = torch.arange(T).expand(B, T)
    docs = torch.tensor([[0] * 7 + [1] * 13, [0] * 20, [0] * 3 + [1] * 9 + [2] * 8])
    mask = attention_mask(pos, pos, window=6, q_documents=docs, k_documents=docs)  # (B, 1, T, T)
    o, grads = run(q, k, v, d_out, mask=mask)
    o_ref, grads_ref = reference64(q, k, v, mask, d_out)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


def bf16_vs_fp64_and_sdpa(B, N, K, T, S, H, seed):
    """bf16 autocast through matmul_attention vs fp64 of the fp32 originals, and not more than twice
    the error of F.scaled_dot_product_attention on the same bf16 inputs with the same bottom-right mask."""
    q, k, v, d_out = make(B, N, K, T, S, H, seed=seed)
    mask = attention_mask(torch.arange(S - T, S), torch.arange(S))
    o_ref, grads_ref = reference64(q, k, v, mask, d_out)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, grads = run(qb, kb, vb, d_out, causal=True)
    assert o.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (qb, kb, vb))
    os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
    os_.backward(d_out.to(torch.bfloat16))
    # bf16 inputs vs fp64 of the fp32 originals: both carry the inputs' own rounding (2^-9 relative)
    for ours, sdpa, ref in zip((o, *grads), (os_, qs.grad, ks.grad, vs.grad), (o_ref, *grads_ref)):
        e = rel_err(ours, ref)
        assert e < 2e-2, e
        assert e < 2 * rel_err(sdpa, ref) + 2e-3


def test_bf16_autocast_within_bf16_tolerance_and_sdpa_error(forward_path):
    bf16_vs_fp64_and_sdpa(4, 4, 2, 64, 64, 32, seed=2)


def test_input_checks():
    q, k, v, _ = make(1, 4, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="not both"):
        ma.matmul_attention(q, k, v, mask=torch.ones(4, 4, dtype=torch.bool), causal=True)
    with pytest.raises(ValueError, match="do not fit"):
        ma.matmul_attention(q, k[:, :, :, :4], v[:, :, :, :4])
    with pytest.raises(TypeError, match="torch.bool"):
        ma.matmul_attention(q, k, v, mask=torch.ones(4, 4))


def test_auto_picks_matmul_only_for_cpu_training_under_low_precision_autocast():
    assert backends.resolve_attn_backend("auto", "cpu") == "sdpa"  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert backends.resolve_attn_backend("auto", "cpu") == "matmul"
        assert backends.resolve_attn_backend("auto", "cpu", key_len=512) == "matmul"
        assert (
            backends.resolve_attn_backend("auto", "cpu", key_len=1024) == "sdpa"
        )  # SDPA's backward wins there
        with torch.no_grad():  # inference keeps SDPA
            assert backends.resolve_attn_backend("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="attention backend='nope'"):
        backends.resolve_attn_backend("nope", "cpu")


@pytest.mark.parametrize("backend", ["matmul", "sdpa", "reference"])
def test_attention_entry_point(backend):
    B, N, K, T, H = 2, 4, 2, 6, 8
    q, k, v, d_out = make(B, N, K, T, T, H, seed=3)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    o_ref, _ = reference64(q, k, v, mask, d_out)
    pos = torch.arange(T)
    # the causal fast path, and the same triangle as an explicit mask from positions
    for meta in (AttentionMetadata(pos, is_causal=True), AttentionMetadata(pos, pos)):
        assert meta.mask() is None or torch.equal(meta.mask(), mask)
        o = backends.attention_impl(backend)(q, k, v, meta)
        torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)


# --- the block-triangular path (row blocks multiplied only against the keys they may see) ---


def test_row_blocks_worked_numbers():
    # causal, T < S: block [t0, t1) needs keys [0, t1 + S - T)
    assert ma.row_blocks(10, 13, causal=True, block=4) == [(0, 4, 7), (4, 8, 11), (8, 10, 13)]
    # T > S: rows 0..6 see no key (e clamped to 1, merged with the next block of the same e)
    assert ma.row_blocks(12, 5, causal=True, block=4) == [(0, 8, 1), (8, 12, 5)]
    assert ma.row_blocks(8, 8, causal=False, block=4) == [(0, 8, 8)]  # nothing to skip
    # default policy: one block below MIN_BLOCKED_T rows, then blocks of max(ROW_BLOCK, T / ROW_BLOCKS)
    assert ma.row_blocks(128, 128, causal=True) == [(0, 128, 128)]
    assert ma.row_blocks(256, 256, causal=True) == [(0, 128, 128), (128, 256, 256)]
    assert ma.row_blocks(1024, 1024, causal=True) == [
        (0, 256, 256),
        (256, 512, 512),
        (512, 768, 768),
        (768, 1024, 1024),
    ]
    # from a mask: one past the last key any row of the block sees, over the batch, kept non-decreasing
    mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    mask[0, 0, :4, :6] = True  # rows 0..3 see up to key 5
    mask[1, 0, 4:, :3] = True  # rows 4..7 only up to key 2 -> e stays 6, the blocks merge
    assert ma.row_blocks(8, 8, causal=False, mask=mask, block=4) == [(0, 8, 6)]
    pos = torch.arange(8)
    assert ma.row_blocks(8, 8, causal=False, mask=attention_mask(pos, pos, window=3), block=4) == [
        (0, 4, 4),
        (4, 8, 8),
    ]


@pytest.fixture(params=[True, False], ids=["sdpa_forward", "blocked_forward"])
def forward_path(request, monkeypatch):
    """Both forwards: SDPA's (the default) and the block-triangular matmul forward."""
    monkeypatch.setattr(ma, "SDPA_FORWARD", request.param)
    return request.param


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("T,S", [(37, 37), (29, 45)])  # lengths not a multiple of the block; T < S
def test_fp32_blocked_causal_matches_fp64(N, K, T, S, forward_path):
    assert len(ma.row_blocks(T, S, causal=True, block=8)) > 2
    B, H = 2, 8
    q, k, v, d_out = make(B, N, K, T, S, H, seed=4)
    o, grads = run(q, k, v, d_out, causal=True, block=8)
    mask = attention_mask(
        torch.arange(S - T, S), torch.arange(S)
    )  # query i sees key j iff j <= i + S - T
    o_ref, grads_ref = reference64(q, k, v, mask, d_out)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1 << 18, 1 << 8])
def test_fp32_blocked_window_and_documents(chunk, monkeypatch, forward_path):
    """Row blocks from an explicit (B, 1, T, S) mask, several batch chunks."""
    monkeypatch.setattr(ma, "CHUNK_SCORES", chunk)
    B, N, K, T, H = 3, 4, 2, 21, 8
    q, k, v, d_out = make(B, N, K, T, T, H, seed=5)
    pos = torch.arange(T).expand(B, T)
    docs = torch.tensor([[0] * 7 + [1] * 14, [0] * 21, [0] * 3 + [1] * 9 + [2] * 9])
    mask = attention_mask(pos, pos, window=6, q_documents=docs, k_documents=docs)  # (B, 1, T, T)
    assert len(ma.row_blocks(T, T, causal=False, mask=mask, block=5)) > 2
    o, grads = run(q, k, v, d_out, mask=mask, block=5)
    o_ref, grads_ref = reference64(q, k, v, mask, d_out)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,S", [(300, 300), (260, 300)])
def test_bf16_blocked_default_policy_vs_fp64_and_sdpa(T, S, forward_path):
    """bf16 autocast through the default row blocks (T=300: 128 + 128 + 44 rows), GQA, T == S and T < S;
    F.scaled_dot_product_attention on the same bf16 inputs with the same bottom-right mask as the peer."""
    assert len(ma.row_blocks(T, S, causal=True)) > 1
    bf16_vs_fp64_and_sdpa(2, 4, 2, T, S, 32, seed=6)


def test_rows_without_keys_give_nan_in_both_passes():
    """T > S causal (rows 0..T-S-1 see nothing) and a mask with an empty row: NaN there (softmax over
    an empty set), finite elsewhere — SDPA's forward (which gives 0) is not used for such inputs."""
    q, k, v, d_out = make(1, 4, 2, 6, 4, 8, seed=7)
    o, (dq, _, _) = run(q, k, v, d_out, causal=True)
    assert torch.isnan(o[:, :, :2]).all() and torch.isfinite(o[:, :, 2:]).all()
    assert torch.isnan(dq[:, :, :2]).all() and torch.isfinite(dq[:, :, 2:]).all()
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[3] = False
    o = ma.matmul_attention(q, k, v, mask=mask)
    assert torch.isnan(o[:, :, 3]).all() and torch.isfinite(o[:, :, [0, 1, 2, 4, 5]]).all()
