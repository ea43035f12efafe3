"""Chunked == recurrent == plain reference for the linear-recurrence mixers (lmstack.model.linear_scan).

The references here are written independently of the kernels: the decayed linear recurrence as its
quadratic (attention-like) form over the whole sequence, and the delta rule as the literal matrix
recurrence S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ with an explicit identity, both in fp64.
"""

import pytest
import torch

from lmstack.model.linear_scan import decay_chunked, decay_recurrent, delta_chunked, delta_recurrent

B, N, HK, HV = 2, 3, 5, 4


def quadratic_reference(q, k, v, g, s0):
    """y_t = Σ_{j≤t} exp(G_t − G_j)(q_t·k_j) v_j + exp(G_t) q_tᵀ S_0 with G = cumsum(log γ) over all of S."""
    S = q.shape[2]
    G = g.cumsum(-1)  # (B, N, S)
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~keep, -torch.inf).exp()
    y = ((q @ k.transpose(-1, -2)) * decay) @ v + G.exp()[..., None] * (q @ s0)
    s = (
        G[..., -1, None, None].exp() * s0
        + (k * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ v
    )
    return y, s


def delta_reference(q, k, v, beta, g, s0):
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    s, ys = s0, []
    for t in range(q.shape[2]):
        kt, vt = k[:, :, t, :, None], v[:, :, t, :, None]  # columns
        bt, gt = beta[:, :, t, None, None], g[:, :, t, None, None].exp()
        s = gt * (eye - bt * kt @ kt.transpose(-1, -2)) @ s + bt * kt @ vt.transpose(-1, -2)
        ys.append((s.transpose(-1, -2) @ q[:, :, t, :, None])[..., 0])
    return torch.stack(ys, dim=2), s


def _inputs(S, seed, dtype=torch.float64, with_state=True, decay=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, S, HK, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, N, S, HK, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, N, S, HV, generator=gen, dtype=dtype)
    g = (
        -torch.rand(B, N, S, generator=gen, dtype=dtype) * 0.5
        if decay
        else torch.zeros(B, N, S, dtype=dtype)
    )
    beta = torch.rand(B, N, S, generator=gen, dtype=dtype)
    s0 = (
        torch.randn(B, N, HK, HV, generator=gen, dtype=dtype)
        if with_state
        else torch.zeros(B, N, HK, HV, dtype=dtype)
    )
    return q, k, v, g, beta, s0


def _grads(fn, inputs):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    y, s = fn(*inputs)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=y.dtype)
    ws = torch.randn(s.shape, generator=torch.Generator().manual_seed(10), dtype=s.dtype)
    ((y * w).sum() + (s * ws).sum()).backward()
    return y.detach(), s.detach(), [x.grad for x in inputs]


@pytest.mark.parametrize("S,C", [(16, 4), (13, 4), (7, 16), (20, 1), (1, 3)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("decay", [False, True])
def test_decay_chunked_recurrent_match_quadratic_form(S, C, with_state, decay):
    q, k, v, g, _, s0 = _inputs(S, S * 7 + C, with_state=with_state, decay=decay)
    inputs = [q, k, v, g, s0]
    y_ref, s_ref, g_ref = _grads(quadratic_reference, inputs)
    forms = {
        "chunked": lambda q, k, v, g, s0: decay_chunked(q, k, v, g, chunk_size=C, state=s0),
        "recurrent": lambda q, k, v, g, s0: decay_recurrent(q, k, v, g, state=s0),
    }
    for name, fn in forms.items():
        y, s, grads = _grads(fn, inputs)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10, msg=f"{name} values")
        torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10, msg=f"{name} state")
        for a, r, nm in zip(grads, g_ref, "q k v log_decay state".split()):
            torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=f"{name} grad of {nm}")


@pytest.mark.parametrize("S,C", [(16, 4), (13, 4), (7, 16), (9, 1)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("decay", [False, True])
def test_delta_chunked_recurrent_match_matrix_recurrence(S, C, with_state, decay):
    q, k, v, g, beta, s0 = _inputs(S, S * 11 + C, with_state=with_state, decay=decay)
    inputs = [q, k, v, beta, g, s0]
    y_ref, s_ref, g_ref = _grads(delta_reference, inputs)
    forms = {
        "chunked": lambda q, k, v, b, g, s0: delta_chunked(q, k, v, b, g, chunk_size=C, state=s0),
        "recurrent": lambda q, k, v, b, g, s0: delta_recurrent(q, k, v, b, g, state=s0),
    }
    for name, fn in forms.items():
        y, s, grads = _grads(fn, inputs)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10, msg=f"{name} values")
        torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10, msg=f"{name} state")
        for a, r, nm in zip(grads, g_ref, "q k v beta log_decay state".split()):
            torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=f"{name} grad of {nm}")


def test_chunked_split_equals_whole():
    """Prefill in two pieces (state handed over) == one piece: what chunked prefill in an engine relies on."""
    q, k, v, g, beta, _ = _inputs(23, 3)
    y, s = delta_chunked(q, k, v, beta, g, chunk_size=8)
    y1, s1 = delta_chunked(
        q[:, :, :10], k[:, :, :10], v[:, :, :10], beta[:, :, :10], g[:, :, :10], chunk_size=8
    )
    y2, s2 = delta_chunked(
        q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], beta[:, :, 10:], g[:, :, 10:], 8, state=s1
    )
    torch.testing.assert_close(torch.cat([y1, y2], dim=2), y)
    torch.testing.assert_close(s2, s)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_long_sequences_strong_decay_stay_finite(dtype, tol):
    """S = 4096 with log γ down to −8 per token: Π γ underflows to 0 long before the end (1/Π γ would be inf);
    the chunked forms in fp32 / bf16 stay finite and agree with the fp64 quadratic form."""
    S = 4096
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, S, 8, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(
        torch.randn(1, 2, S, 8, generator=gen, dtype=torch.float64), dim=-1
    )
    v = torch.randn(1, 2, S, 8, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, 2, S, generator=gen, dtype=torch.float64) * 8
    beta = torch.rand(1, 2, S, generator=gen, dtype=torch.float64)
    y_ref, _ = quadratic_reference(q, k, v, g, torch.zeros(1, 2, 8, 8, dtype=torch.float64))
    y, s = decay_chunked(q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype), chunk_size=64)
    assert y.dtype == dtype and torch.isfinite(y).all() and torch.isfinite(s).all()
    assert (y.double() - y_ref).abs().max().item() < tol * max(1.0, y_ref.abs().max().item())
    y_ref, _ = delta_recurrent(q, k, v, beta, g)
    y, s = delta_chunked(
        q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype), g.to(dtype), chunk_size=64
    )
    assert torch.isfinite(y).all() and torch.isfinite(s).all()
    assert (y.double() - y_ref).abs().max().item() < tol * max(1.0, y_ref.abs().max().item())


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_bad_chunk_size(bad):
    q, k, v, g, beta, _ = _inputs(5, 0)
    with pytest.raises(ValueError, match=r"chunk_size=.*positive int"):
        decay_chunked(q, k, v, g, chunk_size=bad)
    with pytest.raises(ValueError, match=r"chunk_size=.*positive int"):
        delta_chunked(q, k, v, beta, g, chunk_size=bad)


def test_bad_shapes():
    q, k, v, g, beta, s0 = _inputs(5, 0)
    with pytest.raises(ValueError, match="state has shape"):
        decay_chunked(q, k, v, g, state=s0[:, :, :2])
    with pytest.raises(ValueError, match="per-token gates"):
        delta_chunked(q, k, v, beta[:, :, :3], g)
