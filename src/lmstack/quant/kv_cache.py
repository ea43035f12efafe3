"""A KV cache stored in int8 (or fp8 e4m3) blocks with one scale per block and head (seed 001
"性能指标分析": Memory_KV = 2·P·B·S·L·K·H, so P = 1 byte halves the bf16 cache).

Positions are grouped in blocks of ``block_size``; per (layer, row, KV head, block) the K (and V)
values of the block's block_size × H elements share a symmetric scale s = max|x| / 127 (int8) or
max|x| / 448 (fp8 e4m3), codes = round(x / s). A block is quantised once, when it is full; the
open block (fewer than block_size positions) is kept in the compute dtype, so appending a token
never re-rounds stored codes. Keys/values are dequantised for attention (the CPU has no int8
attention kernel): the cache saves memory, not time.

Tokens must arrive in order (prefill, then decode steps), as in batch-1 generation; any cache
object passed as ``kv_cache=`` works with the model unchanged (``seam.StoreThenAttend``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmstack.model.config import ModelConfig
from lmstack.model.seam import StoreThenAttend

KV_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def quantize_block(x: Tensor, fmt: str = "int8") -> tuple[Tensor, Tensor]:
    """x (..., bs, H) -> (codes (..., bs, H), scale (...,)): one symmetric scale per leading index."""
    dt, qmax = KV_FORMATS[fmt]
    amax = x.detach().float().abs().amax(dim=(-2, -1))
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = x.float() / s[..., None, None]
    codes = (
        torch.round(y).clamp(-qmax, qmax).to(dt)
        if dt == torch.int8
        else y.clamp(-qmax, qmax).to(dt)
    )
    return codes, s


class QuantizedKVCache(StoreThenAttend):
    """K/V for L layers, B rows, up to ``max_seq_len`` positions, in ``fmt`` blocks of ``block_size``."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        fmt: str = "int8",
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
    ):
        if fmt not in KV_FORMATS:
            raise ValueError(f"KV cache format={fmt!r}; expected one of {tuple(KV_FORMATS)}")
        if max_seq_len % block_size:
            raise ValueError(
                f"max_seq_len={max_seq_len} is not a multiple of block_size={block_size}"
            )
        L, B, K, H = config.n_layers, batch_size, config.n_kv_heads, config.head_dim
        nb = max_seq_len // block_size
        self.fmt, self.block_size, self.dtype = fmt, block_size, dtype
        code_dt = KV_FORMATS[fmt][0]
        self.codes = torch.zeros(
            2, L, B, K, nb, block_size, H, dtype=code_dt
        )  # (K|V, L, B, K, S/bs, bs, H)
        self.scales = torch.ones(2, L, B, K, nb, dtype=torch.float32)  # one per block and head
        self.open = torch.zeros(2, L, B, K, block_size, H, dtype=dtype)  # the block being filled
        self.lengths = [0] * L  # positions stored per layer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.open))

    def update(
        self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Store k, v (B, K, T, H) at positions n .. n+T−1 (n = what the layer holds); return (B, K, S, H) x2, (B, S)."""
        B, K, T, H = k.shape
        n = self.lengths[layer_idx]
        pos = positions if positions.dim() == 1 else positions[0]
        if (
            pos.numel() != T
            or int(pos[0]) != n
            or (T > 1 and not torch.equal(pos, torch.arange(n, n + T)))
        ):
            raise ValueError(
                f"QuantizedKVCache stores tokens in order: expected positions {n}..{n + T - 1}, got "
                f"{pos.tolist()[:4]}{'...' if T > 4 else ''}"
            )
        bs = self.block_size
        if n + T > self.codes.shape[4] * bs:
            raise ValueError(
                f"position {n + T - 1} is past the cache's max_seq_len={self.codes.shape[4] * bs}"
            )
        new = torch.stack([k, v]).to(self.dtype)  # (2, B, K, T, H)
        filled = n % bs
        stream = torch.cat(
            [self.open[:, layer_idx, :, :, :filled], new], dim=3
        )  # (2, B, K, filled + T, H)
        first_block = n // bs
        full = stream.shape[3] // bs
        if full:
            blocks = stream[:, :, :, : full * bs].reshape(2, B, K, full, bs, H)
            codes, s = quantize_block(blocks, self.fmt)
            self.codes[:, layer_idx, :, :, first_block : first_block + full] = codes
            self.scales[:, layer_idx, :, :, first_block : first_block + full] = s
        rest = stream.shape[3] - full * bs
        self.open[:, layer_idx, :, :, :rest] = stream[:, :, :, full * bs :]
        self.lengths[layer_idx] = n + T
        S = n + T
        nfull = S // bs
        deq = (
            self.codes[:, layer_idx, :, :, :nfull].to(self.dtype)
            * self.scales[:, layer_idx, :, :, :nfull, None, None].to(self.dtype)
        ).reshape(2, B, K, nfull * bs, H)
        kv = torch.cat(
            [deq, self.open[:, layer_idx, :, :, : S - nfull * bs]], dim=3
        )  # (2, B, K, S, H)
        return kv[0], kv[1], torch.arange(S).expand(B, S)
