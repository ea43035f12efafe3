"""GGUF (llama.cpp) quantised blocks read directly: Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q6_K
(CS336 notes "量化": block formats with per-block scales).

Byte layouts, one block (little-endian, f16 = IEEE half):

  Q4_0  32 weights, 18 B: d f16 | 16 B codes; w_j = (q_j − 8)·d, q_j = low nibble of byte j (j < 16),
        high nibble of byte j − 16 (j ≥ 16)
  Q4_1  32 weights, 20 B: d f16 | m f16 | 16 B codes (as Q4_0);  w = q·d + m
  Q8_0  32 weights, 34 B: d f16 | 32 int8;  w = q·d
  Q4_K  256 weights, 144 B: d f16 | dmin f16 | 12 B of eight 6-bit (scale, min) pairs | 128 B codes;
        sub-block b (32 weights) has w = d·sc_b·q − dmin·m_b; bytes 32c..32c+31 hold sub-block 2c in
        their low nibbles and 2c+1 in their high nibbles. Pairs b < 4: sc = B[b] & 63, m = B[b+4] & 63;
        b ≥ 4: sc = (B[b+4] & 15) | (B[b−4] >> 6) << 4, m = (B[b+4] >> 4) | (B[b] >> 6) << 4
  Q6_K  256 weights, 210 B: 128 B low 4 bits (ql) | 64 B high 2 bits (qh) | 16 int8 scales | d f16;
        per half n (128 weights) and l < 32, with ql, qh, sc advanced by 64, 32, 8 per half:
        q(l) = ql[l] & 15 | (qh[l] & 3) << 4,  q(l+32) = ql[l+32] & 15 | (qh[l] >> 2 & 3) << 4,
        q(l+64) = ql[l] >> 4 | (qh[l] >> 4 & 3) << 4,  q(l+96) = ql[l+32] >> 4 | (qh[l] >> 6) << 4,
        w(i) = d·sc[i / 16]·(q(i) − 32)

``dequantize_gguf`` turns rows of blocks into floats (checked against ``gguf.quants.dequantize``);
``gguf_int4`` turns Q4_0 / Q4_1 / Q4_K rows straight into the (codes, scale, min) triple of
``Int4Linear`` with groups of 32 — the codes are copied, not re-rounded from floats.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

GGUF_BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


class GGUFQuantError(ValueError):
    """A GGUF quant type lmstack does not read, or bytes that are not whole blocks of it."""


def _blocks(raw, qtype: str) -> tuple[Tensor, tuple[int, ...]]:
    """raw (..., bytes per row) uint8 -> (blocks (n, block bytes) uint8, leading shape)."""
    if qtype not in GGUF_BLOCKS:
        raise GGUFQuantError(
            f"GGUF quant type {qtype!r} is not read by lmstack.quant; expected one of "
            f"{tuple(GGUF_BLOCKS)} (other types: dequantise with the gguf package)"
        )
    if isinstance(raw, Tensor):
        t = raw
    else:
        a = np.asarray(raw)
        t = torch.from_numpy(
            a if a.flags.writeable and a.flags.c_contiguous else a.copy()
        )  # a memmap is read-only
    if t.dtype != torch.uint8:
        raise GGUFQuantError(f"expected raw uint8 bytes, got {t.dtype}")
    _, size = GGUF_BLOCKS[qtype]
    if t.shape[-1] % size:
        raise GGUFQuantError(
            f"a row of {t.shape[-1]} bytes is not a whole number of {qtype} blocks of {size} bytes"
        )
    return t.reshape(-1, size), tuple(t.shape[:-1])


def _f16(b: Tensor) -> Tensor:
    """(n, 2) uint8 little-endian halves -> (n,) fp32."""
    return b.contiguous().view(torch.float16).reshape(-1).float()


def _nibbles(qs: Tensor) -> Tensor:
    """(n, 16·k) bytes -> (n, 32·k) codes: per 16-byte run, the low nibbles then the high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 16)
    return torch.cat([q & 15, q >> 4], dim=-1).reshape(n, -1)


def _k4_scale_min(sc: Tensor) -> tuple[Tensor, Tensor]:
    """(n, 12) bytes -> 6-bit (scale, min), each (n, 8)."""
    lo, mid, hi = sc[:, 0:4].long(), sc[:, 4:8].long(), sc[:, 8:12].long()
    s = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return s.float(), m.float()


def _q4k_codes(qs: Tensor) -> Tensor:
    """(n, 128) -> (n, 256): chunk c of 32 bytes gives sub-block 2c (low nibbles), 2c+1 (high)."""
    q = qs.reshape(-1, 4, 32)
    return torch.stack([q & 15, q >> 4], dim=2).reshape(-1, 256)


def _q6k(b: Tensor) -> Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128].long(), b[:, 128:192].long()
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    d = _f16(b[:, 208:210])
    out = []
    for half in range(2):
        L, H = ql[:, 64 * half : 64 * half + 64], qh[:, 32 * half : 32 * half + 32]
        q = torch.cat(
            [
                (L[:, :32] & 15) | ((H & 3) << 4),
                (L[:, 32:] & 15) | (((H >> 2) & 3) << 4),
                (L[:, :32] >> 4) | (((H >> 4) & 3) << 4),
                (L[:, 32:] >> 4) | (((H >> 6) & 3) << 4),
            ],
            dim=1,
        )
        s = sc[:, 8 * half : 8 * half + 8].repeat_interleave(16, dim=1)  # (n, 128)
        out.append(d[:, None] * s * (q - 32).float())
    return torch.cat(out, dim=1).reshape(n, 256)


def dequantize_gguf(raw, qtype: str) -> Tensor:
    """Rows of ``qtype`` blocks (..., bytes per row) uint8 -> (..., weights per row) fp32."""
    b, lead = _blocks(raw, qtype)
    if qtype in INT4_TYPES:
        q, s, lo = _int4_blocks(b, qtype)
        w = q.float().reshape(b.shape[0], -1, 32) * s[..., None] + lo[..., None]
    elif qtype == "Q8_0":
        w = b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])[:, None]
    else:
        w = _q6k(b)
    return w.reshape(*lead, -1)


def _int4_blocks(b: Tensor, qtype: str) -> tuple[Tensor, Tensor, Tensor]:
    """blocks -> (codes (n, per block), scale (n, per block / 32), min (n, per block / 32))."""
    if qtype == "Q4_0":
        d = _f16(b[:, :2])
        return _nibbles(b[:, 2:]), d[:, None], (-8.0 * d)[:, None]
    if qtype == "Q4_1":
        return _nibbles(b[:, 4:]), _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = _k4_scale_min(b[:, 4:16])
    return _q4k_codes(b[:, 16:]), d[:, None] * sc, -(dmin[:, None] * m)


def gguf_int4(raw, qtype: str) -> tuple[Tensor, Tensor, Tensor]:
    """Rows (R, bytes) of Q4_0 / Q4_1 / Q4_K -> (Q (R, C) uint8, scales (R, C/32), mins (R, C/32)) for
    ``Int4Linear`` (group size 32): Ŵ = Q·scale + min reproduces the block formula."""
    if qtype not in INT4_TYPES:
        raise GGUFQuantError(
            f"GGUF quant type {qtype!r} has no int4 layout for Int4Linear; expected one of "
            f"{INT4_TYPES} (dequantize_gguf reads {tuple(GGUF_BLOCKS)})"
        )
    b, lead = _blocks(raw, qtype)
    if len(lead) != 1:
        raise GGUFQuantError(f"expected rows (R, bytes) of a 2-D weight, got leading shape {lead}")
    q, s, lo = _int4_blocks(b, qtype)
    R = lead[0]
    return q.reshape(R, -1).to(torch.uint8), s.reshape(R, -1), lo.reshape(R, -1)
