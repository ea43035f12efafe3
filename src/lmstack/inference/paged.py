"""Paged KV storage and the batches that attend over it (seed 001 "动态负载", vLLM PagedAttention).

Storage is two tensors (L, num_blocks, bs, K, H): KV bytes = 2·P·(num_blocks·bs)·L·K·H, the
accounting formula (seed 001 "性能指标分析") with B·S = num_blocks·bs. Which block holds what is
the ``BlockManager``'s business (``cache.blocks``); this module moves K/V and builds one forward's
view of the pool. A batch object plugs into the attention seam (``lmstack.model.seam``): its
``attend`` scatters this step's K/V into their slots, gathers each sequence's blocks with their
positions (−1 = empty) and calls the model's attention implementation on them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from lmstack.inference.block_manager import BlockManager
from lmstack.model.config import ModelConfig
from lmstack.model.seam import AttentionImpl, AttentionMetadata


class PagedKVCache:
    """The block pool (L, num_blocks, bs, K, H) for K and V; ``blocks`` holds every sequence's block table."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 enable_prefix_caching: bool = True):
        self.config, self.block_size = config, block_size
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching, storage=self)
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)  # (L, NB, bs, K, H)
        self.stores_latent = config.is_mla  # MLA (model/mla.py): blocks hold [c ; k_R], d_c + d_R per token
        if self.stores_latent:
            shape = (config.n_layers, num_blocks, block_size, 1, config.kv_lora_rank + config.qk_rope_head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape[:-1] + (0,) if self.stores_latent else shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    # ---- what the block manager asks of the storage ------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    def block_is_finite(self, block: int) -> bool:
        return bool(torch.isfinite(self.k[:, block]).all() and torch.isfinite(self.v[:, block]).all())

    def zero_block(self, block: int) -> None:
        self.k[:, block].zero_()
        self.v[:, block].zero_()

    # ---- one forward pass ----------------------------------------------------------------
    def packed_batch(self, rows: Sequence[tuple[Hashable, int, int]], selective: bool = True
                     ) -> tuple["PackedPagedBatch", Tensor, Tensor]:
        """One flattened forward for rows (seq_id, start, n): every row's tokens side by side in one
        (1, T) row, T = Σ n, no padding (Orca's selective batching, seed 000 §2.2).

        Returns the seam object, positions (1, T) and sequence ids (1, T) (the row index of each
        token, for the model's ``document_ids``). ``selective=True`` gives a ``SelectivePagedBatch``
        (attention grouped per sequence: consecutive single-token rows as one batched decode,
        each longer row on its own); ``False`` the reference ``PackedPagedBatch`` (one attention
        over all gathered keys, masked by (sequence id, position)).
        """
        bs, device = self.block_size, self.k.device
        offsets = torch.arange(bs)
        positions, slots, seq_ids = [], [], []
        keys = []  # per row: (gather slots (S_r,), key positions (S_r,))
        for r, (seq_id, start, n) in enumerate(rows):
            table = self.blocks.tables[seq_id]
            end = start + n
            if n < 1 or self.blocks.blocks_for(end) > len(table):
                raise ValueError(f"sequence {seq_id!r} has {len(table)} blocks, needs {self.blocks.blocks_for(end)} "
                                 f"for tokens {start}..{end - 1}; call reserve() first")
            t = torch.tensor(table[:self.blocks.blocks_for(end)], dtype=torch.long)
            p = torch.arange(start, end)
            positions.append(p)
            slots.append(t[p // bs] * bs + p % bs)
            seq_ids.append(torch.full((n,), r, dtype=torch.long))
            live = self.blocks.first_live_block(seq_id)  # blocks before it were released (sliding window)
            g = (t[live:, None] * bs + offsets).flatten()  # (S_r,)
            kp = torch.arange(live * bs, live * bs + g.numel())
            kp[end - live * bs:] = -1  # slots past the last token are empty
            keys.append((g, kp))
        positions_t = torch.cat(positions)[None]  # (1, T)
        seq_t = torch.cat(seq_ids)[None]  # (1, T)
        cls = SelectivePagedBatch if selective else PackedPagedBatch
        batch = cls(self, torch.cat(slots).to(device), rows, keys, positions_t.to(device))
        return batch, positions_t.to(device), seq_t.to(device)


class PackedPagedBatch:
    """The seam for one flattened forward (1, T) over several sequences (``PagedKVCache.packed_batch``).

    ``attend`` scatters this step's k, v (1, K, T, H) into their slots and attends over every
    sequence's gathered keys side by side, (1, K, S, H) with S = Σ S_r, with their positions and
    sequence ids (1, S) in the metadata: the mask lets a token see only its own sequence's
    earlier keys. Reference path: the attention is computed over all T × S pairs.
    """

    def __init__(self, cache: PagedKVCache, slots: Tensor, rows, keys: list[tuple[Tensor, Tensor]],
                 positions: Tensor):
        self.cache, self.slots, self.rows, self.positions = cache, slots, rows, positions
        self.keys = keys
        device = cache.k.device
        self.lengths = [n for _, _, n in rows]
        self._flat = None  # (gather (S,), key positions (1, S), key sequence ids (1, S)), built on first use
        # Segments for grouped attention: runs of single-token rows batched together, longer rows alone.
        self.segments: list[tuple[int, int, Tensor, Tensor]] = []  # (t0, t1, gather (R, S), key pos (R, S))
        t0, r = 0, 0
        while r < len(rows):
            r1 = r + 1
            if self.lengths[r] == 1:
                while r1 < len(rows) and self.lengths[r1] == 1:
                    r1 += 1
            S = max(keys[i][0].numel() for i in range(r, r1))
            g = torch.zeros(r1 - r, S, dtype=torch.long)  # null block slots pad short rows
            kp = torch.full((r1 - r, S), -1, dtype=torch.long)
            for j, i in enumerate(range(r, r1)):
                g[j, :keys[i][0].numel()] = keys[i][0]
                kp[j, :keys[i][1].numel()] = keys[i][1]
            t1 = t0 + sum(self.lengths[r:r1])
            self.segments.append((t0, t1, g.to(device), kp.to(device)))
            t0, r = t1, r1

    @property
    def stores_latent(self) -> bool:
        """MLA: the model passes v=None and the values are the first d_c numbers of each latent key."""
        return self.cache.stores_latent

    def _write(self, layer_idx: int, k: Tensor, v: Tensor | None) -> tuple[Tensor, Tensor | None]:
        _, K, T, H = k.shape
        if k.shape[0] != 1 or self.slots.shape != (T,):
            raise ValueError(f"batch was prepared for (1, {self.slots.shape[0]}) tokens, got k of shape {tuple(k.shape)}")
        kc = self.cache.k[layer_idx].view(-1, K, H)  # (NB·bs, K, H)
        kc.index_copy_(0, self.slots, k[0].transpose(0, 1).to(kc.dtype))
        if v is None:  # a latent cache: the values are views of the keys
            return kc, None
        vc = self.cache.v[layer_idx].view(-1, K, v.shape[-1])
        vc.index_copy_(0, self.slots, v[0].transpose(0, 1).to(vc.dtype))
        return kc, vc

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata,
               impl: AttentionImpl) -> Tensor:
        """Store k, v (1, K, T, H); attend over every sequence's keys side by side, (1, K, S, H), S = Σ S_r."""
        kc, vc = self._write(layer_idx, k, v)
        if self._flat is None:
            device = self.slots.device
            g = torch.cat([g for g, _ in self.keys])
            kp = torch.cat([kp for _, kp in self.keys])
            ids = torch.cat([torch.full((g.numel(),), r, dtype=torch.long) for r, (g, _) in enumerate(self.keys)])
            self._flat = (g.to(device), kp[None].to(device), ids[None].to(device))
        g, kp, ids = self._flat
        k_all = kc.index_select(0, g).transpose(0, 1)[None].to(k.dtype)  # (1, K, S, H)
        if vc is None:  # MLA: values = the latent c, the first d_c of each key
            v_all = k_all[..., :self.cache.config.kv_lora_rank]
        else:
            v_all = vc.index_select(0, g).transpose(0, 1)[None].to(v.dtype)
        return impl(q, k_all, v_all, meta.for_keys(kp, ids))  # (1, N, T, H)


class SelectivePagedBatch(PackedPagedBatch):
    """``PackedPagedBatch`` whose attention is grouped per sequence (Orca's selective batching):
    the linears, norms and FFN run once over all T tokens; attention runs per segment — the
    decode tokens as one batch (R, N, 1, H) against their own gathered keys (R, K, S, H), each
    prefill chunk (1, N, n, H) against its sequence's keys — so no query meets another
    sequence's keys and nothing is computed for them.
    """

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata,
               impl: AttentionImpl) -> Tensor:
        positions = meta.positions  # (1, T)
        kc, vc = self._write(layer_idx, k, v)
        K, H = k.shape[1], k.shape[3]
        outs = []
        for t0, t1, g, kp in self.segments:
            R, S = g.shape
            ks = kc.index_select(0, g.flatten()).view(R, S, K, H).transpose(1, 2).to(q.dtype)  # (R, K, S, H)
            if vc is None:  # MLA: values = the latent c, the first d_c of each key
                vs = ks[..., :self.cache.config.kv_lora_rank]
            else:
                vs = vc.index_select(0, g.flatten()).view(R, S, K, -1).transpose(1, 2).to(q.dtype)
            if R > 1:  # R decode rows, one token each
                qs = q[0, :, t0:t1].transpose(0, 1)[:, :, None]  # (R, N, 1, H)
                qp = positions[0, t0:t1, None]  # (R, 1)
            else:
                qs = q[:, :, t0:t1]  # (1, N, n, H)
                qp = positions[:, t0:t1]  # (1, n)
            o = impl(qs, ks, vs, AttentionMetadata(qp, kp, window=meta.window))  # (R, N, n, H)
            outs.append(o[:, :, 0].transpose(0, 1)[None] if R > 1 else o)  # (1, N, n, H)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (1, N, T, H)
