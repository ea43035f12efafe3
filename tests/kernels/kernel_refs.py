"""Independent references and comparison helpers for the kernel tests (no lmstack code)."""

import math

import torch


def reference_attention(q, k, v, causal):
    """Independent reference: plain softmax(QKᵀ/√H [+ bottom-right causal mask]) V with autograd.

    q (B, N, T, H), k/v (B, K, S, H). Returns O (B, N, T, H) and logsumexp L (B, N, T).
    """
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, N, T, S)
    if causal:
        T, S = s.shape[-2:]
        visible = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)
        s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    seen = torch.isfinite(lse)[..., None]  # causal rows with T > S may see no key: O = 0 there
    p = torch.softmax(s.masked_fill(~seen, 0.0), dim=-1) * seen
    return p @ v, lse


def make_qkv(B, N, K, T, S, H, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, T, H, generator=gen, dtype=torch.float64)
    k = torch.randn(B, K, S, H, generator=gen, dtype=torch.float64)
    v = torch.randn(B, K, S, H, generator=gen, dtype=torch.float64)
    do = torch.randn(B, N, T, H, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)], do.to(dtype)


def check_against_reference(fn, B, N, K, T, S, H, causal, dtype, atol, rtol, **kw):
    """Run ``fn`` (a flash implementation) and the fp64 reference on the same inputs; compare
    O, L, dQ, dK, dV. Rows that see no key (causal with T > S) are compared separately."""
    (q, k, v), do = make_qkv(B, N, K, T, S, H, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, causal=causal, return_lse=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference_attention(q64, k64, v64, causal)
    seen = torch.isfinite(ref_lse)  # rows with at least one visible key
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), do.double())
    assert out.dtype == dtype and out.shape == (B, N, T, H) and lse.shape == (B, N, T)
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=atol, rtol=rtol)
    assert torch.all(out[~seen] == 0) and torch.all(lse[~seen] == -math.inf)
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype and g.shape == rg.shape, name
        torch.testing.assert_close(g.double(), rg, atol=atol, rtol=rtol, msg=lambda m: f"d{name}: {m}")
