"""The attention seam: every registered implementation equals the reference on the same metadata
(causal fast path, sliding window, packed documents, GQA/MQA, a KV cache offset with empty slots)."""

import pytest
import torch

from lmstack.kernels.backends import ATTENTION, attention_impl
from lmstack.model.seam import AttentionMetadata, reference_attention


def _qkv(B, N, K, T, S, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, N, T, H, generator=g, dtype=torch.float64),
        torch.randn(B, K, S, H, generator=g, dtype=torch.float64),
        torch.randn(B, K, S, H, generator=g, dtype=torch.float64),
    )


def _cases():
    B, T, _H = 2, 9, 8
    pos = torch.arange(T)
    docs = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    doc_pos = torch.stack([torch.cat([torch.arange(4), torch.arange(5)]), torch.arange(9)])
    # cache: 3 new queries at positions 6..8 over 12 slots, slots 9..11 empty (position -1)
    S = 12
    kpos = torch.cat([torch.arange(9), torch.full((3,), -1)]).expand(B, S)
    qpos = torch.arange(6, 9).expand(B, 3)
    return {
        "causal": (T, T, AttentionMetadata(pos, is_causal=True)),
        "causal-explicit": (T, T, AttentionMetadata(pos, pos)),
        "window": (T, T, AttentionMetadata(pos, window=3, is_causal=True)),
        "documents": (T, T, AttentionMetadata(doc_pos, document_ids=docs)),
        "cache-offset": (3, S, AttentionMetadata(qpos, kpos)),
        "cache-offset-window": (3, S, AttentionMetadata(qpos, kpos, window=4)),
    }


CASES = _cases()


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_every_implementation_equals_the_reference(name, case, heads, request):
    if name == "flash_triton":
        request.getfixturevalue("triton_interpreter")
    T, S, meta = CASES[case]
    N, K = heads
    H = 16  # the Triton kernel takes 16 ≤ H ≤ 256
    q, k, v = _qkv(2, N, K, T, S, H)
    if name in ("flash_triton", "matmul"):  # fp32 kernels (the Triton kernel takes fp32/fp16/bf16)
        q, k, v = q.float(), k.float(), v.float()
    mask = meta.mask()
    if mask is None:  # the causal triangle the fast path stands for
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    ref = reference_attention(q.double(), k.double(), v.double(), mask)
    out = attention_impl(name)(q, k, v, meta)
    assert out.shape == (2, N, T, H) and out.dtype == q.dtype
    tol = 1e-10 if q.dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_metadata_mask():
    pos = torch.arange(4)
    assert (
        AttentionMetadata(pos, is_causal=True).mask() is None
    )  # the implementation's own causal mask
    assert torch.equal(
        AttentionMetadata(pos, pos).mask(), torch.ones(4, 4, dtype=torch.bool).tril()
    )
    # a record passed on by a cache describes the cached keys and never takes the fast path
    m = AttentionMetadata(pos, is_causal=True, window=2).for_keys(torch.arange(6))
    assert not m.is_causal and m.cache is None and m.mask().shape == (4, 6)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="flash9.*expected one of"):
        attention_impl("flash9")
