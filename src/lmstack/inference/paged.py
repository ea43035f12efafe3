"""Paged KV storage and the batches that attend over it (CS336 notes "动态负载", vLLM PagedAttention).

Storage is two tensors (L, num_blocks, bs, K, H): KV bytes = 2·P·(num_blocks·bs)·L·K·H, the
accounting formula (CS336 notes "性能指标分析") with B·S = num_blocks·bs. Which block holds what is
the ``BlockManager``'s business (``cache.blocks``); this module moves K/V and builds one forward's
view of the pool. A batch object plugs into the attention seam (``lmstack.model.seam``): its
``attend`` scatters this step's K/V into their slots, gathers each sequence's blocks with their
positions (−1 = empty) and calls the model's attention implementation on them.

Quantised blocks (``dtype="int8"`` or ``"fp8"``, CS336 notes "低精度计算"): the pool holds 1-byte codes plus one
float32 scale per (layer, block, KV head) for K and for V, over the block's filled bs × H values, through the one
KV codec ``quant.kv_codec`` (int8 s = max|x|/127; fp8 e4m3 s = 2^⌈log2(max|x|/448)⌉, and why).
KV bytes = 2·1·NB·bs·L·K·H + 2·4·NB·L·K (``kv_pool_bytes``).
Blocks fill one token at a time, so a write re-quantises the blocks it touches: it dequantises
them, puts the new rows in, and keeps the old scale unless the new rows exceed it (then the
block is re-rounded on the larger scale; a block that starts at offset 0 takes a fresh scale).
Codes of a block whose scale did not grow come back unchanged. An int8 block whose scale grows is
rounded twice; an fp8 block's scale grows by a power of two, which only shifts the e4m3 exponents
(exact but for codes pushed below 2⁻⁶ into the subnormals). Gathering dequantises to the compute dtype
(no int8 attention kernel on the CPU): the pool saves memory, not time.

A batch object declares what it can do (``model.cache.Ability``): every one is ``PAGED`` and ``PACKED`` (its
metadata carries the keys' sequence ids), ``PREFIX_SHARING`` when the pool shares prompt blocks, ``QUANTISED``
for 1-byte blocks, ``LATENT`` for an MLA pool.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import cast

import torch
from torch import Tensor

from lmstack.accounting.memory import kv_layer_elements
from lmstack.inference import paged_kernel
from lmstack.inference.block_manager import BlockManager
from lmstack.model.cache import Ability
from lmstack.model.config import ModelConfig
from lmstack.model.mixer_spec import attention_kind, softmax_layers, spec
from lmstack.model.seam import AttentionImpl, AttentionMetadata
from lmstack.quant.kv_codec import KV_FORMATS, SCALE_BYTES, check_format, decode, encode, scale_for


def kv_layers(config: ModelConfig) -> list[int]:
    """The layers whose K/V live in the pool: the softmax-attention ones. A hybrid's recurrent layers keep
    their O(1) state in the engine's ``StatePool`` instead, so a 3:1 hybrid's pool is a quarter of a dense one's."""
    return softmax_layers(config)


#: ``--kv-cache-dtype`` names (vLLM's) -> what ``LLMEngine(kv_dtype=...)`` takes: a float dtype the pool
#: stores K/V in, or a quantised format of ``quant.kv_codec`` (codes with per-block scales)
KV_CACHE_DTYPES: dict[str, torch.dtype | str] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": "int8",
    "fp8": "fp8",
}


def kv_cache_dtype(name: str) -> torch.dtype | str:
    """The pool dtype of a ``--kv-cache-dtype`` name (``KV_CACHE_DTYPES``); a clear error for others."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {name!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def kv_pool_bytes(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype | str
) -> int:
    """Bytes of a pool of ``num_blocks`` blocks: the accounting formula 2·P·(NB·bs)·L·K·H (MLA: the latent)
    with L = the softmax-attention layers (``kv_layers``), P = 1 for "int8"/"fp8", plus for a quantised
    pool its 2·NB·L·K float32 scales."""
    L = len(kv_layers(config))
    elements = kv_layer_elements(config, 1, num_blocks * block_size) * L
    if isinstance(dtype, str) and dtype in KV_FORMATS:
        assert config.n_kv_heads is not None  # resolved by ModelConfig.__post_init__
        return elements + 2 * num_blocks * L * config.n_kv_heads * SCALE_BYTES
    return elements * torch.empty(0, dtype=cast(torch.dtype, dtype)).element_size()


def _raw(t: Tensor) -> Tensor:
    """fp8 codes moved as bytes (index_copy_ has no float8 kernel on the CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class PagedKVCache:
    """The block pool (L, num_blocks, bs, K, H) for K and V, L = the softmax-attention layers (``kv_layers``;
    a model layer's row is ``row[layer_idx]``); ``blocks`` holds every sequence's block table."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        enable_prefix_caching: bool = True,
    ):
        self.config, self.block_size = config, block_size
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching, storage=self)
        layers = kv_layers(config)
        self.row = {
            layer: r for r, layer in enumerate(layers)
        }  # model layer -> its row of the pool
        assert (
            config.n_kv_heads is not None and config.head_dim is not None
        )  # resolved by ModelConfig.__post_init__
        shape = (
            len(layers),
            num_blocks,
            block_size,
            config.n_kv_heads,
            config.head_dim,
        )  # (L, NB, bs, K, H)
        # MLA (model/mla.py): blocks hold [c ; k_R], d_c + d_R per token
        self.stores_latent = spec(attention_kind(config)).cache == "latent"
        self.quant = (
            dtype if isinstance(dtype, str) else None
        )  # "int8" / "fp8": codes + per-block scales
        # what the batch objects of this pool declare (model.cache): PACKED is theirs
        self.abilities = frozenset(
            {Ability.PAGED}
            | ({Ability.PREFIX_SHARING} if enable_prefix_caching else set())
            | ({Ability.QUANTISED} if self.quant is not None else set())
            | ({Ability.LATENT} if self.stores_latent else set())
        )
        if self.quant is not None:
            if self.quant not in KV_FORMATS:
                raise ValueError(
                    f"KV cache dtype={dtype!r}: a quantised pool is one of {tuple(KV_FORMATS)}"
                )
            if self.stores_latent:
                raise ValueError(
                    f"KV cache dtype={dtype!r}: quantised blocks hold K and V per KV head; "
                    "an MLA latent cache stays in a float dtype"
                )
            code_dtype, _ = check_format(self.quant)
            self.k = torch.zeros(shape, dtype=code_dtype, device=device)
            self.v = torch.zeros(shape, dtype=code_dtype, device=device)
            # s per (layer, block, KV head); 0 = nothing stored (dequantises to 0, grows on the first write)
            self.k_scale = torch.zeros(
                shape[:2] + shape[3:4], dtype=torch.float32, device=device
            )  # (L, NB, K)
            self.v_scale = torch.zeros_like(self.k_scale)
            return
        assert not isinstance(dtype, str)  # a str dtype is a quantised pool (above)
        if self.stores_latent:
            shape = (
                len(layers),
                num_blocks,
                block_size,
                1,
                config.kv_lora_rank + config.qk_rope_head_dim,
            )
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(
            shape[:-1] + (0,) if self.stores_latent else shape, dtype=dtype, device=device
        )

    @property
    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
        if self.quant is not None:
            n += (
                self.k_scale.numel() * self.k_scale.element_size()
                + self.v_scale.numel() * self.v_scale.element_size()
            )
        return n

    # ---- what the block manager asks of the storage ------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        _raw(self.k)[:, dst].copy_(_raw(self.k)[:, src])
        _raw(self.v)[:, dst].copy_(_raw(self.v)[:, src])
        if self.quant is not None:
            self.k_scale[:, dst].copy_(self.k_scale[:, src])
            self.v_scale[:, dst].copy_(self.v_scale[:, src])

    def block_is_finite(self, block: int) -> bool:
        if (
            self.quant is not None
        ):  # codes are clamped when written; a NaN/inf input makes its scale non-finite
            return bool(
                torch.isfinite(self.k_scale[:, block]).all()
                and torch.isfinite(self.v_scale[:, block]).all()
            )
        return bool(
            torch.isfinite(self.k[:, block]).all() and torch.isfinite(self.v[:, block]).all()
        )

    def zero_block(self, block: int) -> None:
        _raw(self.k)[:, block].zero_()
        _raw(self.v)[:, block].zero_()
        if self.quant is not None:
            self.k_scale[:, block].zero_()
            self.v_scale[:, block].zero_()

    # ---- storing and reading K/V (float or quantised) -------------------------------------
    def write(self, layer_idx: int, slots: Tensor, k: Tensor, v: Tensor | None) -> None:
        """Store rows k, v (T, K, H) at pool slots (T,) (slot = block·bs + offset) of one layer."""
        layer_idx = self.row[layer_idx]
        if self.quant is None:
            kc = self.k[layer_idx].view(-1, *k.shape[1:])  # (NB·bs, K, H)
            kc.index_copy_(0, slots, k.to(kc.dtype))
            if v is not None:
                vc = self.v[layer_idx].view(-1, *v.shape[1:])
                vc.index_copy_(0, slots, v.to(vc.dtype))
            return
        self._write_quantised(self.k[layer_idx], self.k_scale[layer_idx], slots, k)
        assert v is not None  # a quantised pool stores V (never the MLA latent)
        self._write_quantised(self.v[layer_idx], self.v_scale[layer_idx], slots, v)

    def _write_quantised(self, codes: Tensor, scale: Tensor, slots: Tensor, x: Tensor) -> None:
        """codes (NB, bs, K, H), scale (NB, K) of one layer; x (T, K, H) for slots (T,): re-quantise the
        touched blocks with s = max(old s, the codec's scale of the filled part) (fresh when the write starts
        the block)."""
        bs = self.block_size
        blk, off = slots // bs, slots % bs
        ub, inv = torch.unique(blk, return_inverse=True)  # (U,), (T,)
        U = ub.numel()
        lo = torch.full((U,), bs, dtype=torch.long, device=slots.device).scatter_reduce(
            0, inv, off, "amin"
        )
        hi = torch.zeros(U, dtype=torch.long, device=slots.device).scatter_reduce(
            0, inv, off, "amax"
        )
        s_old = scale.index_select(0, ub)  # (U, K)
        vals = decode(codes.index_select(0, ub), s_old[:, None, :, None])  # (U, bs, K, H)
        vals[inv, off] = x.float()
        filled = (
            torch.arange(bs, device=slots.device)[None] <= hi[:, None]
        )  # (U, bs): offsets 0..hi hold tokens
        amax = (vals.abs().amax(dim=-1) * filled[..., None]).amax(dim=1)  # (U, K)
        assert self.quant is not None  # called for quantised pools only
        s_new = scale_for(amax, self.quant)  # fp8: a power of two, growing it re-rounds nothing
        s = torch.where((lo == 0)[:, None], s_new, torch.maximum(s_old, s_new))  # (U, K)
        q = encode(vals, s[:, None, :, None], self.quant)
        _raw(codes).index_copy_(0, ub, _raw(q))
        scale.index_copy_(0, ub, s)

    def gather(self, layer_idx: int, which: str, index: Tensor, dtype: torch.dtype) -> Tensor:
        """K (``which="k"``) or V rows at pool slots ``index`` (S,) of one layer -> (S, K, H) in ``dtype``."""
        store = self.k if which == "k" else self.v
        layer_idx = self.row[layer_idx]
        if self.quant is None:
            return store[layer_idx].view(-1, *store.shape[-2:]).index_select(0, index).to(dtype)
        codes = (
            _raw(store[layer_idx])
            .view(-1, *store.shape[-2:])
            .index_select(0, index)
            .view(store.dtype)
        )
        s = (self.k_scale if which == "k" else self.v_scale)[layer_idx].index_select(
            0, index // self.block_size
        )
        return decode(codes, s[..., None], dtype)  # (S, K, H)

    def read_blocks(self, layer_idx: int, which: str, table: Tensor, dtype: torch.dtype) -> Tensor:
        """K or V of whole blocks through block tables ``table`` (B, M) of one layer -> (B, M·bs, K, H) in
        ``dtype``: one ``index_select`` of whole blocks per call (slot s of row b = block table[b, s // bs]);
        copying bs·K·H contiguous values per block, many times faster than advanced indexing on CPU."""
        store = self.k if which == "k" else self.v
        r, (B, M) = self.row[layer_idx], table.shape
        flat = table.reshape(-1)  # (B·M,)
        if self.quant is None:
            return (
                store[r]
                .index_select(0, flat)
                .view(B, M * self.block_size, *store.shape[-2:])
                .to(dtype)
            )
        codes = _raw(store[r]).index_select(0, flat).view(store.dtype)  # (B·M, bs, K, H)
        s = (self.k_scale if which == "k" else self.v_scale)[r].index_select(0, flat)  # (B·M, K)
        return decode(codes, s[:, None, :, None], dtype).view(
            B, M * self.block_size, *store.shape[-2:]
        )

    def write_layers(self, layers: Sequence[int], slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v (L', T, K, H) of model layers ``layers`` at pool slots (T,); all pool rows in order (a
        dense model's decode step) go in with one ``index_copy_`` per pool."""
        rows = [self.row[layer] for layer in layers]
        if self.quant is None and rows == list(range(self.k.shape[0])):
            L, K, H = self.k.shape[0], self.k.shape[-2], self.k.shape[-1]
            self.k.view(L, -1, K, H).index_copy_(1, slots, k.to(self.k.dtype))
            self.v.view(L, -1, K, H).index_copy_(1, slots, v.to(self.v.dtype))
            return
        for i, layer in enumerate(layers):
            self.write(layer, slots, k[i], v[i])

    # ---- one forward pass ----------------------------------------------------------------
    def packed_batch(
        self, rows: Sequence[tuple[Hashable, int, int]], selective: bool = True
    ) -> tuple[PackedPagedBatch, Tensor, Tensor]:
        """One flattened forward for rows (seq_id, start, n): every row's tokens side by side in one
        (1, T) row, T = Σ n, no padding (Orca's selective batching, Book of LLMs §2.2 “batching and packing”).

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
        tables = []  # per row: its block ids up to its last fed token (the paged kernel's table row)
        for r, (seq_id, start, n) in enumerate(rows):
            table = self.blocks.tables[seq_id]
            end = start + n
            if n < 1 or self.blocks.blocks_for(end) > len(table):
                raise ValueError(
                    f"sequence {seq_id!r} has {len(table)} blocks, needs {self.blocks.blocks_for(end)} "
                    f"for tokens {start}..{end - 1}; call reserve() first"
                )
            t = torch.tensor(table[: self.blocks.blocks_for(end)], dtype=torch.long)
            tables.append(t)
            p = torch.arange(start, end)
            positions.append(p)
            slots.append(t[p // bs] * bs + p % bs)
            seq_ids.append(torch.full((n,), r, dtype=torch.long))
            live = self.blocks.first_live_block(
                seq_id
            )  # blocks before it were released (sliding window)
            g = (t[live:, None] * bs + offsets).flatten()  # (S_r,)
            kp = torch.arange(live * bs, live * bs + g.numel())
            kp[end - live * bs :] = -1  # slots past the last token are empty
            keys.append((g, kp))
        positions_t = torch.cat(positions)[None]  # (1, T)
        seq_t = torch.cat(seq_ids)[None]  # (1, T)
        cls = SelectivePagedBatch if selective else PackedPagedBatch
        batch = cls(self, torch.cat(slots).to(device), rows, keys, positions_t.to(device), tables)
        return batch, positions_t.to(device), seq_t.to(device)


class PackedPagedBatch:
    """The seam for one flattened forward (1, T) over several sequences (``PagedKVCache.packed_batch``).

    ``attend`` scatters this step's k, v (1, K, T, H) into their slots and attends over every
    sequence's gathered keys side by side, (1, K, S, H) with S = Σ S_r, with their positions and
    sequence ids (1, S) in the metadata: the mask lets a token see only its own sequence's
    earlier keys. Reference path: the attention is computed over all T × S pairs.
    ``tables``: each row's block ids (``packed_batch`` passes them), from which a run of decode rows gets
    the (R, M) table and (R,) positions that ``SelectivePagedBatch`` gives the C++ paged kernel.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        slots: Tensor,
        rows,
        keys: list[tuple[Tensor, Tensor]],
        positions: Tensor,
        tables: list[Tensor] | None = None,
    ):
        self.cache, self.slots, self.rows, self.positions = cache, slots, rows, positions
        self.keys = keys
        device = cache.k.device
        self.lengths = [n for _, _, n in rows]
        self._flat: tuple[Tensor, Tensor, Tensor] | None = (
            None  # (gather (S,), key positions (1, S), key sequence ids (1, S)), built on first use
        )
        # Segments for grouped attention: runs of single-token rows batched together, longer rows alone.
        self.segments: list[
            tuple[int, int, Tensor, Tensor, tuple[Tensor, Tensor] | None]
        ] = []  # (t0, t1, gather (R, S), key pos (R, S), (table (R, M), positions (R,)) of a decode run)
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
                g[j, : keys[i][0].numel()] = keys[i][0]
                kp[j, : keys[i][1].numel()] = keys[i][1]
            t1 = t0 + sum(self.lengths[r:r1])
            dec = None
            if tables is not None and r1 - r > 1:  # a run of decode rows: their tables, null-padded
                M = max(len(tables[i]) for i in range(r, r1))
                tab = torch.zeros(r1 - r, M, dtype=torch.long)  # block 0: the null block
                for j, i in enumerate(range(r, r1)):
                    tab[j, : len(tables[i])] = tables[i]
                pos = torch.tensor([rows[i][1] for i in range(r, r1)], dtype=torch.long)
                dec = (tab.to(device), pos.to(device))
            self.segments.append((t0, t1, g.to(device), kp.to(device), dec))
            t0, r = t1, r1

    @property
    def abilities(self) -> frozenset[Ability]:
        """The pool's (``PAGED``, maybe ``PREFIX_SHARING``, ``QUANTISED``, ``LATENT``: MLA passes v=None and the
        values are the first d_c numbers of each latent key) and ``PACKED`` (keys' sequence ids are known)."""
        return self.cache.abilities | {Ability.PACKED}

    def _write(self, layer_idx: int, k: Tensor, v: Tensor | None) -> None:
        _, K, T, H = k.shape
        if k.shape[0] != 1 or self.slots.shape != (T,):
            raise ValueError(
                f"batch was prepared for (1, {self.slots.shape[0]}) tokens, got k of shape {tuple(k.shape)}"
            )
        # (T, K, H) rows; a latent cache (v is None) stores only the keys, the values are views of them
        self.cache.write(
            layer_idx, self.slots, k[0].transpose(0, 1), None if v is None else v[0].transpose(0, 1)
        )

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
    ) -> Tensor:
        """Store k, v (1, K, T, H); attend over every sequence's keys side by side, (1, K, S, H), S = Σ S_r."""
        self._write(layer_idx, k, v)
        if self._flat is None:
            device = self.slots.device
            g = torch.cat([g for g, _ in self.keys])
            kp = torch.cat([kp for _, kp in self.keys])
            ids = torch.cat(
                [
                    torch.full((g.numel(),), r, dtype=torch.long)
                    for r, (g, _) in enumerate(self.keys)
                ]
            )
            self._flat = (g.to(device), kp[None].to(device), ids[None].to(device))
        g, kp, ids = self._flat
        k_all = self.cache.gather(layer_idx, "k", g, k.dtype).transpose(0, 1)[None]  # (1, K, S, H)
        if v is None:  # MLA: values = the latent c, the first d_c of each key
            v_all = k_all[..., : self.cache.config.kv_lora_rank]
        else:
            v_all = self.cache.gather(layer_idx, "v", g, v.dtype).transpose(0, 1)[None]
        return impl(q, k_all, v_all, meta.for_keys(kp, ids))  # (1, N, T, H)


class SelectivePagedBatch(PackedPagedBatch):
    """``PackedPagedBatch`` whose attention is grouped per sequence (Orca's selective batching):
    the linears, norms and FFN run once over all T tokens; attention runs per segment — the
    decode tokens as one batch (R, N, 1, H) against their own gathered keys (R, K, S, H), each
    prefill chunk (1, N, n, H) against its sequence's keys — so no query meets another
    sequence's keys and nothing is computed for them. A run of decode rows reads the pool in place
    through its block tables with the C++ paged kernel where it takes the call (``paged_kernel.usable``;
    not an MLA pool), as the decode-only step does, instead of gathering its keys: at 15 decode rows
    beside an 88-token prefill (SmolLM2-135M, fp16 pool, one thread) their attention took ~18 ms of
    gathers, casts and SDPA a step, the kernel ~5.
    """

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
    ) -> Tensor:
        positions = meta.positions  # (1, T)
        self._write(layer_idx, k, v)
        K, H = k.shape[1], k.shape[3]
        outs = []
        c = self.cache
        for t0, t1, g, kp, dec in self.segments:
            R, S = g.shape
            if dec is not None and not c.stores_latent and paged_kernel.usable(q, c.k):
                r = c.row[layer_idx]
                scales = (c.k_scale[r], c.v_scale[r]) if c.quant is not None else (None, None)
                o = paged_kernel.paged_decode(
                    q[0, :, t0:t1].transpose(0, 1)[:, :, None].contiguous(),  # (R, N, 1, H)
                    c.k[r],
                    c.v[r],
                    dec[0],
                    dec[1],
                    None,
                    None,
                    meta.window,
                    meta.softcap,
                    *scales,
                )  # (R, N, 1, H)
                outs.append(o[:, :, 0].transpose(0, 1)[None])  # (1, N, R, H)
                continue
            ks = (
                self.cache.gather(layer_idx, "k", g.flatten(), q.dtype)
                .view(R, S, K, H)
                .transpose(1, 2)
            )  # (R, K, S, H)
            if v is None:  # MLA: values = the latent c, the first d_c of each key
                vs = ks[..., : self.cache.config.kv_lora_rank]
            else:
                vs = (
                    self.cache.gather(layer_idx, "v", g.flatten(), q.dtype)
                    .view(R, S, K, -1)
                    .transpose(1, 2)
                )
            if R > 1:  # R decode rows, one token each
                qs = q[0, :, t0:t1].transpose(0, 1)[:, :, None]  # (R, N, 1, H)
                qp = positions[0, t0:t1, None]  # (R, 1)
            else:
                qs = q[:, :, t0:t1]  # (1, N, n, H)
                qp = positions[:, t0:t1]  # (1, n)
            o = impl(
                qs, ks, vs, AttentionMetadata(qp, kp, window=meta.window, softcap=meta.softcap)
            )  # (R, N, n, H)
            outs.append(o[:, :, 0].transpose(0, 1)[None] if R > 1 else o)  # (1, N, n, H)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (1, N, T, H)
