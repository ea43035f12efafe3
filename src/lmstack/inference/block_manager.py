"""The block manager of the paged KV cache: which physical block holds which tokens of which sequence.

CS336 notes "动态负载" (vLLM PagedAttention). A sequence's *block table* maps its logical block i
(tokens i·bs .. i·bs+bs-1) to a physical block of the pool; identical spans share blocks:

- reference counts: a block is free when no sequence refers to it;
- prefix caching: every *full* block is named by a chained hash
  h_i = sha256(h_{i-1} ‖ tokens of block i as packed int64), so equal hashes mean equal whole
  prefixes and a new prompt starting with a cached prefix reuses those blocks. A named block is
  never written again (a write into it goes to a copy). Freed named blocks wait in an LRU list
  and are evicted only when no never-used block is left;
- partial hits: after its last whole cached block, a prompt may still start like a named block that
  follows the same prefix (the same prompt sent again: its last block was filled by the earlier
  request's generated tokens). The longest such common start, k < bs tokens, is reused by copying that
  block into a fresh one of the sequence's own (its first k slots hold the right K/V; the rest are
  overwritten as the sequence writes them) — token-granular reuse as SGLang's radix cache and
  llama.cpp's slots do, so a repeated prompt recomputes only its last token;
- copy-on-write: a shared block (or a named one, after ``truncate``) is copied before a write into it.

Block 0 is the *null block*: never allocated, it takes padding writes and released table entries.
The manager moves no K/V itself: copies and scrubbing go through the ``storage`` it is given.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from typing import Protocol, cast

NULL_BLOCK = 0


class NoFreeBlocks(RuntimeError):
    """The pool has no block left to allocate (the scheduler preempts before this happens)."""


class BlockStorage(Protocol):
    """What the manager needs from the K/V pool (``PagedKVCache``)."""

    def copy_block(self, src: int, dst: int) -> None: ...
    def block_is_finite(self, block: int) -> bool: ...
    def zero_block(self, block: int) -> None: ...


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """h_i = sha256(h_{i-1} ‖ token ids of block i): names a block *and* everything before it.

    The parent is a fixed-size digest (32 bytes; b"root" for the first block) and the ids are
    packed as fixed-width little-endian int64, so no two different (parent, tokens) give the
    same byte string ([1, 23] and [12, 3] do under a join of decimal digits).
    """
    h = hashlib.sha256(parent or b"root")
    h.update(struct.pack(f"<{len(tokens)}q", *(int(t) for t in tokens)))
    return h.digest()


class BlockManager:
    """Reference counts, free list, prefix-cache index (LRU eviction) and every sequence's block table."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        storage: BlockStorage | None = None,
    ):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks} must be >= 2 (block 0 is the reserved null block)"
            )
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.storage = storage
        self.ref_count = [0] * num_blocks
        self.free_list: deque[int] = deque(range(1, num_blocks))  # never used or no cached content
        self.evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # ref 0 but holds a cached prefix (LRU first)
        self.cached: dict[bytes, int] = {}  # chained hash -> block
        self.block_hash: dict[int, bytes] = {}  # block -> its chained hash
        self.tables: dict[Hashable, list[int]] = {}
        self.num_tokens: dict[Hashable, int] = {}  # tokens whose K/V are stored, per sequence
        self.hashes: dict[
            Hashable, list[bytes]
        ] = {}  # chained hashes of the sequence's full blocks
        # named blocks by (parent hash, first token) -> {block: its tokens}: the candidates of a partial hit
        self.children: dict[tuple[bytes | None, int], dict[int, tuple[int, ...]]] = {}
        self.child_key: dict[int, tuple[bytes | None, int]] = {}  # named block -> its children key

    # ---- the pool ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (never-used ones plus evictable cached ones)."""
        return len(self.free_list) + len(self.evictable)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold if it had every allocatable block."""
        return self.usable_blocks * self.block_size

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def allocate_block(self) -> int:
        if self.free_list:
            block = self.free_list.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)  # least recently used cached block
            self._forget(block)
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

    def register(
        self, block: int, h: bytes, parent: bytes | None = None, tokens: Sequence[int] = ()
    ) -> None:
        """Name a full block by its chained hash (first writer wins; duplicates stay private); with its
        ``tokens`` (and the ``parent`` hash before them) it can also serve partial hits."""
        if self.enable_prefix_caching and h not in self.cached and block not in self.block_hash:
            self.cached[h] = block
            self.block_hash[block] = h
            if tokens:
                key = (parent, int(tokens[0]))
                self.children.setdefault(key, {})[block] = tuple(int(t) for t in tokens)
                self.child_key[block] = key

    def _forget(self, block: int) -> None:
        """Take a named block out of the prefix-cache index (evicted, scrubbed)."""
        del self.cached[self.block_hash.pop(block)]
        key = self.child_key.pop(block, None)
        if key is not None:
            siblings = self.children[key]
            del siblings[block]
            if not siblings:
                del self.children[key]

    def partial_hit(self, parent: bytes | None, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(block, k): the named block following ``parent`` whose tokens share the longest start with
        ``tokens``, k >= 1 of them (the first one found among equal lengths), or None."""
        if not self.enable_prefix_caching or not tokens:
            return None
        best: tuple[int, int] | None = None
        for block, toks in self.children.get((parent, int(tokens[0])), {}).items():
            k = 0
            for a, b in zip(toks, tokens):
                if a != b:
                    break
                k += 1
            if best is None or k > best[1]:
                best = (block, k)
        return best

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (after a weight update their K/V are stale): evictable cached blocks go back
        to the free list and no block keeps a name. Returns how many cached blocks were forgotten."""
        n = len(self.cached)
        self.free_list.extend(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.block_hash.clear()
        self.children.clear()
        self.child_key.clear()
        return n

    # ---- sequences -----------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Start a sequence; reuse cached full blocks of its prefix, then a partial hit after them (a copy
        of the named block that starts the same way, ``partial_hit``; needs the ``storage`` to copy).
        Returns the tokens already stored.

        At most len(token_ids) - 1 tokens come from the cache, so the last token is always
        computed and yields the logits for the next one.
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        bs = self.block_size
        table: list[int] = []
        hashes: list[bytes] = []
        parent = None
        for i in range((len(token_ids) - 1) // bs):
            h = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.lookup(h)
            if block is None:
                break
            self.incref(block)
            table.append(block)
            hashes.append(h)
            parent = h
        stored = len(table) * bs
        rest = token_ids[stored : min(stored + bs, len(token_ids) - 1)]  # never the last token
        hit = self.partial_hit(parent, rest) if self.storage is not None else None
        if hit is not None and self.num_free > (hit[0] in self.evictable):
            src, k = hit
            self.incref(src)  # held while a block is taken, so that it is not the one evicted
            dst = self.allocate_block()
            self.storage.copy_block(src, dst)  # type: ignore[union-attr]  # checked above
            self.decref(src)
            table.append(dst)
            stored += k
        self.tables[seq_id], self.hashes[seq_id] = table, hashes
        self.num_tokens[seq_id] = stored
        return stored

    def blocks_needed(self, seq_id: Hashable, n: int) -> int:
        """New blocks ``reserve(seq_id, n)`` would take (including a copy-on-write copy)."""
        table, stored = self.tables[seq_id], self.num_tokens[seq_id]
        need = max(0, self.blocks_for(stored + n) - len(table))
        if (
            n > 0
            and stored % self.block_size
            and self._copy_before_write(table[stored // self.block_size])
        ):
            need += 1  # the partly filled block is shared or named: it is copied before the write
        return need

    def _copy_before_write(self, block: int) -> bool:
        """Whether a write into ``block`` must go to a copy: a full block that ``truncate`` made partly
        filled again is still named in the prefix-cache index or shared with another sequence, and
        its content must stay what its hash says, for the requests served from it."""
        return self.ref_count[block] > 1 or block in self.block_hash

    def can_append(self, seq_id: Hashable, n: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq_id, n) + reserve <= self.num_free

    def reserve(self, seq_id: Hashable, n: int) -> None:
        """Make room for the next ``n`` tokens of ``seq_id``: new blocks, copy-on-write of a shared block."""
        if self.blocks_needed(seq_id, n) > self.num_free:
            raise NoFreeBlocks(
                f"sequence {seq_id!r} needs {self.blocks_needed(seq_id, n)} blocks for {n} tokens; "
                f"{self.num_free} free"
            )
        table, stored, bs = self.tables[seq_id], self.num_tokens[seq_id], self.block_size
        if n > 0 and stored % bs:
            i = stored // bs
            old = table[i]
            if self._copy_before_write(old):  # copy-on-write
                new = self.allocate_block()
                assert self.storage is not None  # copy-on-write needs the pool's storage
                self.storage.copy_block(old, new)
                self.decref(old)
                table[i] = new
        while len(table) < self.blocks_for(stored + n):
            table.append(self.allocate_block())

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], n: int) -> None:
        """Record that ``n`` more tokens were written; name the blocks that became full."""
        self.num_tokens[seq_id] += n
        bs, table, hashes = self.block_size, self.tables[seq_id], self.hashes[seq_id]
        full = self.num_tokens[seq_id] // bs
        while len(hashes) < full:
            i = len(hashes)
            parent, tokens = hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs]
            h = chain_hash(parent, tokens)
            hashes.append(h)
            self.register(table[i], h, parent, tokens)

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or preempted sequence's blocks (tail first, so the LRU
        evicts the ends of prefixes before their shared beginnings)."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        for block in reversed(table):
            if block != NULL_BLOCK:  # NULL_BLOCK: released by release_outside_window
                self.decref(block)
        del self.num_tokens[seq_id], self.hashes[seq_id]

    def truncate(self, seq_id: Hashable, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` stored tokens (e.g. rejected speculative tokens).

        A kept block that was full and named keeps its name and content: the next write goes to
        a copy (``reserve``), so requests served from the prefix cache still read what its hash says.
        """
        if n_tokens > self.num_tokens[seq_id]:
            raise ValueError(
                f"cannot truncate {seq_id!r} to {n_tokens} > {self.num_tokens[seq_id]} stored tokens"
            )
        table = self.tables[seq_id]
        keep = self.blocks_for(n_tokens)
        if keep and table[keep - 1] == NULL_BLOCK:
            raise ValueError(
                f"cannot truncate {seq_id!r} to {n_tokens} tokens: that block was released"
            )
        for block in reversed(table[keep:]):
            self.decref(block)
        del table[keep:]
        del self.hashes[seq_id][n_tokens // self.block_size :]
        self.num_tokens[seq_id] = n_tokens

    def release_outside_window(self, seq_id: Hashable, window: int) -> int:
        """Free the blocks no future token can see under a sliding window of ``window`` positions
        (Book of LLMs §1.9 “sliding-window and sparse attention”, Mistral-style): the next token (position p = stored tokens) sees keys
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
                self.decref(table[i])
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

    def scrub(self, seq_id: Hashable) -> None:
        """Zero the blocks only this sequence holds when they hold NaN/inf K/V (after a failure):
        a masked-out slot still enters attention as 0 · value, and 0 · NaN is NaN, so a reused
        dirty block would poison whichever request gets it next. Its prefix-cache name goes too."""
        for block in self.tables.get(seq_id, []):
            if (
                block
                and self.ref_count[block] == 1
                and not cast(BlockStorage, self.storage).block_is_finite(block)
            ):
                if block in self.block_hash:
                    self._forget(block)
                assert self.storage is not None
                self.storage.zero_block(block)
