"""Number formats in simulation: fp8 (e4m3 / e5m2), the OCP MX block formats (MXFP8, MXFP4) and NF4
(Book of LLMs §5 “numeric precision” the precision table; CS336 notes "低精度计算", "量化").

Each format has ``*_quantize`` (float -> codes + scales) and ``*_dequantize`` (back to float), and
``SimQuantLinear`` runs a linear on the dequantised weight (and, for W8A8, on a fake-quantised
activation): the numbers a kernel for that format would produce, at float speed — this CPU has no
fp8/fp4 matmul units.

- **fp8** (torch.float8_e4m3fn: max 448, 3 mantissa bits; torch.float8_e5m2: max 57344, 2 bits):
  a scale s = amax / fp8_max per tensor or per output channel (rows of W; rows = tokens of x),
  codes = fp8(W / s), saturated to ±fp8_max before the cast (torch's cast does not saturate).
- **MX** (OCP Microscaling spec v1.0): blocks of 32 consecutive elements along the last dim share
  one E8M0 scale X = 2^e (a byte: e + 127; 255 = NaN), e = floor(log2 max|v|) − emax_elem, with
  emax_elem = 8 (FP8 e4m3) or 2 (FP4 e2m1); elements P = round(v / X) in the element format,
  saturating at its largest normal. FP4 e2m1 holds ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; codes are
  sign << 3 | magnitude index, rounding to nearest, ties to the even index (even mantissa).
- **NF4** (QLoRA, Dettmers et al. 2023; bitsandbytes' table): 16 values, quantiles of N(0, 1)
  scaled to [−1, 1] with an exact 0; blocks of 64 with an absmax scale; the nearest value's index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.layers import Linear

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MX_BLOCK = 32
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # e2m1 magnitudes by code
NF4_VALUES = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)  # bitsandbytes' NF4 code book, index = code
NF4_BLOCK = 64


# ---- fp8 -----------------------------------------------------------------------------------------------------


def _fp8_dtype(fmt: str) -> torch.dtype:
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fp8 format={fmt!r}; expected one of {tuple(FP8_DTYPES)}")
    return FP8_DTYPES[fmt]


def fp8_quantize(x: Tensor, fmt: str = "e4m3", per: str = "tensor") -> tuple[Tensor, Tensor]:
    """x (R, C) -> (codes (R, C) float8, scale () or (R, 1) fp32) with x ≈ codes · scale.

    ``per="tensor"``: one scale; ``per="channel"``: one per row (an output channel of W, a token of x)."""
    dt = _fp8_dtype(fmt)
    if per not in ("tensor", "channel"):
        raise ValueError(f"per={per!r}; expected 'tensor' or 'channel'")
    fmax = torch.finfo(dt).max
    xf = x.detach().float()
    amax = xf.abs().amax() if per == "tensor" else xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    codes = (xf / scale).clamp(-fmax, fmax).to(dt)
    return codes, scale


def fp8_dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    return codes.float() * scale


# ---- MX block formats ---------------------------------------------------------------------------------------

MX_ELEMENTS = {"mxfp8": (torch.float8_e4m3fn, 8), "mxfp4": (None, 2)}  # element dtype, emax_elem


def _blocks(x: Tensor) -> Tensor:
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(
            f"last dimension {x.shape[-1]} is not a multiple of the MX block size {MX_BLOCK}"
        )
    return x.detach().float().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)


def fp4_e2m1_encode(v: Tensor) -> Tensor:
    """Round v (already divided by the block scale) to e2m1: code = sign << 3 | index of the magnitude,
    nearest value, ties to the even index, saturating at 6."""
    mag = v.abs().clamp(max=6.0)
    d = (mag[..., None] - FP4_VALUES).abs()  # (..., 8)
    best = d.min(dim=-1, keepdim=True).values
    tie = d == best
    idx = torch.arange(8)
    # among the nearest values prefer an even index (even mantissa), then the smaller
    rank = torch.where(tie, (idx % 2) * 8 + idx, torch.full_like(idx, 100))
    code = rank.argmin(dim=-1).to(torch.uint8)
    sign = ((v < 0) & (code > 0)).to(torch.uint8)
    return sign << 3 | code


def fp4_e2m1_decode(code: Tensor) -> Tensor:
    mag = FP4_VALUES[(code & 7).long()]
    return torch.where((code >> 3) & 1 == 1, -mag, mag)


def mx_quantize(x: Tensor, fmt: str = "mxfp4") -> tuple[Tensor, Tensor]:
    """x (..., C) -> (elements (..., C/32, 32): uint8 e2m1 codes or float8_e4m3fn, E8M0 scales (..., C/32) uint8)."""
    if fmt not in MX_ELEMENTS:
        raise ValueError(f"MX format={fmt!r}; expected one of {tuple(MX_ELEMENTS)}")
    dt, emax = MX_ELEMENTS[fmt]
    b = _blocks(x)  # (..., C/32, 32)
    amax = b.abs().amax(dim=-1)  # (..., C/32)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - emax, torch.full_like(amax, -127.0))
    e = e.clamp(-127, 127)
    v = b / torch.exp2(e)[..., None]
    if dt is None:
        elems = fp4_e2m1_encode(v)
    else:
        fmax = torch.finfo(dt).max
        elems = v.clamp(-fmax, fmax).to(dt)
    return elems, (e + 127).to(torch.uint8)


def mx_dequantize(elems: Tensor, scales: Tensor) -> Tensor:
    """The inverse: (..., C/32, 32), (..., C/32) -> (..., C) float32; scale byte 255 is NaN."""
    v = fp4_e2m1_decode(elems) if elems.dtype == torch.uint8 else elems.float()
    X = torch.exp2(scales.float() - 127)
    X = torch.where(scales == 255, torch.full_like(X, float("nan")), X)
    out = v * X[..., None]
    return out.reshape(*out.shape[:-2], -1)


# ---- NF4 ----------------------------------------------------------------------------------------------------


def nf4_quantize(x: Tensor, block: int = NF4_BLOCK) -> tuple[Tensor, Tensor]:
    """x (numel divisible by ``block``) -> (codes (n/block, block) uint8 in 0..15, absmax (n/block,) fp32)."""
    flat = x.detach().float().reshape(-1)
    if flat.numel() % block:
        raise ValueError(
            f"{flat.numel()} elements are not a multiple of the NF4 block size {block}"
        )
    b = flat.view(-1, block)
    absmax = b.abs().amax(dim=1)
    absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    v = b / absmax[:, None]
    codes = (v[..., None] - NF4_VALUES).abs().argmin(dim=-1).to(torch.uint8)
    return codes, absmax


def nf4_dequantize(codes: Tensor, absmax: Tensor, shape: tuple[int, ...] | None = None) -> Tensor:
    out = NF4_VALUES[codes.long()] * absmax[:, None]
    return out.reshape(shape) if shape is not None else out.reshape(-1)


# ---- a linear in a simulated format --------------------------------------------------------------------------

SIM_FORMATS = ("fp8-e4m3", "fp8-e5m2", "fp8-e4m3-w8a8", "mxfp8", "mxfp4", "nf4")


def simulate_weight(weight: Tensor, fmt: str, per: str = "channel") -> tuple[Tensor, int]:
    """(Ŵ (O, I) fp32, storage bytes) of W in a simulated format."""
    O, I = weight.shape
    if fmt.startswith("fp8-"):
        codes, s = fp8_quantize(weight, fmt.split("-")[1], per)
        return fp8_dequantize(codes, s), O * I + s.numel() * 4
    if fmt in ("mxfp8", "mxfp4"):
        elems, sc = mx_quantize(weight, fmt)
        return mx_dequantize(elems, sc), (O * I if fmt == "mxfp8" else O * I // 2) + sc.numel()
    if fmt == "nf4":
        codes, absmax = nf4_quantize(weight)
        return nf4_dequantize(codes, absmax, (O, I)), O * I // 2 + absmax.numel() * 4
    raise ValueError(f"simulated format={fmt!r}; expected one of {SIM_FORMATS}")


class SimQuantLinear(nn.Module):
    """y = fq(x) Ŵᵀ (+ b): Ŵ the weight through a simulated format; for ``*-w8a8`` the activation too
    (fp8 e4m3, one dynamic scale per token row). Float matmul: numbers, not speed."""

    def __init__(self, weight: Tensor, fmt: str, bias: Tensor | None = None, per: str = "channel"):
        super().__init__()
        self.fmt = fmt
        w_hat, self.storage_bytes = simulate_weight(weight.detach(), fmt.removesuffix("-w8a8"), per)
        self.register_buffer("w_hat", w_hat)
        self.out_features, self.in_features = weight.shape
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.fmt.endswith("-w8a8"):
            x2 = x.reshape(-1, self.in_features)
            x = fp8_dequantize(*fp8_quantize(x2, "e4m3", "channel")).reshape(x.shape).to(x.dtype)
        return F.linear(
            x, self.w_hat.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )

    def kernel_bytes(self) -> int:
        return self.storage_bytes


@torch.no_grad()
def simulate_model(
    model: nn.Module, fmt: str, lm_head: bool = True, per: str = "channel"
) -> nn.Module:
    """Swap every block ``Linear`` (and the unembedding when ``lm_head``) for ``SimQuantLinear`` in ``fmt``."""
    if fmt not in SIM_FORMATS:
        raise ValueError(f"simulated format={fmt!r}; expected one of {SIM_FORMATS}")
    for block in model.blocks:
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, Linear):
                    setattr(parent, name, SimQuantLinear(child.weight, fmt, child.bias, per))
    if lm_head:
        W = model.embed.weight if model.lm_head is None else model.lm_head.weight
        model.lm_head = SimQuantLinear(W, fmt, None, per)
    model.quantization = fmt
    return model
