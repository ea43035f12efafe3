"""The training fast paths of the model layers against plain torch formulas:
RoPE's in-place rotation and its backward, RMSNorm's single cast under autocast, return_hidden."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmstack.model import ModelConfig
from lmstack.model.layers import RMSNorm, RotaryEmbedding
from lmstack.model.transformer import Transformer


def _rope_tables(positions, head_dim, theta, layout):
    """cos(m·θ_i), sin(m·θ_i) with θ_i = theta^(−2i/H), i < H/2 (RoFormer; Book of LLMs §1.3 “implementation details in PyTorch”), written
    out element by element with ``math``: feature j uses θ_(j mod H/2) in the ``half`` layout and
    θ_(j // 2) in the ``interleaved`` one. Returns two float64 tensors positions.shape + (H,)."""
    H = head_dim
    angles = [
        [m * theta ** (-2 * (j % (H // 2) if layout == "half" else j // 2) / H) for j in range(H)]
        for m in positions.flatten().tolist()
    ]
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64)
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64)
    return cos.reshape(*positions.shape, H), sin.reshape(*positions.shape, H)


def _rope_reference(x, cos, sin, layout):
    """x ⊙ cos + rot(x) ⊙ sin with rot built explicitly (HF's rotate_half for ``half``)."""
    if layout == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat([-x2, x1], dim=-1)
    else:
        pairs = x.unflatten(-1, (-1, 2))
        rot = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return x * cos + rot * sin


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("batched_positions", [False, True])
def test_rope_forward_and_backward_match_autograd_of_the_formula(layout, batched_positions):
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(8, 32, theta=100.0, layout=layout)
    # (B, S, N, H) -> (B, N, S, H): strided like q after .view().transpose(1, 2)
    x = (
        torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
        .transpose(1, 2)
        .detach()
        .requires_grad_()
    )
    pos = torch.tensor([[0, 4, 9], [1, 2, 31]]) if batched_positions else torch.tensor([3, 7, 30])
    out = rope(x, pos)
    cos, sin = _rope_tables(pos, 8, 100.0, layout)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x_ref = x.detach().clone().requires_grad_()
    ref = _rope_reference(x_ref, cos, sin, layout)
    torch.testing.assert_close(out, ref)
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(up)
    ref.backward(up)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_rope_bf16_computes_in_fp32_and_rounds_once():
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(16, 64)
    x = torch.randn(2, 2, 10, 16, generator=g).bfloat16()
    pos = torch.arange(10)
    cos, sin = _rope_tables(pos, 16, 10000.0, "half")
    ref = _rope_reference(x.float(), cos.float(), sin.float(), "half").bfloat16()
    out = rope(x, pos)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_rmsnorm_under_autocast_returns_what_the_matmuls_would_cast_to():
    torch.manual_seed(0)
    norm = RMSNorm(32)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 32) * 4
    ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight).detach()
    torch.testing.assert_close(norm(x), ref, rtol=1e-6, atol=1e-6)  # fp32 outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(
        y, ref.bfloat16(), rtol=0, atol=1e-2
    )  # one rounding of the fp32 result


def test_return_hidden_is_the_input_of_the_unembedding():
    cfg = ModelConfig(
        vocab_size=50,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=16,
        tie_embeddings=True,
    )
    model = Transformer(cfg, seed=0)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    h = model(tokens, return_hidden=True)
    assert h.shape == (2, 9, 32)
    torch.testing.assert_close(F.linear(h, model.embed.weight), model(tokens))
