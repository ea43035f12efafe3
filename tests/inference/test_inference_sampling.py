"""Sampling filters vs hand-computed distributions and vs HF transformers' logits processors
(Book of LLMs §2.6 “sampling”)."""

import math

import pytest
import torch
from transformers import (  # public names: a refactor of transformers' modules fails here, not as a skip
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lmstack.inference import LLM
from lmstack.inference.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    draw,
    sample_rows,
    sample_token,
    target_probs,
    token_logprobs,
)
from lmstack.inference.stops import StopStrings, find_stop_string, token_stop

P = [0.5, 0.2, 0.15, 0.1, 0.05]
LOGITS = torch.tensor([math.log(p) for p in P], dtype=torch.float64)


def probs(**kw):
    return target_probs(LOGITS, SamplingParams(**kw)).double()


def close(a, b):
    assert torch.allclose(a, torch.tensor(b, dtype=torch.float64), atol=1e-6), (a, b)


def test_temperature_by_hand():
    close(probs(temperature=1.0), P)
    s = sum(p**0.5 for p in P)  # τ = 2: p_i^(1/2) / Σ p_j^(1/2)
    close(probs(temperature=2.0), [p**0.5 / s for p in P])
    close(probs(temperature=0.0), [1, 0, 0, 0, 0])  # greedy = one-hot argmax


def test_top_k_by_hand():
    close(probs(top_k=2), [5 / 7, 2 / 7, 0, 0, 0])
    close(probs(top_k=1), [1, 0, 0, 0, 0])
    close(probs(top_k=0), P)  # 0 = off
    close(probs(top_k=99), P)


def test_top_p_by_hand():
    close(probs(top_p=0.6), [5 / 7, 2 / 7, 0, 0, 0])  # 0.5 < 0.6, 0.5 + 0.2 reaches it
    close(probs(top_p=0.5), [1, 0, 0, 0, 0])  # the top token alone reaches 0.5
    close(probs(top_p=0.3), [1, 0, 0, 0, 0])  # the first token is always kept
    close(probs(top_p=0.86), [0.5 / 0.95, 0.2 / 0.95, 0.15 / 0.95, 0.1 / 0.95, 0])


def test_min_p_by_hand():
    close(probs(min_p=0.3), [5 / 8.5, 2 / 8.5, 1.5 / 8.5, 0, 0])  # keep p >= 0.3 * 0.5 = 0.15
    close(probs(min_p=1.0), [1, 0, 0, 0, 0])


def test_repetition_penalty_by_hand():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    out = apply_repetition_penalty(
        logits, [0, 1, 1], 2.0
    )  # positive / 2, negative * 2, unseen unchanged
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # input untouched


def test_chain_matches_transformers_processors():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 3
    history = torch.randint(0, 300, (4, 40), generator=g)
    for temperature, top_k, top_p, min_p, rep in [
        (0.7, 50, 0.9, 0.0, 1.3),
        (1.3, 0, 0.8, 0.05, 1.0),
        (1.0, 10, 1.0, 0.1, 0.8),
        (0.5, 0, 0.95, 0.0, 1.1),
    ]:
        procs = [RepetitionPenaltyLogitsProcessor(rep)] if rep != 1.0 else []
        procs.append(TemperatureLogitsWarper(temperature))
        if top_k:
            procs.append(TopKLogitsWarper(top_k))
        if top_p < 1:
            procs.append(TopPLogitsWarper(top_p))
        if min_p:
            procs.append(MinPLogitsWarper(min_p))
        ref = logits.clone()
        for proc in procs:
            ref = proc(history, ref)
        ref = ref.softmax(-1)
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep
        )
        for b in range(4):
            ours = target_probs(logits[b], params, history[b].tolist())
            assert torch.allclose(ours, ref[b], atol=1e-6)


def test_empirical_frequencies_follow_the_filtered_distribution():
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=3)
    n = 4000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample_token(LOGITS.float(), params, gen)] += 1
    expected = torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85
    assert counts[3:].sum() == 0
    assert (counts / n - expected).abs().max() < 0.03


def test_seed_reproducible_and_greedy_is_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return [sample_token(row, params, gen) for row in logits]

    assert draw(5) == draw(5)
    greedy = SamplingParams(temperature=0.0)
    assert [sample_token(row, greedy) for row in logits] == logits.argmax(-1).tolist()


def test_batched_rows_follow_transformers_warped_distribution():
    """4000 rows of the same 300-way logits, sampled in one ``sample_rows`` call under two filter sets
    (interleaved rows): each set's frequencies match the HF warpers' distribution, and no filtered-out
    token is ever drawn."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(300, generator=g) * 2
    sets = [
        (SamplingParams(temperature=0.7, top_k=40, top_p=0.9), [TopKLogitsWarper(40)], 0.7, 0.9),
        (SamplingParams(temperature=1.3, min_p=0.05), [MinPLogitsWarper(0.05)], 1.3, 1.0),
    ]
    n = 4000
    params = [sets[r % 2][0] for r in range(2 * n)]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.tensor(sample_rows(logits.expand(2 * n, -1), params, [gen] * (2 * n)))
    for k, (_, warpers, temperature, top_p) in enumerate(sets):
        ref = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
        for w in warpers + ([TopPLogitsWarper(top_p)] if top_p < 1 else []):
            ref = w(None, ref)
        ref = ref.softmax(-1)[0]
        freq = torch.bincount(tokens[k::2], minlength=300) / n
        assert freq[ref == 0].sum() == 0
        assert (freq - ref).abs().max() < 0.03


def test_sample_rows_leaves_the_logits_alone_and_inverts_torch_softmax():
    """The batched sampler works in place on its own copies (one buffer for 64 x 49152 logits): the caller's
    logits are unchanged, and each row's token is the inverse CDF of torch's softmax(logits / τ) at the uniform
    its own generator gives (numpy's searchsorted on the float64 CDF; the float32 block sums could move a
    draw within ~1e-6 of a token boundary, none of these six lies there)."""
    import numpy as np

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 3000, generator=g) * 3
    keep = logits.clone()
    params = [
        SamplingParams(temperature=t, seed=r) for r, t in enumerate([1.0, 0.5, 1.0, 2.0, 0.5, 1.0])
    ]
    gens = [torch.Generator().manual_seed(100 + r) for r in range(6)]
    tokens = sample_rows(logits, params, gens)
    assert torch.equal(logits, keep)
    for r, p in enumerate(params):
        u = torch.rand(1, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
        cdf = np.cumsum(torch.softmax(keep[r].double() / p.temperature, -1).numpy())
        assert tokens[r] == int(np.searchsorted(cdf, u.item() * cdf[-1], side="right"))


def test_draw_never_returns_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    u = torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)  # both ends of [0, 1)
    assert draw(probs, u).tolist() == [1, 2]
    assert draw(probs[:1], torch.tensor([1 - 2**-53], dtype=torch.float64)).tolist() == [3]


def test_draw_matches_numpy_inverse_cdf_across_blocks():
    """The two-level draw (block sums, then a running sum inside one block) against numpy's one-level
    inverse CDF, on 1000-way weights with whole zero blocks, for 2000 uniforms per row."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    w = torch.rand(3, 1000, generator=g) ** 4
    w[0, 256:768] = 0  # two whole blocks of 256 empty
    w[1, :999] = 0  # all mass on the last token (in the padded block)
    u = torch.rand(3, 2000, generator=g, dtype=torch.float64)
    for r in range(3):
        got = draw(w[r].expand(2000, -1), u[r]).numpy()
        cdf = np.cumsum(w[r].double().numpy())
        ref = np.searchsorted(cdf, u[r].numpy() * cdf[-1], side="right")
        x = u[r].numpy() * cdf[-1]
        edges = np.concatenate([[0.0], cdf])  # F before and after each token
        near = np.minimum(np.abs(x - edges[ref]), np.abs(x - edges[ref + 1])) < 1e-6 * cdf[-1]
        assert near.mean() < 0.01  # float32 block sums: only a token boundary's neighbourhood moves
        assert (got == ref)[~near].all() and (w[r][torch.from_numpy(got)] > 0).all()


def test_seeded_request_alone_equals_it_in_a_batch_of_8(model, prompts):
    """One seeded request gives the same tokens alone and as one row of 8 sampled together (other
    seeds, other filters, one greedy) — its stream is its own generator's, whatever shares the step."""
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7)
    alone = LLM(model, block_size=4).generate([prompts[5]], sp)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, seed=k) for k in range(5)] + [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12),
        SamplingParams(max_tokens=12),
    ]
    batch = prompts[:4] + [prompts[5]] + prompts[6:9]
    outs = LLM(model, block_size=4).generate(batch, others[:4] + [sp] + others[4:])
    assert outs[4].token_ids == alone
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the rows really differ


def test_logprobs_and_stop_strings():
    lp, top = token_logprobs(LOGITS, 1, 2)
    assert lp == pytest.approx(math.log(0.2))
    assert list(top) == [0, 1] and top[0] == pytest.approx(math.log(0.5))
    assert find_stop_string("hello world. bye", [".", "bye"]) == 11
    assert find_stop_string("abc", ["x"]) == -1


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=2),
        dict(repetition_penalty=0),
        dict(max_tokens=0),
        dict(stop=[""]),
        dict(logprobs=-1),
        dict(temperature=float("nan")),
    ],
)
def test_bad_params_raise_clear_errors(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


class _CharTokenizer:
    """One token per character; id 0 is half of a multi-byte character (decodes to U+FFFD)."""

    def decode(self, ids):
        return "".join("\ufffd" if i == 0 else chr(i) for i in ids)


def test_stop_strings_hold_back_a_possible_stop_and_an_incomplete_character():
    """The one stop-string handler (engine and stream_generate): while running, the text shown never
    holds the start of a stop string nor half a character; the stop string and what follows never show."""
    stops = StopStrings(_CharTokenizer(), ["END"])
    ids, shown, stopped = [], [], False
    for ch in "abEND!":
        ids.append(ord(ch))
        stopped = stops.update(ids)
        shown.append(stops.emit(finished=stopped)[1])
        if stopped:
            break
    assert stopped and stops.text == "ab" and "".join(shown) == "ab"
    assert shown[:3] == ["", "", "a"]  # "b" and "bE" could still become "END"
    plain = StopStrings(_CharTokenizer())
    plain.update([ord("x"), 0])
    assert plain.emit(finished=False) == ("x", "x")  # the half character waits
    plain.update([ord("x"), 0, ord("y")])
    assert plain.emit(finished=True) == ("x\ufffdy", "\ufffdy")


def test_token_stop_rules():
    p = SamplingParams(max_tokens=3, stop_token_ids=[7])
    assert token_stop(7, 1, p) == "stop" and token_stop(2, 1, p, eos_token_id=2) == "stop"
    assert token_stop(2, 1, SamplingParams(ignore_eos=True), eos_token_id=2) is None
    assert token_stop(5, 3, p) == "length" and token_stop(5, 2, p) is None


def test_runner_greedy_rows_take_the_first_maximum_and_bad_rows_fail_alone():
    """``ModelRunner.sample``'s greedy rows (one max-with-indices pass): the first index of the row maximum,
    as numpy's argmax, on rows full of ties; a NaN row and an all -inf row fail alone; a sampled row in the
    same batch still draws a token."""
    import types

    import numpy as np

    from lmstack.inference.model_runner import ModelRunner
    from lmstack.inference.sampling import NonFiniteLogitsError, SamplingParams
    from lmstack.inference.sequence import Sequence

    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (5, 300), generator=g).float()  # every row has ties at its maximum
    logits[2, 17] = float("nan")
    logits[3] = -math.inf
    params = [SamplingParams(temperature=0)] * 4 + [SamplingParams(temperature=1.0, seed=1)]
    seqs = [
        Sequence(f"r{i}", [1, 2], 2, p, 0.0, torch.Generator().manual_seed(i))
        for i, p in enumerate(params)
    ]
    out = ModelRunner.sample(types.SimpleNamespace(generator=g), seqs, logits)
    want = np.argmax(logits.numpy(), axis=1)
    assert [out[i][0] for i in (0, 1)] == [int(want[0]), int(want[1])]
    assert all(isinstance(out[i], NonFiniteLogitsError) for i in (2, 3))
    assert isinstance(out[4], tuple) and 0 <= out[4][0] < 300
