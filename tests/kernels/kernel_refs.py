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
        torch.testing.assert_close(
            g.double(),
            rg,
            atol=atol,
            rtol=rtol,
            msg=lambda m: f"d{name}: {m}",  # noqa: B023
        )


def attention_error_bounds(q, k, v, do, causal, per_cast, tiny=0.0):
    """Elementwise first-order bounds on |computed − exact| for O, dQ, dK, dV of a flash attention
    whose inputs q, k, v, dO (B, N|K, T|S, H) are already in a low-precision dtype, which computes
    in fp32 and rounds — each rounding off by at most ``per_cast`` relative (the unit roundoff
    u = 2^-8 for bf16, 2^-11 for fp16 when rounding to nearest) — exactly these values:

    - P to the dtype before P·V (forward) and Pᵀ·dO (dV):      |δO| ≤ r·(P|V| + |O|) (O stored too)
    - O is stored in the dtype and read back for D = rowsum(dO ∘ O): |δD| ≤ Σ|dO|·|δO|
    - dS = P ∘ (dP − D) to the dtype before dS·K and dSᵀ·Q:    |δdS| ≤ P·|δD| + r·|dS|
    - dQ, dK, dV stored in the dtype: + r·|dQ|, r·|dK|, r·|dV|

    A value below the dtype's normal range is off by up to ``tiny`` in absolute terms instead (its
    subnormal spacing: 2^-24 for fp16; bf16's, 2^-133, is negligible): that adds tiny·Σ|V| to δO,
    tiny·Σ|dO| to δdV and tiny to δdS for every rounded P or dS. Products of two dtype values are
    exact in fp32 and its accumulation error (~2^-24 per term) is far below these; second-order
    terms (r²) are left out. Computed in fp64 from the given inputs.
    Returns the bounds (O, dQ, dK, dV), shaped like the tensors they bound.
    """
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    G = N // K
    ke, ve = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, N, S, H)
    scale = 1 / math.sqrt(H)
    s = q @ ke.transpose(-1, -2) * scale  # (B, N, T, S)
    if causal:
        visible = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)
        s = s.masked_fill(~visible.to(s.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.where(
        torch.isfinite(lse), torch.exp(s - lse.nan_to_num(neginf=0.0)), torch.zeros_like(s)
    )
    o = p @ ve
    o_err = per_cast * (p @ ve.abs() + o.abs()) + tiny * ve.abs().sum(-2, keepdim=True)
    ds = p * (do @ ve.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    ds_err = p * (do.abs() * o_err).sum(-1, keepdim=True) + per_cast * ds.abs() + tiny

    def per_kv_head(x):  # (B, N, S, H) -> (B, K, S, H): the G query heads of a kv head add up
        return x.unflatten(1, (K, G)).sum(2)

    dq = ds @ ke * scale
    dq_err = ds_err @ ke.abs() * scale + per_cast * dq.abs()
    dk = per_kv_head(ds.transpose(-1, -2) @ q * scale)
    dk_err = per_kv_head(ds_err.transpose(-1, -2) @ q.abs() * scale) + per_cast * dk.abs()
    dv = per_kv_head(p.transpose(-1, -2) @ do)
    dv_err = (
        per_kv_head(
            per_cast * p.transpose(-1, -2) @ do.abs() + tiny * do.abs().sum(-2, keepdim=True)
        )
        + per_cast * dv.abs()
    )
    return o_err, dq_err, dk_err, dv_err
