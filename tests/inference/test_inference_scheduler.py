"""The scheduler and block manager alone, without a model: chunked prefill under the token budget,
admission, preemption of the most recently admitted sequence (Book of LLMs §2.2 “batching and packing”, CS336 notes "动态负载")."""

from collections import Counter

from lmstack.inference.block_manager import BlockManager
from lmstack.inference.sampling import SamplingParams
from lmstack.inference.scheduler import Scheduler
from lmstack.inference.sequence import FINISHED, WAITING, Sequence


def _seq(rid, ids, max_tokens=8):
    return Sequence(rid, list(ids), len(ids), SamplingParams(max_tokens=max_tokens), 0.0, None)


def _rows(scheduled):
    return [(s.request_id, n) for s, n in scheduled]


def _scheduler(blocks, stats, max_num_seqs, max_num_batched_tokens, **kw):
    """A scheduler without a model: no eos, no window, no speculation, no watermark, 64-token sequences."""
    return Scheduler(
        blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=64,
        watermark_blocks=0,
        eos_token_id=None,
        sliding_window=None,
        speculator=None,
        stats=stats,
        **kw,
    )


def test_chunked_prefill_under_the_budget_then_preemption_of_the_newest():
    blocks = BlockManager(num_blocks=5, block_size=4)  # 4 usable blocks = 16 tokens
    stats = Counter()
    sch = _scheduler(blocks, stats, 4, 7)
    a, b = _seq("a", range(1, 11)), _seq("b", range(20, 26))
    sch.add(a)
    sch.add(b)
    assert _rows(sch.schedule()) == [("a", 7)]  # a's first chunk takes the whole budget
    sch.commit(a, 7)
    assert _rows(sch.schedule()) == [
        ("a", 3),
        ("b", 4),
    ]  # a's rest, then b admitted with what is left
    sch.commit(a, 3)
    sch.commit(b, 4)
    sch.append(a, 99)  # a's prompt is complete: its first token
    assert blocks.num_free == 0
    # a decodes (1 token, no new block); b needs a block for its next chunk: none is free, so the most
    # recently admitted sequence — b itself — goes back to the front of the queue, its blocks freed
    assert _rows(sch.schedule()) == [("a", 1)]
    assert (
        sch.waiting[0] is b
        and b.status == WAITING
        and b.num_computed == 0
        and b.num_preemptions == 1
    )
    assert stats["preemptions"] == 1 and "b" not in blocks.tables and blocks.num_free == 1
    sch.commit(a, 1)
    for t in range(7):  # max_tokens=8: the 8th token finishes a and frees its blocks
        sch.append(a, 50 + t)
    assert a.status == FINISHED and a.finish_reason == "length" and "a" not in blocks.tables
    sch.end_step()
    assert not sch.running and sch.has_unfinished()


def test_samples_of_one_prompt_wait_a_step_for_its_prefix_then_read_it_from_the_cache():
    # G = 3 samples of a 10-token prompt and one other prompt, blocks of 4 tokens, a budget for all of
    # them: without waiting, the three copies of the prompt would each compute its 10 tokens in the first
    # step (nothing is cached yet); with it, the first computes 10, the others are admitted one step later
    # with (10 - 1) // 4 = 2 full blocks = 8 tokens from the cache and compute the last 2 (hand-worked)
    blocks = BlockManager(num_blocks=17, block_size=4)
    stats = Counter()
    sch = _scheduler(blocks, stats, 8, 64)
    prompt = list(range(1, 11))
    g0, g1, g2, other = (
        _seq(r, p)
        for r, p in [("g0", prompt), ("g1", prompt), ("g2", prompt), ("o", range(30, 36))]
    )
    for s in (g0, g1, g2, other):
        sch.add(s)
    first = sch.schedule()
    assert _rows(first) == [("g0", 10), ("o", 6)]  # g1, g2 need g0's first block: they wait
    assert [s.request_id for s in sch.waiting] == ["g1", "g2"]
    for s, n in first:
        sch.commit(s, n)
        sch.append(s, 99)
    sch.end_step()
    assert _rows(sch.schedule()) == [("g0", 1), ("o", 1), ("g1", 2), ("g2", 2)]
    assert g1.num_cached_tokens == g2.num_cached_tokens == 8
    assert blocks.tables["g1"][:2] == blocks.tables["g2"][:2] == blocks.tables["g0"][:2]
    assert stats["prompt_tokens"] == 36 and stats["cached_prompt_tokens"] == 16


def _step(sch, rows, tokens):
    """Commit each scheduled row and give a complete prompt or a decode its next token."""
    for s, n in rows:
        sch.commit(s, n)
        if s.num_computed == len(s.all_ids):
            sch.append(s, tokens)
    sch.end_step()


def test_admission_batch_admits_once_k_seats_are_free():
    """admission_batch=2, 3 seats: with a, b, c running, d and e wait while one seat is free and are
    admitted together when a second frees (worked by hand); the last request alone is admitted at once
    (fewer than k wait); with nothing running the queue is admitted whatever k."""
    blocks = BlockManager(num_blocks=40, block_size=4)
    sch = _scheduler(blocks, Counter(), 3, 64, admission_batch=2)
    lens = {"a": 2, "b": 3, "c": 6, "d": 4, "e": 4, "f": 2}
    seqs = {r: _seq(r, range(1, 4), max_tokens=m) for r, m in lens.items()}
    for s in seqs.values():
        sch.add(s)
    rows = sch.schedule()
    assert _rows(rows) == [("a", 3), ("b", 3), ("c", 3)]  # nothing running: admit up to the seats
    _step(sch, rows, 7)  # each has 1 token
    rows = sch.schedule()
    assert _rows(rows) == [("a", 1), ("b", 1), ("c", 1)]
    _step(sch, rows, 7)  # a finishes (2 tokens): one seat free, d and e wait for a second
    rows = sch.schedule()
    assert _rows(rows) == [("b", 1), ("c", 1)]
    _step(sch, rows, 7)  # b finishes: two seats free
    rows = sch.schedule()
    assert _rows(rows) == [("c", 1), ("d", 3), ("e", 3)]  # d and e share one prefill step
    _step(sch, rows, 7)
    for _ in range(2):  # c (6 tokens) finishes after two more steps: one seat, and only f waits
        rows = sch.schedule()
        assert _rows(rows) == [("c", 1), ("d", 1), ("e", 1)]
        _step(sch, rows, 7)
    rows = sch.schedule()
    assert _rows(rows) == [("d", 1), ("e", 1), ("f", 3)]  # fewer than k wait: admitted at once
