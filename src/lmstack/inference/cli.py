"""``lmstack generate`` (stream a continuation) and ``lmstack chat`` (interactive, chat template).

CS336 notes "推理流程": the prompt is prefilled once, then tokens are decoded one by one and
printed as soon as they form complete UTF-8 text; TTFT and decode tokens/s are reported.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from lmstack.inference.engine import LLMEngine, PromptTooLongError
from lmstack.inference.generate import stream_generate
from lmstack.inference.loader import (
    QUANT,
    add_model_arguments,
    load_for_inference,
    weight_format,
)
from lmstack.inference.sampling import SamplingParams
from lmstack.inference.static import StaticDecoder
from lmstack.kernels.backends import ATTENTION_BACKENDS
from lmstack.kernels.runtime import RuntimeConfig, configure
from lmstack.threads import add_threads_argument


def _checked(field: str, convert):
    """An argparse ``type``: convert the text, then check the value with ``SamplingParams`` (the one
    validation of every decode path), so a bad flag exits 2 with a message naming it."""

    def parse(text: str):
        value = convert(text)  # ValueError: argparse's own "invalid float value: 'x'"
        try:
            kwargs: dict[str, Any] = {field: (value,) if field == "stop" else value}
            SamplingParams(**kwargs)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    parse.__name__ = convert.__name__
    return parse


def _sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    add_model_arguments(
        p,
        dtype_help="weight dtype; int8/int4 = fp32 model with weight-only quantised linears "
        "(lmstack.quant)",
    )
    p.add_argument("--max-tokens", type=_checked("max_tokens", int), default=64)
    p.add_argument(
        "--temperature",
        type=_checked("temperature", float),
        default=temperature,
        help="0 = greedy (so is anything below 1e-5)",
    )
    p.add_argument("--top-k", type=_checked("top_k", int), default=None, help="0 or unset = off")
    p.add_argument("--top-p", type=_checked("top_p", float), default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--min-p", type=_checked("min_p", float), default=0.0, help="in [0, 1]; 0 = off")
    p.add_argument(
        "--repetition-penalty",
        type=_checked("repetition_penalty", float),
        default=1.0,
        help="> 0; 1 = off",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quant",
        choices=list(QUANT),
        default=None,
        help="weight-only quantisation of the linears and the unembedding (same as --dtype int8/int4)",
    )
    p.add_argument(
        "--attn-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="attention implementation (lmstack.kernels; auto = sdpa for inference)",
    )
    add_threads_argument(p)  # lmstack's main applies it (lmstack.threads)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a continuation of a prompt (streams tokens)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        type=_checked("stop", str),
        help="stop string (repeatable)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="static KV cache + torch.compile'd decode step (pays a one-off compilation)",
    )
    _sampling_args(p, temperature=0.0)
    p.set_defaults(func=run_generate)

    c = sub.add_parser(
        "chat", help="interactive chat with the model's chat template (Ctrl-D or /exit quits)"
    )
    c.add_argument("--system", default=None, help="system message (default: the template's own)")
    c.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="prompt-lookup speculation: up to this many draft tokens per step (0 = off)",
    )
    _sampling_args(c, temperature=0.0)
    c.set_defaults(func=run_chat)


def _sampling_kwargs(args) -> dict:
    return dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )


def _runtime(args) -> RuntimeConfig:
    """--attn-backend, --dtype (or --quant), --compile: how the model runs, as one RuntimeConfig."""
    dtype, quant = args.dtype, getattr(args, "quant", None)
    weight_format(dtype, quant)  # --dtype int4 --quant int8 conflict
    return RuntimeConfig(
        attn_backend=getattr(args, "attn_backend", "auto"),
        dtype=quant or dtype,
        compile=getattr(args, "compile", False),
    )


def _load(args):
    runtime = _runtime(args)
    model, tokenizer = load_for_inference(args.model, args.tokenizer, runtime.dtype)
    configure(model, runtime)
    return model, tokenizer


def run_generate(args) -> int:
    model, tok = _load(args)
    prompt = args.prompt
    if args.chat:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
    else:
        print(prompt, end="", flush=True)
    decoder = None
    if _runtime(args).compile:
        n = len(tok.encode(prompt)) + args.max_tokens
        decoder = StaticDecoder(
            model, min(model.config.max_seq_len, -(-n // 256) * 256), compile=True
        )
        t0 = time.perf_counter()
        print("[compiling the decode step ...]", file=sys.stderr, flush=True)
        decoder.warm_up()  # compile now, so that the reported decode speed is the compiled one
        print(f"[compiled in {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
    params = SamplingParams(
        max_tokens=args.max_tokens, stop=tuple(args.stop), **_sampling_kwargs(args)
    )
    stats = stream_generate(model, tok, prompt, params, decoder=decoder)
    print(
        f"[{stats['new_tokens']} tokens, TTFT {stats['ttft_s'] * 1000:.0f} ms, "
        f"{stats['decode_tokens_per_s']:.1f} tokens/s decode]",
        file=sys.stderr,
    )
    return 0


def run_chat(args, stdin=None, out=None, tokenizer=None) -> int:
    """Read a user line, stream the reply, repeat. The conversation is re-rendered each turn with
    the chat template; the engine's prefix cache reuses the K/V of the turns already seen.

    A turn never ends the conversation: when the conversation outgrows the context the oldest
    exchanges are dropped (with a note on stderr); a turn that does not fit even alone, or whose
    reply fails, is dropped with a message and the next line is read."""
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    model, tok = _load(args)
    tok = tokenizer or tok
    engine = LLMEngine(
        model,
        tok,
        max_num_seqs=1,
        max_num_batched_tokens=2048,
        kv_cache_bytes=256 * 2**20,
        num_speculative_tokens=getattr(args, "speculative_tokens", 0),
    )
    params = SamplingParams(max_tokens=args.max_tokens, **_sampling_kwargs(args))
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = stdin.isatty()
    turn = 0
    while True:
        if interactive:
            out.write(">>> ")
            out.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        rid = f"turn-{turn}"
        turn += 1
        try:
            _add_turn(engine, tok, messages, rid, params)
        except ValueError as e:
            messages.pop()
            print(f"[turn not sent: {e}]", file=sys.stderr)
            continue
        reply, error = "", None
        t0 = time.perf_counter()
        n = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.write(o.new_text)
                out.flush()
                reply, n, error = o.text, len(o.token_ids), o.error
        out.write("\n")
        if error is not None:
            messages.pop()
            print(f"[reply failed, turn dropped: {error}]", file=sys.stderr)
            continue
        print(f"[{n} tokens in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _add_turn(engine, tok, messages: list[dict], request_id: str, params) -> None:
    """Queue the reply to ``messages`` (the last one the new user turn). When the new turn does
    not fit even alone, raise the engine's ``PromptTooLongError`` and keep the history; else drop
    the oldest exchanges (after the system message) until the conversation fits."""

    def prompt(msgs):
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))

    first = 1 if messages and messages[0]["role"] == "system" else 0
    engine.check_request(request_id, prompt(messages[:first] + messages[-1:]), params)
    dropped = 0
    while True:
        try:
            engine.add_request(request_id, prompt(messages), params)
            break
        except PromptTooLongError:
            if len(messages) - first <= 1:
                raise
            del messages[first : first + 2]  # the oldest user message and its reply
            dropped += 2
    if dropped:
        print(f"[context full: dropped the {dropped} oldest messages]", file=sys.stderr)
