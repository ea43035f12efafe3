"""``/v1/completions`` with ``echo`` and ``logprobs`` (and ``max_tokens=0``), the request lm-eval's
``local-completions`` sends for log-likelihoods, through the official ``openai`` client against a live
server: the prompt tokens' logprobs equal HF transformers' log_softmax on the same tokens (first token
null, as OpenAI's legacy API), the top logprobs and text offsets are consistent, and the generated token
after the prompt keeps its own logprob."""

import pytest
import torch
from serve_helpers import MODEL, live_server, tiny_tokenizer

from lmstack.inference.engine import LLMEngine
from lmstack.serve import Server

openai = pytest.importorskip(
    "openai", reason="the tests drive the server with the official `openai` client"
)
transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")


@pytest.fixture(scope="module")
def hf_and_served(hf_llama_pair):
    hf, model = hf_llama_pair(vocab_size=258)
    tok = tiny_tokenizer()
    engine = LLMEngine(model, tok, eos_token_id=tok.eos_token_id, block_size=4, num_blocks=256)
    with live_server(Server(engine, MODEL)) as url:
        yield hf, openai.OpenAI(base_url=url + "/v1", api_key="unused"), url


def hf_logprobs(hf, ids):
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)  # (P, V)
    return logp


def test_echo_max_tokens_0_equals_hf(hf_and_served):
    hf, client, _ = hf_and_served
    tok = tiny_tokenizer()
    text = "The cat sat on the mat, and then"
    ids = tok.encode(text)
    r = client.completions.create(
        model=MODEL, prompt=text, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    (c,) = r.choices
    assert c.text == text and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logp = hf_logprobs(hf, ids)
    want = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for j, top in enumerate(lp.top_logprobs[1:]):  # the 2 most likely next tokens at each prefix
        vals, top_ids = torch.topk(logp[j], 2)
        want_top = {}  # keyed by token text, as OpenAI's format; partial UTF-8 bytes share "\ufffd"
        for t, v in zip(top_ids.tolist(), vals.tolist()):
            want_top.setdefault(tok.decode_bytes([t]).decode("utf-8", "replace"), v)
        assert list(top) == list(want_top)
        assert list(top.values()) == pytest.approx(list(want_top.values()), abs=1e-4)
    assert lp.text_offset == [len(text[:k]) for k in range(len(text))]  # one byte a token here


def test_lm_eval_request_format(hf_and_served):
    """lm-eval local-completions' own payload: token ids, echo, logprobs=1, max_tokens=1, temperature 0;
    its parser sums token_logprobs[ctxlen:-1] and checks greediness against top_logprobs."""
    hf, _, url = hf_and_served
    import httpx

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20)]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    for ch, ids in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts):
        logp = hf_logprobs(hf, ids)
        lps = ch["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1 and lps[0] is None
        want = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        assert lps[1:-1] == pytest.approx(want, abs=1e-4)
        greedy_next = int(logp[-1].argmax())  # temperature 0: the generated token is HF's argmax
        assert lps[-1] == pytest.approx(float(logp[-1, greedy_next]), abs=1e-4)
        for j in range(1, len(ids)):
            top = ch["logprobs"]["top_logprobs"][j]
            assert (lps[j] == max(top.values())) == (int(logp[j - 1].argmax()) == ids[j])


def test_bad_combinations(hf_and_served):
    _, client, _ = hf_and_served
    with pytest.raises(openai.BadRequestError, match="max_tokens=0"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model=MODEL, prompt="abc", echo=True, logprobs=1, stream=True)
