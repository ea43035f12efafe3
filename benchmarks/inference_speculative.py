"""Speculative decoding speedup on SmolLM2-135M at identical greedy output (seed 000 §2.3,
seed 001 "无损提速").

    python benchmarks/inference_speculative.py [--new-tokens 96] [--k 4] [--draft-layers 8]

Baseline: batch-1 greedy ``generate`` with the contiguous KV cache. Speculative: prompt lookup
(n-gram; the prompt asks the model to repeat/continue text it contains, where copying pays)
and a truncated-layer draft (the target's first ``--draft-layers`` layers). Prints wall time,
speedup, acceptance rate and tokens per target forward, and checks the tokens are identical.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from lmstack.inference import DraftModel, PromptLookup, SamplingParams, generate, truncated_draft
from lmstack.inference.loader import model_tokenizer
from lmstack.model.io import load_model

TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n    if n < 2:\n        return 1\n    return n * factorial(n - 1)\n"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m")
    model, tok = lm.model.eval(), model_tokenizer(lm.source)
    prompt = tok.encode(
        tok.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": "Repeat this code exactly, then add a docstring to each "
                    "function:\n\n" + TEXT,
                }
            ],
            add_generation_prompt=True,
        )
    )
    eos = [model.config.eos_token_id]
    print(
        f"load avg {os.getloadavg()[0]:.1f}; SmolLM2-135M fp32, prompt {len(prompt)} tokens, "
        f"up to {args.new_tokens} new tokens, k={args.k}"
    )
    list(generate(model, prompt, SamplingParams(temperature=0, max_tokens=4)))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, stop_token_ids=eos)
    t = time.perf_counter()
    base = list(generate(model, prompt, params))
    t_base = time.perf_counter() - t
    print(f"{'plain decode':<28}{t_base:7.2f} s  {len(base) / t_base:6.1f} tok/s")
    for name, draft in [
        ("prompt lookup (n-gram)", None),
        (f"draft: first {args.draft_layers} layers", truncated_draft(model, args.draft_layers)),
    ]:
        spec = DraftModel(draft, args.k) if draft is not None else PromptLookup(args.k)
        t = time.perf_counter()
        out = list(generate(model, prompt, params, speculation=spec))
        el = time.perf_counter() - t
        st = spec.stats
        same = (
            "identical"
            if out == base
            else f"DIFFERENT (first diff at {next(i for i, (a, b) in enumerate(zip(out, base)) if a != b)})"
        )
        print(
            f"{name:<28}{el:7.2f} s  {len(out) / el:6.1f} tok/s  speedup {t_base / el:.2f}x  acceptance "
            f"{100 * st.acceptance_rate:.0f}%  tokens/target step {st.tokens_per_target_forward:.2f}  output {same}"
        )
    # the batching engine (one sequence here): the same prompt lookup inside LLMEngine's iteration
    from lmstack.inference import LLM

    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    times = {}
    for k in (0, args.k):
        llm = LLM(model, tokenizer=tok, num_speculative_tokens=k)
        llm.generate([prompt[:8]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        t = time.perf_counter()
        out = llm.generate([prompt], sp)[0].token_ids
        times[k] = el = time.perf_counter() - t
        st = llm.engine.stats
        same = (
            "identical"
            if [x for x in out if x not in eos] == [x for x in base if x not in eos]
            else "DIFFERENT"
        )
        name = "engine, plain" if k == 0 else f"engine, prompt lookup k={k}"
        extra = (
            (
                f"  speedup {times[0] / el:.2f}x vs engine plain  acceptance "
                f"{100 * st['spec_accepted'] / max(1, st['spec_proposed']):.0f}%"
            )
            if k
            else ""
        )
        print(
            f"{name:<28}{el:7.2f} s  {len(out) / el:6.1f} tok/s  forwards {st['forwards']}{extra}  output {same}"
        )
    print("\n" + tok.decode(base)[:300])


if __name__ == "__main__":
    main()
