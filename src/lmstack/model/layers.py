"""The building blocks of the Transformer, written on nn.Module / nn.Parameter only.

Book of LLMs §1.2 (the forward pass), §1.3 (RoPE tables and element-wise rotation), §1.10 (RMSNorm),
§1.11 (SwiGLU), §1.12 (RoPE's relative-position property); CS336 notes "归一化", "激活函数", "位置编码".
Weights are stored in the (out, in) orientation that HF checkpoints use, so loading is a copy. Which GEMM a
``Linear`` runs (oneDNN or torch's BLAS, per CPU) is ``lmstack.ops.gemm``'s choice, not the model's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.ops.gemm import linear

if TYPE_CHECKING:
    from lmstack.model.seam import NormImpl


class Linear(nn.Module):
    """y = x Wᵀ (+ b), with W of shape (out_features, in_features), through ``ops.gemm.linear``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        """Truncated normal N(0, std²) cut at ±3·std; std defaults to 1/sqrt(in_features)."""
        std = std if std is not None else 1.0 / math.sqrt(self.in_features)
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def fuse_linears(modules: Sequence[nn.Module]) -> tuple[Tensor | nn.Module, Tensor | None] | None:
    """One weight (ΣO, I) (and bias) whose row blocks are these linears' weights, for one GEMM in place of
    several on the same input (QKV, gate/up). The linears' parameters become views of it, so in-place
    updates (``load_state_dict``, an optimizer step) reach the fused copy; a parameter replaced by a new
    tensor does not (fuse again). Quantised linears of one class (``Int4Linear``, ``Int8Linear``: a
    classmethod ``concat_rows``) give one fused quantised module instead, (module, None): one activation
    quantisation and one kernel call (``quant.linear.WeightOnlyLinear.concat_rows``). None when they are
    not all plain ``Linear`` (or all one quantised class) of one input size, dtype and device (wrapped
    linears, LoRA) or were fused already."""
    kind = type(modules[0]) if len(modules) else None
    if hasattr(kind, "concat_rows") and all(type(m) is kind for m in modules):
        fused_module = kind.concat_rows(modules)  # type: ignore[union-attr]
        return None if fused_module is None else (fused_module, None)
    if not all(type(m) is Linear for m in modules):
        return None
    linears = cast("list[Linear]", list(modules))
    ws = [m.weight for m in linears]
    if (
        len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1
        or len({m.bias is None for m in linears}) != 1
    ):
        return None
    W = torch.cat([w.detach() for w in ws])  # (ΣO, I)
    b = (
        None
        if linears[0].bias is None
        else torch.cat([m.bias.detach() for m in linears if m.bias is not None])
    )
    o = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = W[o : o + n]
        if b is not None and m.bias is not None:  # all linears have a bias, or none
            m.bias.data = b[o : o + n]
        o += n
    return W, b


def fused_linear(
    x: Tensor, w: Tensor | nn.Module, b: Tensor | None = None, parts: Sequence[nn.Module] = ()
) -> Tensor:
    """x through what ``fuse_linears`` returned: a fused weight (and bias) or a fused quantised module.
    ``parts``: the fused linears; their weights' version counters (not the fused weight's) move when they are
    written in place, and ``ops.gemm.linear`` keys its prepacked copy of the fused weight on them."""
    if isinstance(w, nn.Module):
        return w(x)
    return linear(x, w, b, [cast(Tensor, m.weight) for m in parts])


def still_fused(linears: list[nn.Module], fused: Tensor | nn.Module) -> bool:
    """Whether the fused linears' weights are still the row blocks of ``fused`` (``fuse_linears``; a fused
    quantised module: its ``qweight`` codes): False once a parameter was replaced (``model.to``, a new
    ``nn.Parameter``) — callers pass the modules they hold now, so a replaced module counts too; not checked
    while compiling (a compiled graph is traced once)."""
    if torch.compiler.is_compiling():
        return True
    name = "qweight" if isinstance(fused, nn.Module) else "weight"
    ref = cast(Tensor, fused.qweight) if isinstance(fused, nn.Module) else fused
    ptr, step = ref.data_ptr(), ref.stride(0) * ref.element_size()
    for (
        m
    ) in linears:  # a module replaced since (quantised, LoRA-wrapped) may have no weight of its own
        w = getattr(m, name, None)
        if not isinstance(w, Tensor) or w.data_ptr() != ptr:
            return False
        ptr += w.shape[0] * step
    return True


class Embedding(nn.Module):
    """Lookup W_e[tokens]: (B, S) int -> (B, S, D)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        )
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.weight[tokens]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(mean(x²) + eps) ⊙ γ over the last dim, in fp32, cast back to x's dtype (Book of LLMs §1.10 “RMSNorm”).

    When x and γ share a dtype (the fp32 residual stream) this is ``F.rms_norm``: the same formula,
    whose CPU/CUDA backward is one fused kernel instead of the half-dozen ops autograd would record.
    """
    if x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) ⊙ γ, computed in fp32 and cast back (Book of LLMs §1.10 “RMSNorm”).

    The seed writes x / (RMS(x) + eps); lmstack puts eps inside the square root as Llama,
    Mistral, Qwen2 and every HF checkpoint do, so that real weights reproduce their logits.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.dim, self.eps = dim, eps
        # None: the formula below; else a NormImpl from lmstack.kernels.backends (e.g. the fused Triton kernel)
        self.impl: NormImpl | None = None
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))  # γ

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:  # (..., D) -> (..., D)
        if self.impl is not None:
            return self.impl(x, self.weight, self.eps)
        y = rms_norm(x, self.weight, self.eps)
        if torch.is_autocast_enabled(y.device.type):
            # Every consumer (q/k/v, gate/up, the unembedding) is an autocast matmul that would cast
            # y to the autocast dtype itself, once per consumer; casting here once gives the same
            # values and one copy instead of three (attention) or two (SwiGLU).
            y = y.to(torch.get_autocast_dtype(y.device.type))
        return y

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class SwiGLU(nn.Module):
    """FFN(x) = W_down (Swish(x W_gate) ⊙ x W_up), Swish(g) = g·σ(g) (Book of LLMs §1.2 “the forward pass layer by layer”, §1.11)."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.gate_proj = Linear(d_model, d_ff, device=device, dtype=dtype)  # W_gate (F, D)
        self.up_proj = Linear(d_model, d_ff, device=device, dtype=dtype)  # W_up (F, D)
        self.down_proj = Linear(d_ff, d_model, device=device, dtype=dtype)  # W_down (D, F)
        # [W_gate; W_up] (2F, D) once ``fuse`` ran, or the fused quantised module: one GEMM for both (a tuple,
        # so a fused module is no submodule: checkpoints are unchanged)
        self.gate_up: tuple[Tensor | nn.Module] | None = None

    def fuse(self) -> bool:
        """Compute gate and up with one GEMM from now on (``fuse_linears``); False where they cannot be fused."""
        fused = fuse_linears([self.gate_proj, self.up_proj]) if self.gate_up is None else None
        if fused is not None:
            self.gate_up = (fused[0],)
        return self.gate_up is not None

    def forward(self, x: Tensor) -> Tensor:  # (B, S, D) -> (B, S, D)
        if self.gate_up is not None and not still_fused(
            [self.gate_proj, self.up_proj], self.gate_up[0]
        ):
            self.gate_up = None  # a parameter was replaced: back to the separate linears
        if (
            self.gate_up is not None and not torch.is_grad_enabled()
        ):  # inference only: with autograd the separate
            # linears, whose parameters the gradients must reach (the fused weight is no parameter)
            g, u = fused_linear(x, self.gate_up[0], None, [self.gate_proj, self.up_proj]).chunk(
                2, dim=-1
            )  # (B, S, F) x2
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # hidden (B, S, F)


def rope_frequencies(head_dim: int, theta: float) -> Tensor:
    """θ_i = Θ^(-2i/H) for i = 0 .. H/2 - 1 (Book of LLMs §1.2 “the forward pass layer by layer”), in float64 for exact tables."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (H/2,)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, layout: str) -> Tensor:
    """x ⊙ cos + rot(x) ⊙ sin in cos's dtype, returned in x's dtype (Book of LLMs §1.3 “implementation details in PyTorch”).

    rot(x) = [-x_{H/2:}, x_{:H/2}] (``half``) or [-x1, x0, -x3, x2, ...] (``interleaved``); it is
    written as two in-place multiply-adds on the halves / the even and odd lanes, so neither rot(x)
    nor a concatenation is ever materialised.
    """
    xc = x.to(cos.dtype)
    out = xc * cos
    if layout == "interleaved":
        x0, x1, o0, o1, s0, s1 = (
            xc[..., 0::2],
            xc[..., 1::2],
            out[..., 0::2],
            out[..., 1::2],
            sin[..., 0::2],
            sin[..., 1::2],
        )
    else:
        h = x.shape[-1] // 2
        x0, x1, o0, o1, s0, s1 = (
            xc[..., :h],
            xc[..., h:],
            out[..., :h],
            out[..., h:],
            sin[..., :h],
            sin[..., h:],
        )
    o0.addcmul_(x1, s0, value=-1.0)  # first of each pair:  x0 cos - x1 sin
    o1.addcmul_(x0, s1)  # second of each pair: x1 cos + x0 sin
    return out.to(x.dtype)


class _Rotate(torch.autograd.Function):
    """R_m x with backward R_mᵀ g = R_{-m} g: the same rotation with sin negated, since
    rot is a quarter turn within each pair and cos/sin are equal on both lanes of a pair."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, layout: str) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.layout = layout
        return rotate(x, cos, sin, layout)

    @staticmethod
    def backward(ctx, g: Tensor):
        cos, sin = ctx.saved_tensors
        return rotate(g, cos, -sin, ctx.layout), None, None, None


class RotaryEmbedding(nn.Module):
    """RoPE with precomputed cos/sin tables, applied by element-wise products (Book of LLMs §1.3 “implementation details in PyTorch”, §1.12).

    ``layout="interleaved"`` rotates the pairs (2i, 2i+1):  x ⊙ cos + x̃ ⊙ sin with
    x̃ = [-x1, x0, -x3, x2, ...] (CS336 notes "位置编码").
    ``layout="half"`` rotates the pairs (i, i + H/2) as HF transformers does:
    x ⊙ cos + [-x_{H/2:}, x_{:H/2}] ⊙ sin.
    Both are the same rotation R_m up to a fixed permutation of the head dimensions.
    The tables are built per (device, dtype) for the positions used so far, not for all of
    ``max_seq_len`` (up to 2**24): they start at ``INITIAL_POSITIONS`` and double on demand (capped at
    ``max_seq_len``); they are not saved in checkpoints, so meta-device construction works. Positions
    are read back to the host only on CPU, or on an accelerator while the tables are shorter than
    ``max_seq_len``; under torch.compile the tables must already cover them (``reserve``).
    """

    INITIAL_POSITIONS = 8192
    position_scale = (
        1.0  # angles m·θ_i / position_scale (linear RoPE scaling sets it; exact for 1.0)
    )

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float = 10000.0, layout: str = "half"
    ):
        super().__init__()
        if layout not in ("half", "interleaved"):
            raise ValueError(f"rope layout={layout!r}; expected 'half' or 'interleaved'")
        self.head_dim, self.max_seq_len, self.theta, self.layout = (
            head_dim,
            max_seq_len,
            theta,
            layout,
        )
        self.length = min(max_seq_len, self.INITIAL_POSITIONS)  # positions the tables cover
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def reserve(self, n: int) -> None:
        """Make the tables cover positions 0 .. n-1 (doubling, capped at ``max_seq_len``)."""
        if n > self.max_seq_len:
            raise ValueError(
                f"position {n - 1} is beyond max_seq_len={self.max_seq_len} of the RoPE tables"
            )
        if n > self.length:
            self.length = min(self.max_seq_len, 1 << (n - 1).bit_length())
            self._cache.clear()

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos(mθ_i), sin(mθ_i) for m < ``self.length``, laid out for ``layout``: two (S, H) tensors."""
        key = (torch.device(device), dtype)
        if key not in self._cache:
            angles = torch.outer(
                torch.arange(self.length, dtype=torch.float64) / self.position_scale,
                rope_frequencies(self.head_dim, self.theta),
            )  # (S, H/2), exact in float64
            if self.layout == "interleaved":
                angles = angles.repeat_interleave(2, dim=-1)  # (S, H): θ0 θ0 θ1 θ1 ...
            else:
                angles = torch.cat([angles, angles], dim=-1)  # (S, H): θ0 θ1 ... θ0 θ1 ...
            self._cache[key] = (
                angles.cos().to(device=device, dtype=dtype),
                angles.sin().to(device=device, dtype=dtype),
            )
        return self._cache[key]

    def cover(self, positions: Tensor) -> None:
        """Grow the tables to cover ``positions`` (and refuse positions >= max_seq_len); reads the
        largest position back to the host only on CPU or while the tables can still grow."""
        if (
            positions.numel()
            and not torch.compiler.is_compiling()
            and (positions.device.type == "cpu" or self.length < self.max_seq_len)
        ):
            self.reserve(int(positions.max()) + 1)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (B, heads, S, H); positions: (B, S) or (S,) integer positions m < max_seq_len. Returns R_m x."""
        self.cover(positions)
        return self.rotate(x, positions)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """``forward`` for positions already covered (``cover``): no host read-back. A Transformer
        covers a forward's positions once, not once per layer for q and for k."""
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.tables(x.device, compute)
        cos, sin = cos[positions], sin[positions]  # (B, S, H) or (S, H)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, S, H), broadcast over heads
        return _Rotate.apply(x, cos, sin, self.layout)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, layout={self.layout!r}"
