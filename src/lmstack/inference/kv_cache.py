"""A contiguous, preallocated KV cache (seed 000 §2.4).

Keys and values of every layer are stored in two tensors of shape (L, B, K, S_max, H), allocated
once: KV bytes = 2 · B · S_max · K · H · L · bytes per element (seed 000 §1.7). Each row of the
batch writes its tokens at their own positions, so left-padded or ragged batches work.
It plugs into the attention seam (``lmstack.model.seam``): ``attend`` stores K/V with ``update``, then
attends over every stored key.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmstack.model.config import ModelConfig
from lmstack.model.seam import StoreThenAttend


class KVCache(StoreThenAttend):
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if max_seq_len > config.max_seq_len:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_seq_len={config.max_seq_len}"
            )
        shape = (
            config.n_layers,
            batch_size,
            config.n_kv_heads,
            max_seq_len,
            config.head_dim,
        )  # (L, B, K, S, H)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.full(
            (batch_size, max_seq_len), -1, dtype=torch.long, device=device
        )  # (B, S)
        self.length = 0  # slots 0 .. length-1 may hold tokens

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length`` (speculative decoding rolls back rejected drafts)."""
        if length < 0:
            raise ValueError(f"length={length} must be >= 0")
        self.positions[:, length:] = -1
        self.length = min(self.length, length)

    def update(
        self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Store k, v (B, K, T, H) at ``positions`` (B, T) or (T,); return this layer's (B, K, S, H) x2 and (B, S)."""
        B, K, T, H = k.shape
        pos = positions.expand(B, T) if positions.dim() == 1 else positions  # (B, T)
        if int(pos.max()) >= self.k.shape[3]:
            raise ValueError(
                f"position {int(pos.max())} is past the cache's max_seq_len={self.k.shape[3]}"
            )
        index = pos[:, None, :, None].expand(B, K, T, H)
        self.k[layer_idx].scatter_(2, index, k.to(self.k.dtype))
        self.v[layer_idx].scatter_(2, index, v.to(self.v.dtype))
        if layer_idx == 0:
            self.positions.scatter_(1, pos, pos)
            self.length = max(self.length, int(pos.max()) + 1)
        S = self.length
        return self.k[layer_idx, :, :, :S], self.v[layer_idx, :, :, :S], self.positions[:, :S]
