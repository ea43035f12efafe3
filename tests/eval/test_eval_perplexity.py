"""Perplexity equals exp(mean CE) computed by hand from HF transformers' logits on the same tokens."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmstack.eval import bits_per_byte, perplexity, read_eval_tokens, windows

TEXT = (
    "the cat is at the hat. " * 3
    + "A story: the theatre is where this cat sat, at the heart of it all. "
) * 3


@torch.no_grad()
def hf_token_nll(hf_model, ids):
    """-log p(ids[j] | ids[:j]) for j >= 1 from one HF forward (the sequence fits the context)."""
    logits = hf_model(torch.tensor([ids])).logits[0].double()
    return -F.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@torch.no_grad()
def hf_strided_reference(hf_model, ids, max_length, stride):
    """The transformers guide's loop, written out with the HF model and labels=-100 masking. The loss is a
    mean over the labels left after HF's internal shift, i.e. target[:, 1:] != -100; the guide weights it
    by ``num_valid - batch_size``, one token short whenever the window's first label is already masked
    (every window after the first when stride < max_length), so the exact count is used here."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    x = torch.tensor([ids])
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        trg_len = end - prev_end
        inp = x[:, begin:end]
        target = inp.clone()
        target[:, :-trg_len] = -100
        loss = hf_model(inp, labels=target).loss.double()
        n = int((target[:, 1:] != -100).sum())
        nll_sum += float(loss) * n
        n_tokens += n
        prev_end = end
        if end == len(ids):
            break
    return nll_sum, n_tokens


def test_no_striding_equals_hand_ce(lm, hf_model):
    model, tok = lm
    ids = tok.encode(TEXT)[:60]  # one window (context 64)
    r = perplexity(model, ids, max_length=64, stride=64, tokenizer=tok, progress=False)
    nll = hf_token_nll(hf_model, ids)
    assert r.n_tokens == len(ids) - 1
    assert r.perplexity == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)


@pytest.mark.parametrize(
    "max_length,stride,batch",
    [(64, 16, None), (32, 32, None), (16, 5, None), (16, 5, 3), (32, 12, 1)],
)
def test_striding_equals_transformers_guide(lm, hf_model, max_length, stride, batch):
    """Also with the windows split into batches of ``batch`` (a partial last batch, one window a forward)."""
    model, tok = lm
    ids = tok.encode(TEXT)
    assert len(ids) > 3 * max_length
    nll_sum, n = hf_strided_reference(hf_model, ids, max_length, stride)
    r = perplexity(
        model,
        ids,
        max_length=max_length,
        stride=stride,
        tokenizer=tok,
        progress=False,
        batch_windows=batch,
    )
    assert r.n_tokens == n
    assert r.perplexity == pytest.approx(math.exp(nll_sum / n), rel=1e-5)
    if stride < max_length:  # every token after the first is scored once
        assert n == len(ids) - 1


def test_windows_cover_each_token_once():
    for n, L, s in [(100, 16, 5), (100, 16, 16), (7, 16, 8), (33, 8, 1), (17, 16, 16)]:
        seen = []
        for b, e, first in windows(n, L, s):
            assert e - b <= L
            seen += list(range(b + first, e))
        assert len(seen) == len(set(seen))


def test_last_window_of_one_token(lm, hf_model):
    model, tok = lm
    ids = tok.encode(TEXT)[
        :33
    ]  # windows [0,16), [16,32), [32,33): the last scores nothing, as in the guide
    r = perplexity(model, ids, max_length=16, stride=16, progress=False)
    assert r.n_windows == 3 and r.n_tokens == 30
    ref = [float(hf_token_nll(hf_model, ids[b : b + 16]).sum()) for b in (0, 16)]
    assert r.perplexity == pytest.approx(math.exp(sum(ref) / 30), rel=1e-5)


def test_short_text(lm, hf_model, tmp_path):
    model, tok = lm
    p = tmp_path / "short.txt"
    p.write_text("the cat sat")
    ids = read_eval_tokens(p, tok)
    r = perplexity(
        model, ids, tokenizer=tok, progress=False
    )  # max_length = model context 64 > len(ids)
    assert r.n_windows == 1
    assert r.perplexity == pytest.approx(
        math.exp(float(hf_token_nll(hf_model, ids.tolist()).mean())), rel=1e-5
    )
    assert r.n_bytes == len(b"the cat sat") - len(tok.decode_bytes([int(ids[0])]))


def test_bits_per_byte_worked_example():
    # 100 tokens at a mean CE of ln 4 nats (perplexity 4 = 2 bits a token) spread over 400 bytes: 0.5 bits a byte
    assert bits_per_byte(100 * math.log(4), 400) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="n_bytes"):
        bits_per_byte(1.0, 0)


def test_bpb_matches_text_bytes(lm, hf_model):
    model, tok = lm
    ids = tok.encode(TEXT)[:50]
    r = perplexity(model, ids, max_length=64, tokenizer=tok, progress=False)
    nll = float(hf_token_nll(hf_model, ids).sum())
    n_bytes = len(tok.decode_bytes(ids[1:]))
    assert r.bits_per_byte == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-5)


def test_bad_inputs(lm, tmp_path):
    model, tok = lm
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(model, [5], progress=False)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        perplexity(model, [1, 2, 10_000], progress=False)
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, [1, 2, 3], max_length=8, stride=9, progress=False)
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_eval_tokens(bad, tok)
    with pytest.raises(FileNotFoundError):
        read_eval_tokens(tmp_path / "nope.txt", tok)


def test_token_file(lm, tmp_path):
    from lmstack.tokenizer.token_file import write_sidecar

    model, tok = lm
    ids = np.array(tok.encode(TEXT)[:40], dtype=np.uint16)
    p = tmp_path / "toks.bin"
    ids.tofile(p)
    write_sidecar(p, {"dtype": "uint16", "n_tokens": len(ids), "vocab_size": tok.vocab_size})
    got = read_eval_tokens(p)
    assert got.tolist() == ids.tolist()


@pytest.fixture(scope="module")
def long_context(tmp_path_factory, make_hf_llama):
    """(lmstack model, HF model): a tiny random HF Llama with context 512 (GQA, tied embeddings), saved and
    loaded through lmstack's HF loader — long enough windows for the oneDNN attention path (>= MIN_T = 192 tokens)."""
    from lmstack.model.hf import load_hf

    hf = make_hf_llama(
        std=0.15,
        vocab_size=300,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    d = tmp_path_factory.mktemp("tiny_hf_512")
    hf.save_pretrained(d, safe_serialization=True)
    return load_hf(d).eval(), hf


def test_long_windows_through_onednn_attention_equal_transformers(long_context, monkeypatch):
    """Windows of 300 tokens (stride 150, and one window a forward) run the oneDNN block-triangular attention
    and give the perplexity of the transformers guide's loop on HF's model; the model's attention is restored."""
    from lmstack.kernels import onednn_attention as oa
    from lmstack.ops.gemm import onednn_ok

    if not onednn_ok(torch.zeros(1)):
        pytest.skip("needs torch built with oneDNN (mkldnn)")
    model, hf = long_context
    before = model.attention
    calls = []
    real = oa.onednn_causal_attention
    monkeypatch.setattr(
        oa, "onednn_causal_attention", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    )
    ids = torch.randint(0, 300, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    nll_sum, n = hf_strided_reference(hf, ids, 300, 150)
    for batch in (None, 1):
        calls.clear()
        r = perplexity(model, ids, max_length=300, stride=150, progress=False, batch_windows=batch)
        assert r.n_tokens == n == len(ids) - 1
        assert r.perplexity == pytest.approx(math.exp(nll_sum / n), rel=1e-5)
        assert {s[2] for s in calls} == {
            299,
            249,
        }  # the full windows and the 250-token last one (>= MIN_T)
    assert model.attention is before


def test_token_nll_equals_log_softmax():
    """In-place logsumexp − target logit vs torch's float64 log_softmax, also for large logits."""
    from lmstack.eval.perplexity import token_nll

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g) * 4
    logits[1] += 1e4  # shifted rows: the max subtraction keeps exp finite
    logits[2, 7] = 80.0
    target = torch.tensor([3, 999, 7, 0, 500])
    ref = -torch.log_softmax(logits.double(), -1).gather(-1, target[:, None])[:, 0]
    got = token_nll(logits.clone(), target)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
