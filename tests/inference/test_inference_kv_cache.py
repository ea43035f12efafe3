"""KV caches: contiguous and paged bytes vs the accounting formula; block allocator reference
counts, prefix hashes, LRU eviction and copy-on-write (Book of LLMs §2.4 “the KV cache”, CS336 notes "动态负载")."""

import pytest
import torch
from inference_helpers import full_recompute_greedy, greedy

from lmstack.accounting.memory import kv_cache_bytes
from lmstack.inference import KVCache, PagedKVCache, generate
from lmstack.inference.block_manager import BlockManager, NoFreeBlocks, chain_hash


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_equal_accounting_formula(model, dtype):
    cfg = model.config
    assert KVCache(cfg, 3, 40, dtype=dtype).nbytes == kv_cache_bytes(cfg, 3, 40, dtype)
    paged = PagedKVCache(cfg, num_blocks=11, block_size=16, dtype=dtype)
    assert paged.nbytes == kv_cache_bytes(cfg, 1, 11 * 16, dtype)  # B·S = num_blocks · block_size


def test_contiguous_cache_greedy_equals_full_recompute(model, prompts):
    for p in prompts[:6]:
        assert list(generate(model, p, greedy(12))) == full_recompute_greedy(model, p, 12)
        assert list(generate(model, p, greedy(5), use_cache=False)) == full_recompute_greedy(
            model, p, 5
        )


def test_contiguous_truncate_forgets_positions(model):
    c = KVCache(model.config, 1, 16)
    k = torch.randn(1, model.config.n_kv_heads, 6, model.config.head_dim)
    c.update(0, k, k, torch.arange(6))
    c.truncate(4)
    _, _, pos = c.update(0, k[:, :, :1], k[:, :, :1], torch.tensor([4]))
    assert pos[0].tolist() == [0, 1, 2, 3, 4]


def test_allocator_refcounts_prefix_index_and_lru():
    a = BlockManager(4)  # blocks 1..3 usable, 0 is the null block
    b1, b2, b3 = a.allocate_block(), a.allocate_block(), a.allocate_block()
    assert {b1, b2, b3} == {1, 2, 3} and a.num_free == 0
    with pytest.raises(NoFreeBlocks):
        a.allocate_block()
    h1, h2 = chain_hash(None, [1, 2]), chain_hash(None, [3, 4])
    a.register(b1, h1)
    a.register(b2, h2)
    a.decref(b2)  # freed but cached: evictable, not in the free list
    a.decref(b1)
    a.decref(b3)  # no hash: plain free
    assert a.num_free == 3 and a.ref_count == [0, 0, 0, 0]
    assert a.allocate_block() == b3  # never-cached blocks first
    assert a.allocate_block() == b2  # then the least recently freed cached block is evicted
    assert a.lookup(h2) is None and a.lookup(h1) == b1
    a.incref(b1)  # a prefix hit revives the cached block
    assert a.ref_count[b1] == 1 and a.num_free == 0
    with pytest.raises(RuntimeError, match="freed more often"):
        a.decref(b3)
        a.decref(b3)


class _Copies:
    """A storage that records the block copies the manager asks for."""

    def __init__(self):
        self.copies = []

    def copy_block(self, src, dst):
        self.copies.append((src, dst))


def _fill(a, sid, ids, n):
    """``sid`` stores the K/V of its first ``n`` tokens: its full blocks get named."""
    a.allocate(sid, ids)
    a.reserve(sid, n - a.num_tokens[sid])
    a.commit(sid, ids, n - a.num_tokens[sid])


def test_partial_hit_copies_the_longest_matching_named_block():
    """Blocks of 4. "a" and "b" store 8 tokens each after the same first block [1, 2, 3, 4]: their second
    blocks [5, 6, 7, 8] and [5, 6, 9, 9] are full and named. A prompt [1..4, 5, 6, 7, 0, 0] reuses the first
    block (4), then starts like "a"'s second block for 3 tokens and "b"'s for 2: the longer one is copied
    into a fresh block, 4 + 3 = 7 tokens stored (hand-worked); a prompt that ends after [.., 5, 6, 7] may
    take at most 6 (its last token is computed); after the named blocks are evicted nothing is copied."""
    store = _Copies()
    a = BlockManager(12, block_size=4, storage=store)
    _fill(a, "a", [1, 2, 3, 4, 5, 6, 7, 8], 8)
    _fill(
        a, "b", [1, 2, 3, 4, 5, 6, 9, 9], 8
    )  # itself a partial hit of 2 tokens on "a"'s second block
    a_second = a.tables["a"][1]
    assert store.copies == [(a_second, a.tables["b"][1])]
    store.copies.clear()
    assert a.tables["a"][0] == a.tables["b"][0]  # the first block is shared
    assert a.allocate("c", [1, 2, 3, 4, 5, 6, 7, 0, 0]) == 7
    assert store.copies == [(a_second, a.tables["c"][1])] and a.tables["c"][1] != a_second
    assert a.ref_count[a.tables["c"][1]] == 1 and a.tables["c"][1] not in a.block_hash  # its own
    assert (
        a.blocks_needed("c", 2) == 1
    )  # no copy-on-write: the copy is private; 9 tokens -> 3 blocks
    assert a.allocate("d", [1, 2, 3, 4, 5, 6, 7]) == 6  # at most len - 1
    assert a.allocate("e", [1, 2, 3, 4, 8]) == 4  # no named block after [1..4] starts with 8
    assert a.allocate("f", [5, 6, 7, 8, 1]) == 0  # [5, 6, 7, 8] follows another prefix: no hit
    for sid in "abcdef":
        a.free(sid)
    while a.free_list:  # evict every cached block
        a.allocate_block()
    while a.evictable:
        a.allocate_block()
    assert not a.children and not a.child_key and not a.cached
    b = BlockManager(12, block_size=4, storage=store)
    _fill(b, "a", [1, 2, 3, 4, 5, 6, 7, 8], 8)
    assert b.reset_prefix_cache() == 2 and not b.children
    assert b.allocate("c", [1, 2, 3, 4, 5, 6, 7, 0]) == 0


def test_partial_hit_never_evicts_its_own_source():
    """A pool of 2 usable blocks: "a" fills both (named), then frees them: both evictable. A partial hit
    on the second needs a fresh block while the first is held by the new prompt's full-block hit and the
    second is the source: no block is left, so no copy is made (4 tokens, the full block only)."""
    store = _Copies()
    a = BlockManager(3, block_size=4, storage=store)
    _fill(a, "a", [1, 2, 3, 4, 5, 6, 7, 8], 8)
    a.free("a")
    assert a.num_free == 2 and len(a.evictable) == 2
    assert a.allocate("b", [1, 2, 3, 4, 5, 6, 0]) == 4 and store.copies == []
    a.free("b")
    assert a.allocate("c", [1, 2, 3, 4, 5, 6, 0]) == 4  # the same again: the index is intact


def test_chain_hash_names_whole_prefix():
    h = chain_hash(None, [1, 2])
    assert chain_hash(h, [3, 4]) != chain_hash(chain_hash(None, [9, 9]), [3, 4])
    assert chain_hash(h, [3, 4]) == chain_hash(chain_hash(None, [1, 2]), [3, 4])


def _run(model, cache, rows, tokens_of):
    """The engine's one packed forward over rows (seq_id, start, n); logits of each row's last token."""
    batch, positions, seq_ids = cache.packed_batch(rows)
    toks = torch.tensor(
        [[t for sid, start, n in rows for t in tokens_of[sid][start : start + n]]]
    )  # (1, T)
    last = torch.tensor([n for _, _, n in rows]).cumsum(0) - 1
    with torch.no_grad():
        hidden = model(toks, positions, kv_cache=batch, document_ids=seq_ids, return_hidden=True)[
            0
        ]  # (T, D)
        logits = model.unembed(hidden[last])  # (R, V)
    for sid, _start, n in rows:
        cache.blocks.commit(sid, tokens_of[sid], n)
    return logits


def test_paged_prefix_sharing_and_copy_on_write_match_full_recompute(model):
    """Two sequences share a cached prefix; one is truncated into a shared block and writes: it
    gets a copy (copy-on-write), and both sequences' logits equal the full recompute."""
    cache = PagedKVCache(model.config, num_blocks=20, block_size=4, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 97, (10,), generator=g).tolist()
    toks = {"a": a}
    cache.blocks.allocate("a", a)
    cache.blocks.reserve("a", 10)
    _run(model, cache, [("a", 0, 10)], toks)
    # b shares a's first two full blocks (8 tokens) through the prefix cache
    toks["b"] = a[:8] + [7, 7, 7]
    assert cache.blocks.allocate("b", toks["b"]) == 8
    assert cache.blocks.tables["b"][:2] == cache.blocks.tables["a"][:2]
    assert cache.blocks.ref_count[cache.blocks.tables["a"][0]] == 2
    # a goes back to 6 tokens, into its second block, which b shares: the write goes to a copy
    cache.blocks.truncate("a", 6)
    toks["a"] = a[:6] + [22, 23, 24, 25]
    shared = cache.blocks.tables["a"][1]
    assert cache.blocks.blocks_needed("a", 4) == 2  # the copy-on-write copy + a new third block
    cache.blocks.reserve("a", 4)
    cache.blocks.reserve("b", 3)
    assert cache.blocks.tables["a"][1] != shared == cache.blocks.tables["b"][1]
    logits = _run(model, cache, [("a", 6, 4), ("b", 8, 3)], toks)
    with torch.no_grad():
        for i, sid in enumerate(("a", "b")):
            ref = model(torch.tensor([toks[sid]]))[0, -1]
            assert torch.allclose(logits[i], ref, atol=1e-10), sid
    for sid in ("a", "b"):
        cache.blocks.free(sid)
    assert all(r == 0 for r in cache.blocks.ref_count)
    assert cache.blocks.num_free == cache.blocks.usable_blocks


def test_paged_truncate_releases_tail_blocks(model):
    cache = PagedKVCache(model.config, num_blocks=8, block_size=4)
    cache.blocks.allocate("s", list(range(10)))
    cache.blocks.reserve("s", 10)
    cache.blocks.commit("s", list(range(10)), 10)
    cache.blocks.truncate("s", 5)
    assert len(cache.blocks.tables["s"]) == 2 and cache.blocks.num_free == 5
    with pytest.raises(ValueError, match="truncate"):
        cache.blocks.truncate("s", 6)


def test_paged_cache_errors(model):
    cache = PagedKVCache(model.config, num_blocks=3, block_size=4)
    cache.blocks.allocate("s", [1, 2, 3])
    with pytest.raises(ValueError, match="already has blocks"):
        cache.blocks.allocate("s", [1])
    with pytest.raises(NoFreeBlocks, match="needs 3 blocks"):
        cache.blocks.reserve("s", 9)
    with pytest.raises(ValueError, match="reserve"):
        cache.packed_batch([("s", 0, 3)])
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(model.config, num_blocks=1)


def _prefill(model, cache, sid, toks):
    """Allocate ``sid`` (reusing cached prefix blocks), compute the rest; returns (cached tokens, logits)."""
    cached = cache.blocks.allocate(sid, toks[sid])
    cache.blocks.reserve(sid, len(toks[sid]) - cached)
    return cached, _run(model, cache, [(sid, cached, len(toks[sid]) - cached)], toks)[0]


def _recompute(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1]


@pytest.mark.parametrize(
    "first,second,common",
    [
        ([5, 6, 7, 8], [5, 6, 7, 9], 3),  # differ only in the last token of the full block
        (
            [1, 23, 4, 5],
            [12, 3, 4, 5],
            0,
        ),  # equal under a join of decimal digits without a separator
        ([1, 2, 34, 5], [1, 23, 4, 5], 1),
    ],
    ids=["last-token", "digits-1|23-vs-12|3", "digits-2|34-vs-23|4"],
)
def test_prefix_cache_does_not_share_blocks_of_different_tokens(model, first, second, common):
    """A block is shared only when every token of it (and of every block before it) is equal: the
    second prompt gets no cached block — only a copy of "a"'s first block for the ``common`` tokens it
    starts with (a partial hit) — and its logits equal full recompute."""
    cache = PagedKVCache(model.config, num_blocks=12, block_size=4, dtype=torch.float64)
    tail = [40, 41, 42]
    toks = {"a": first + tail, "b": second + tail, "c": first + [70, 71]}
    for sid in ("a", "b", "c"):
        cached, logits = _prefill(model, cache, sid, toks)
        # "c" repeats a cached block ("a"'s first); "b" starts like it for ``common`` tokens
        assert cached == {"a": 0, "b": common, "c": 4}[sid], sid
        if sid == "b":
            assert cache.blocks.tables["b"][0] != cache.blocks.tables["a"][0]  # a copy, not shared
        torch.testing.assert_close(
            logits, _recompute(model, toks[sid]), atol=1e-10, rtol=0, msg=sid
        )
    assert chain_hash(None, first) != chain_hash(None, second)


def test_truncate_into_a_registered_full_block_keeps_the_cached_prefix(model):
    """Issue 14: ``a`` fills two blocks (both named in the prefix cache), is truncated to 6 tokens
    (rejected drafts) and writes two other tokens; ``b`` then asks for ``a``'s original 8-token
    prefix and must read the original K/V, not ``a``'s new ones (logits equal to full recompute)."""
    cache = PagedKVCache(model.config, num_blocks=12, block_size=4, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    orig = torch.randint(0, 97, (8,), generator=g).tolist()
    toks = {"a": orig + [1]}
    _prefill(model, cache, "a", toks)  # 9 tokens: blocks 0 and 1 full and named
    cache.blocks.truncate("a", 6)
    toks["a"] = orig[:6] + [90, 91, 92]
    cache.blocks.reserve("a", 3)
    logits_a = _run(model, cache, [("a", 6, 3)], toks)[0]
    torch.testing.assert_close(logits_a, _recompute(model, toks["a"]), atol=1e-10, rtol=0)
    toks["b"] = orig + [33, 34]
    cached, logits_b = _prefill(model, cache, "b", toks)
    assert cached == 8  # both original blocks still served from the cache
    torch.testing.assert_close(logits_b, _recompute(model, toks["b"]), atol=1e-10, rtol=0)
    # a's new second block is private; freeing everything returns every block
    assert cache.blocks.tables["a"][1] != cache.blocks.tables["b"][1]
    for sid in ("a", "b"):
        cache.blocks.free(sid)
    assert all(r == 0 for r in cache.blocks.ref_count)
    assert cache.blocks.num_free == cache.blocks.usable_blocks


@pytest.mark.parametrize("kind", ["mla", "hybrid"])
def test_batch1_generate_builds_the_cache_the_layers_need(kind):
    """``generate``'s contiguous step holds MLA's latent / a hybrid's K/V + recurrent states: greedy output
    equals the plainly written full recompute; speculation rolls the MLA latent back, and refuses the
    recurrent state (which cannot be rolled back) with a clear error."""
    from inference_helpers import greedy, speculate

    from lmstack.model.config import ModelConfig, repeat_pattern
    from lmstack.model.transformer import Transformer

    extra = (
        dict(
            kv_lora_rank=16,
            q_lora_rank=12,
            qk_nope_head_dim=12,
            qk_rope_head_dim=4,
            v_head_dim=10,
            head_dim=16,
            rope_layout="interleaved",
        )
        if kind == "mla"
        else dict(
            layer_types=repeat_pattern(["gated_deltanet", "attention"], 2), mixer_chunk_size=4
        )
    )
    cfg = ModelConfig(
        vocab_size=97, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=256, **extra
    )
    model = Transformer(cfg, dtype=torch.float64, seed=1).eval()
    prompt = [5, 17, 3, 5, 17, 3, 5, 17, 9, 2]
    ref = full_recompute_greedy(model, prompt, 12)
    assert list(generate(model, prompt, greedy(12))) == ref
    if kind == "mla":
        assert speculate(model, prompt, 12, k=3)[0] == ref
    else:
        with pytest.raises(ValueError, match="rolls back"):
            speculate(model, prompt, 12, k=3)


def test_logits_processors_apply_on_the_batch1_path_as_in_the_engine(model, prompts):
    """One sampler: a processor that bans token ids is applied by ``generate`` and by the engine alike;
    greedy output equals the plainly written recompute with those logits set to -inf."""
    from inference_helpers import greedy

    from lmstack.inference import LLM

    banned = [3, 5, 7, 11]

    def ban(output_ids, logits):
        logits[banned] = float("-inf")
        return logits

    for p in prompts[:3]:
        ids, ref = list(p), []
        with torch.no_grad():
            for _ in range(8):
                logits = model(torch.tensor([ids]))[0, -1]
                logits[banned] = float("-inf")
                ref.append(int(logits.argmax()))
                ids.append(ref[-1])
        params = greedy(8, logits_processors=[ban])
        assert list(generate(model, p, params)) == ref
        assert LLM(model).generate([p], params)[0].token_ids == ref
    with pytest.raises(ValueError, match="speculation"):
        from lmstack.inference import PromptLookup

        list(
            generate(
                model, prompts[0], greedy(8, logits_processors=[ban]), speculation=PromptLookup(2)
            )
        )
