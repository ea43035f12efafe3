"""Paged KV cache: a pool of fixed-size blocks, per-sequence block tables, prefix sharing.

Seed 001 "动态负载" (vLLM PagedAttention): instead of reserving max_seq_len slots per request
(internal fragmentation) the cache is cut into blocks of ``block_size`` tokens that live
anywhere in one preallocated pool; a sequence owns a *block table* mapping its logical block
i (tokens i·bs .. i·bs+bs-1) to a physical block. Identical spans of different requests can
share physical blocks:

- reference counts: a block is free when no sequence refers to it;
- prefix caching: every *full* block is named by a chained hash
  h_i = sha256(h_{i-1} ‖ tokens of block i as packed int64), so equal hashes mean equal whole
  prefixes and a new request whose prompt starts with a cached prefix reuses those blocks
  without computing them. A named block is never written again (a sequence truncated into
  it writes to a copy). Freed blocks that still hold a cached prefix are kept in an LRU list
  and are only overwritten (evicted) when no never-used block is left;
- copy-on-write: a block shared by several sequences (after ``fork``) is copied before one of
  them writes into it.

Storage is two tensors (L, num_blocks, bs, K, H): KV bytes = 2·P·(num_blocks·bs)·L·K·H, the
accounting formula (seed 001 "性能指标分析") with B·S = num_blocks·bs. Block 0 is the *null
block*: never allocated, it receives the writes of padding tokens and pads the gathered keys.

Attention over the pool plugs into the attention seam (``lmstack.model.seam``): a batch object's
``attend`` scatters this step's K/V into their slots, gathers each row's blocks into (B, K, S, H)
with their positions (B, S) (−1 = empty) and calls the model's attention implementation on them.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from lmstack.model.config import ModelConfig
from lmstack.model.seam import AttentionImpl, AttentionMetadata, StoreThenAttend

NULL_BLOCK = 0


class NoFreeBlocks(RuntimeError):
    """The pool has no block left to allocate (the scheduler preempts before this happens)."""


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """h_i = sha256(h_{i-1} ‖ token ids of block i): names a block *and* everything before it.

    The parent is a fixed-size digest (32 bytes; b"root" for the first block) and the ids are
    packed as fixed-width little-endian int64, so no two different (parent, tokens) give the
    same byte string ([1, 23] and [12, 3] do under a join of decimal digits).
    """
    h = hashlib.sha256(parent or b"root")
    h.update(struct.pack(f"<{len(tokens)}q", *(int(t) for t in tokens)))
    return h.digest()


class BlockAllocator:
    """Bookkeeping of the pool: reference counts, free list, prefix-cache index, LRU eviction."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the reserved null block)")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.free_list: deque[int] = deque(range(1, num_blocks))  # never used or no cached content
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but holds a cached prefix (LRU first)
        self.cached: dict[bytes, int] = {}  # chained hash -> block
        self.block_hash: dict[int, bytes] = {}  # block -> its chained hash
        self.hit_tokens = 0  # prefix-cache statistics, in tokens
        self.query_tokens = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (never-used ones plus evictable cached ones)."""
        return len(self.free_list) + len(self.evictable)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self) -> int:
        if self.free_list:
            block = self.free_list.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)  # least recently used cached block
            del self.cached[self.block_hash.pop(block)]
        else:
            raise NoFreeBlocks(f"all {self.usable_blocks} blocks are in use")
        self.ref_count[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self.evictable.pop(block, None)  # a cached block comes back into use
        self.ref_count[block] += 1

    def decref(self, block: int) -> None:
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than it was referenced")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if block in self.block_hash:
                self.evictable[block] = None  # keep its content for later prefix hits
            else:
                self.free_list.append(block)

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h) if self.enable_prefix_caching else None

    def register(self, block: int, h: bytes) -> None:
        """Name a full block by its chained hash (first writer wins; duplicates stay private)."""
        if self.enable_prefix_caching and h not in self.cached and block not in self.block_hash:
            self.cached[h] = block
            self.block_hash[block] = h

    def forget(self, block: int) -> None:
        """Drop a block's cached name (its content is about to change)."""
        h = self.block_hash.pop(block, None)
        if h is not None:
            del self.cached[h]


class PagedKVCache:
    """The block pool (L, num_blocks, bs, K, H) for K and V plus every sequence's block table."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.config, self.block_size = config, block_size
        self.allocator = BlockAllocator(num_blocks, enable_prefix_caching)
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)  # (L, NB, bs, K, H)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.tables: dict[Hashable, list[int]] = {}
        self.num_tokens: dict[Hashable, int] = {}  # tokens whose K/V are stored, per sequence
        self.hashes: dict[Hashable, list[bytes]] = {}  # chained hashes of the sequence's full blocks

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold if it had every allocatable block."""
        return self.allocator.usable_blocks * self.block_size

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # ---- sequence lifecycle --------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Start a sequence; reuse cached full blocks of its prefix. Returns the tokens already stored.

        At most len(token_ids) - 1 tokens come from the cache, so the last token is always
        computed and yields the logits for the next one.
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        bs, alloc = self.block_size, self.allocator
        table: list[int] = []
        hashes: list[bytes] = []
        parent = None
        for i in range((len(token_ids) - 1) // bs):
            h = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            block = alloc.lookup(h)
            if block is None:
                break
            alloc.incref(block)
            table.append(block)
            hashes.append(h)
            parent = h
        alloc.query_tokens += len(token_ids)
        alloc.hit_tokens += len(table) * bs
        self.tables[seq_id], self.hashes[seq_id] = table, hashes
        self.num_tokens[seq_id] = len(table) * bs
        return self.num_tokens[seq_id]

    def blocks_needed(self, seq_id: Hashable, n: int) -> int:
        """New blocks ``reserve(seq_id, n)`` would take (including a copy-on-write copy)."""
        table, stored = self.tables[seq_id], self.num_tokens[seq_id]
        need = max(0, self.blocks_for(stored + n) - len(table))
        if n > 0 and stored % self.block_size and self._copy_before_write(table[stored // self.block_size]):
            need += 1  # the partly filled block is shared or named: it is copied before the write
        return need

    def _copy_before_write(self, block: int) -> bool:
        """Whether a write into ``block`` must go to a copy: another sequence refers to it, or it
        is named in the prefix-cache index (a full block that ``truncate`` made partly filled
        again: its cached content must stay what its hash says, for requests served from it)."""
        return self.allocator.ref_count[block] > 1 or block in self.allocator.block_hash

    def can_append(self, seq_id: Hashable, n: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq_id, n) + reserve <= self.allocator.num_free

    def reserve(self, seq_id: Hashable, n: int) -> None:
        """Make room for the next ``n`` tokens of ``seq_id``: new blocks, copy-on-write of a shared block."""
        if self.blocks_needed(seq_id, n) > self.allocator.num_free:
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {self.blocks_needed(seq_id, n)} blocks for {n} tokens; "
                               f"{self.allocator.num_free} free")
        table, stored, bs = self.tables[seq_id], self.num_tokens[seq_id], self.block_size
        if n > 0 and stored % bs:
            i = stored // bs
            old = table[i]
            if self._copy_before_write(old):  # copy-on-write
                new = self.allocator.allocate()
                self.k[:, new].copy_(self.k[:, old])
                self.v[:, new].copy_(self.v[:, old])
                self.allocator.decref(old)
                table[i] = new
        while len(table) < self.blocks_for(stored + n):
            table.append(self.allocator.allocate())

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], n: int) -> None:
        """Record that ``n`` more tokens were written; name the blocks that became full."""
        self.num_tokens[seq_id] += n
        bs, table, hashes = self.block_size, self.tables[seq_id], self.hashes[seq_id]
        full = self.num_tokens[seq_id] // bs
        while len(hashes) < full:
            i = len(hashes)
            h = chain_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs])
            hashes.append(h)
            self.allocator.register(table[i], h)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """The child shares every block of the parent (copy-on-write on the next write)."""
        if child in self.tables:
            raise ValueError(f"sequence {child!r} already has blocks")
        for block in self.tables[parent]:
            if block != NULL_BLOCK:
                self.allocator.incref(block)
        self.tables[child] = list(self.tables[parent])
        self.hashes[child] = list(self.hashes[parent])
        self.num_tokens[child] = self.num_tokens[parent]

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or preempted sequence's blocks (tail first, so the LRU
        evicts the ends of prefixes before their shared beginnings)."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        for block in reversed(table):
            if block != NULL_BLOCK:  # NULL_BLOCK: released by release_outside_window
                self.allocator.decref(block)
        del self.num_tokens[seq_id], self.hashes[seq_id]

    def truncate(self, seq_id: Hashable, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` stored tokens (e.g. rejected speculative tokens).

        A kept block that was full and named keeps its name and content: the next write goes to
        a copy (``reserve``), so requests served from the prefix cache still read what its hash says.
        """
        if n_tokens > self.num_tokens[seq_id]:
            raise ValueError(f"cannot truncate {seq_id!r} to {n_tokens} > {self.num_tokens[seq_id]} stored tokens")
        table = self.tables[seq_id]
        keep = self.blocks_for(n_tokens)
        if keep and table[keep - 1] == NULL_BLOCK:
            raise ValueError(f"cannot truncate {seq_id!r} to {n_tokens} tokens: that block was released")
        for block in reversed(table[keep:]):
            self.allocator.decref(block)
        del table[keep:]
        del self.hashes[seq_id][n_tokens // self.block_size:]
        self.num_tokens[seq_id] = n_tokens

    def release_outside_window(self, seq_id: Hashable, window: int) -> int:
        """Free the blocks no future token can see under a sliding window of ``window`` positions
        (seed 000 §1.9, Mistral-style): the next token (position p = stored tokens) sees keys
        p-W+1 .. p, so block i is dead once (i+1)·bs <= p-W+1. Its table entry becomes
        NULL_BLOCK (never gathered again); a cached prefix block stays evictable for later hits.
        Returns the number of blocks released now.
        """
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        table, bs = self.tables[seq_id], self.block_size
        dead = max(0, (self.num_tokens[seq_id] - window + 1) // bs)
        released = 0
        for i in range(min(dead, len(table))):
            if table[i] != NULL_BLOCK:
                self.allocator.decref(table[i])
                table[i] = NULL_BLOCK
                released += 1
        return released

    def first_live_block(self, seq_id: Hashable) -> int:
        """Index of the first table entry not released by ``release_outside_window``."""
        table = self.tables[seq_id]
        i = 0
        while i < len(table) and table[i] == NULL_BLOCK:
            i += 1
        return i

    # ---- one forward pass ----------------------------------------------------------------
    def batch(self, rows: Sequence[tuple[Hashable, int, int]]) -> tuple["PagedBatch", Tensor]:
        """A forward's view for rows (seq_id, start, n): tokens start .. start+n-1 of each sequence.

        Rows are left-padded to T = max n so the last real token of every row is column T-1.
        Returns the seam object and positions (B, T) (padding gets position 0 and writes to the
        null block).
        """
        bs, device = self.block_size, self.k.device
        B, T = len(rows), max(n for _, _, n in rows)
        S = max(self.blocks_for(start + n) for _, start, n in rows) * bs
        positions = torch.zeros(B, T, dtype=torch.long)  # (B, T)
        slots = torch.full((B, T), NULL_BLOCK * bs, dtype=torch.long)  # (B, T) flat slot = block·bs + offset
        gather = torch.full((B, S), NULL_BLOCK * bs, dtype=torch.long)  # (B, S)
        key_positions = torch.full((B, S), -1, dtype=torch.long)  # (B, S), −1 = empty
        offsets = torch.arange(bs)
        for i, (seq_id, start, n) in enumerate(rows):
            table = self.tables[seq_id]
            end = start + n
            if self.blocks_for(end) > len(table):
                raise ValueError(f"sequence {seq_id!r} has {len(table)} blocks, needs {self.blocks_for(end)}; "
                                 "call reserve() first")
            t = torch.tensor(table[:self.blocks_for(end)], dtype=torch.long)
            p = torch.arange(start, end)
            positions[i, T - n:] = p
            slots[i, T - n:] = t[p // bs] * bs + p % bs
            g = (t[:, None] * bs + offsets).flatten()
            gather[i, :g.numel()] = g
            key_positions[i, :end] = torch.arange(end)
            key_positions[i, :self.first_live_block(seq_id) * bs] = -1  # released (sliding window)
        return PagedBatch(self, slots.to(device), gather.to(device), key_positions.to(device)), positions.to(device)

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
            table = self.tables[seq_id]
            end = start + n
            if n < 1 or self.blocks_for(end) > len(table):
                raise ValueError(f"sequence {seq_id!r} has {len(table)} blocks, needs {self.blocks_for(end)} "
                                 f"for tokens {start}..{end - 1}; call reserve() first")
            t = torch.tensor(table[:self.blocks_for(end)], dtype=torch.long)
            p = torch.arange(start, end)
            positions.append(p)
            slots.append(t[p // bs] * bs + p % bs)
            seq_ids.append(torch.full((n,), r, dtype=torch.long))
            live = self.first_live_block(seq_id)  # blocks before it were released (sliding window)
            g = (t[live:, None] * bs + offsets).flatten()  # (S_r,)
            kp = torch.arange(live * bs, live * bs + g.numel())
            kp[end - live * bs:] = -1  # slots past the last token are empty
            keys.append((g, kp))
        positions_t = torch.cat(positions)[None]  # (1, T)
        seq_t = torch.cat(seq_ids)[None]  # (1, T)
        cls = SelectivePagedBatch if selective else PackedPagedBatch
        batch = cls(self, torch.cat(slots).to(device), rows, keys, positions_t.to(device))
        return batch, positions_t.to(device), seq_t.to(device)

    def gather(self, seq_id: Hashable, layer_idx: int) -> tuple[Tensor, Tensor]:
        """This sequence's stored K and V for one layer, (K, S, H) each, in position order."""
        n = self.num_tokens[seq_id]
        t = torch.tensor(self.tables[seq_id], dtype=torch.long, device=self.k.device)
        k = self.k[layer_idx, t].flatten(0, 1)[:n]  # (S, K, H)
        v = self.v[layer_idx, t].flatten(0, 1)[:n]
        return k.transpose(0, 1), v.transpose(0, 1)


class PagedBatch(StoreThenAttend):
    """The attention seam's cache for one padded (B, T) forward over a paged pool.

    ``update`` scatters this step's k, v (B, K, T, H) into their slots, then gathers every
    row's blocks into (B, K, S, H) with key positions (B, S).
    """

    def __init__(self, cache: PagedKVCache, slots: Tensor, gather: Tensor, key_positions: Tensor):
        self.cache, self.slots, self.gather_slots, self.key_positions = cache, slots, gather, key_positions

    def update(self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, K, T, H = k.shape
        if self.slots.shape != (B, T):
            raise ValueError(f"batch was prepared for {tuple(self.slots.shape)} tokens, got k of shape {tuple(k.shape)}")
        kc = self.cache.k[layer_idx].view(-1, K, H)  # (NB·bs, K, H)
        vc = self.cache.v[layer_idx].view(-1, K, H)
        flat = self.slots.flatten()  # (B·T,)
        kc.index_copy_(0, flat, k.transpose(1, 2).reshape(B * T, K, H).to(kc.dtype))
        vc.index_copy_(0, flat, v.transpose(1, 2).reshape(B * T, K, H).to(vc.dtype))
        k_all = kc[self.gather_slots].transpose(1, 2).to(k.dtype)  # (B, S, K, H) -> (B, K, S, H)
        v_all = vc[self.gather_slots].transpose(1, 2).to(v.dtype)
        return k_all, v_all, self.key_positions


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

    def _write(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        _, K, T, H = k.shape
        if k.shape[0] != 1 or self.slots.shape != (T,):
            raise ValueError(f"batch was prepared for (1, {self.slots.shape[0]}) tokens, got k of shape {tuple(k.shape)}")
        kc = self.cache.k[layer_idx].view(-1, K, H)  # (NB·bs, K, H)
        vc = self.cache.v[layer_idx].view(-1, K, H)
        kc.index_copy_(0, self.slots, k[0].transpose(0, 1).to(kc.dtype))
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
            vs = vc.index_select(0, g.flatten()).view(R, S, K, H).transpose(1, 2).to(q.dtype)
            if R > 1:  # R decode rows, one token each
                qs = q[0, :, t0:t1].transpose(0, 1)[:, :, None]  # (R, N, 1, H)
                qp = positions[0, t0:t1, None]  # (R, 1)
            else:
                qs = q[:, :, t0:t1]  # (1, N, n, H)
                qp = positions[:, t0:t1]  # (1, n)
            o = impl(qs, ks, vs, AttentionMetadata(qp, kp, window=meta.window))  # (R, N, n, H)
            outs.append(o[:, :, 0].transpose(0, 1)[None] if R > 1 else o)  # (1, N, n, H)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (1, N, T, H)
