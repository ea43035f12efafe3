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


def test_chunked_prefill_under_the_budget_then_preemption_of_the_newest():
    blocks = BlockManager(num_blocks=5, block_size=4)  # 4 usable blocks = 16 tokens
    stats = Counter()
    sch = Scheduler(
        blocks,
        max_num_seqs=4,
        max_num_batched_tokens=7,
        max_model_len=64,
        watermark_blocks=0,
        eos_token_id=None,
        sliding_window=None,
        speculator=None,
        stats=stats,
    )
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
