"""lmstack.kernels.onednn_attention (the oneDNN causal attention backend) vs an fp64 softmax(QKᵀ/√H + causal mask)V written with
torch ops.

MHA/GQA/MQA, the model's strided (B, T, N, H) layout and contiguous inputs, row blocks that do not divide T,
T shorter than one block, a head size whose 1/√H is not a power of two; the ``OneDNNAttention`` dispatch
(the kernel only for plain causal fp32 self-attention of >= MIN_T tokens without autograd, everything else
to the fallback).
"""

import math

import pytest
import torch

from lmstack.kernels import onednn_attention as oa
from lmstack.model.seam import AttentionMetadata
from lmstack.ops.gemm import onednn_ok

pytestmark = pytest.mark.skipif(
    not onednn_ok(torch.zeros(1)), reason="needs torch built with oneDNN (mkldnn)"
)


def reference64(q, k, v):
    """fp64 causal attention with explicit GQA expansion (query i sees keys 0..i)."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    T = q.shape[2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def make(B, N, K, T, H, seed=0, model_layout=True):
    g = torch.Generator().manual_seed(seed)
    if model_layout:  # (B, T, heads, H) transposed: what the model's projections and RoPE produce
        return tuple(torch.randn(B, T, n, H, generator=g).transpose(1, 2) for n in (N, K, K))
    return tuple(torch.randn(B, n, T, H, generator=g) for n in (N, K, K))


@pytest.mark.parametrize(
    "B,N,K,T,H,block,layout",
    [
        (2, 6, 2, 300, 32, 128, True),  # GQA, 300 = 128 + 128 + 44
        (1, 9, 3, 260, 64, 64, False),  # SmolLM2's heads, contiguous inputs
        (1, 4, 4, 130, 16, 128, True),  # MHA, last block of 2 rows
        (
            1,
            4,
            1,
            50,
            48,
            128,
            True,
        ),  # MQA, one block shorter than the block size; 1/√48 is not exact
    ],
)
def test_equals_fp64_reference(B, N, K, T, H, block, layout):
    q, k, v = make(B, N, K, T, H, model_layout=layout)
    out = oa.onednn_causal_attention(q, k, v, block=block)
    assert out.shape == (B, N, T, H) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference64(q, k, v), rtol=1e-5, atol=2e-6)
    # the output is a (B, N, T, H) view of a contiguous (B, T, N, H) buffer: the output projection reads it as is
    assert out.transpose(1, 2).is_contiguous()


def test_bad_shapes():
    q, k, v = make(1, 4, 2, 32, 16)
    with pytest.raises(ValueError, match="N a multiple of K"):
        oa.onednn_causal_attention(q, k[:, :, :16], v[:, :, :16])
    with pytest.raises(ValueError, match="N a multiple of K"):
        oa.onednn_causal_attention(q[:, :3], k, v)


class Spy:
    """A fallback implementation that records that it was called and returns the fp64 reference."""

    name = "spy"

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, meta):
        self.calls += 1
        return reference64(q, k, v).to(q.dtype)


def test_dispatch(monkeypatch):
    T = oa.MIN_T
    q, k, v = make(1, 4, 2, T, 16)
    pos = torch.arange(T)
    causal = AttentionMetadata(pos, is_causal=True)
    used = []
    real = oa.onednn_causal_attention
    monkeypatch.setattr(
        oa, "onednn_causal_attention", lambda *a, **kw: used.append(1) or real(*a, **kw)
    )
    spy = Spy()
    impl = oa.OneDNNAttention(fallback=spy)
    with torch.no_grad():
        torch.testing.assert_close(
            impl(q, k, v, causal).double(), reference64(q, k, v), rtol=1e-5, atol=2e-6
        )
    assert used == [1] and spy.calls == 0
    # each of these goes to the fallback: an explicit mask (window), fewer than MIN_T tokens, not fp32,
    # autograd recording
    cases = [
        (q, k, v, AttentionMetadata(pos, window=8, is_causal=True)),
        (
            q[:, :, : T - 1],
            k[:, :, : T - 1],
            v[:, :, : T - 1],
            AttentionMetadata(pos[: T - 1], is_causal=True),
        ),
        (q.double(), k.double(), v.double(), causal),
        (q.clone().requires_grad_(), k, v, causal),
    ]
    for n, (qq, kk, vv, meta) in enumerate(cases, start=1):
        impl(qq, kk, vv, meta)
        assert spy.calls == n and used == [1]
