"""``lmstack generate``: stream a continuation of a prompt from a model to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a continuation of a prompt (streams tokens)")
    p.add_argument("--model", default="smollm2-135m", help="model name (smollm2-135m), .gguf file or checkpoint dir")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--tokenizer", default=None, help="tokenizer file (default: the model's GGUF)")
    p.set_defaults(func=run_generate)


def load_tokenizer(model_source, tokenizer_path=None):
    from lmstack.tokenizer import Tokenizer

    path = tokenizer_path or model_source
    if str(path).endswith(".gguf"):
        return Tokenizer.from_gguf(path)
    raise ValueError(f"{path}: no tokenizer found; pass --tokenizer FILE.gguf")


def stream_generate(model, tokenizer, prompt: str, max_tokens: int, out=None, **sampling) -> dict:
    """Generate, printing text to ``out`` (default: the current sys.stdout) as it is decoded; returns counts and timings."""
    out = out if out is not None else sys.stdout
    from lmstack.inference import generate

    ids = tokenizer.encode(prompt)
    stop = [t for t in (model.config.eos_token_id,) if t is not None]
    new: list[int] = []
    printed = ""
    t0 = time.perf_counter()
    first = None
    for token in generate(model, ids, max_tokens, stop_ids=stop, **sampling):
        if first is None:
            first = time.perf_counter()
        new.append(token)
        if token in stop:
            break
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
            out.write(text[len(printed):])
            out.flush()
            printed = text
    t1 = time.perf_counter()
    out.write(tokenizer.decode([t for t in new if t not in stop])[len(printed):] + "\n")
    decode_s = t1 - first if first is not None and len(new) > 1 else float("nan")
    return {"prompt_tokens": len(ids), "new_tokens": len(new), "ttft_s": (first or t1) - t0,
            "total_s": t1 - t0, "decode_tokens_per_s": (len(new) - 1) / decode_s if len(new) > 1 else float("nan")}


def run_generate(args) -> int:
    from lmstack.model.io import load_model

    lm = load_model(args.model, dtype=DTYPES[args.dtype])
    tok = load_tokenizer(lm.source, args.tokenizer)
    print(args.prompt, end="", flush=True)
    stats = stream_generate(lm.model.eval(), tok, args.prompt, args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print(f"[{stats['new_tokens']} tokens, TTFT {stats['ttft_s'] * 1000:.0f} ms, "
          f"{stats['decode_tokens_per_s']:.1f} tokens/s decode]", file=sys.stderr)
    return 0
