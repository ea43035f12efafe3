"""Speculative decoding speedup on SmolLM2-135M at identical greedy output (Book of LLMs §2.3 “speculative decoding”,
CS336 notes "无损提速").

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


QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain what a hash table is to a child.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
)


def engine_rows(model, tok, code_prompt, base, eos, args) -> None:
    from lmstack.inference import LLM

    chats = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        )
        for q in QUESTIONS[: args.engine_batch - 1]
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, stop_token_ids=eos)
    ref = {}
    for label, prompts in (
        ("1 seq", [code_prompt]),
        (f"{1 + len(chats)} seqs", [code_prompt, *chats]),
    ):
        times = {}
        for name, kw in (
            ("plain", {}),
            (f"prompt lookup k={args.k}", dict(num_speculative_tokens=args.k)),
            (
                f"draft {args.draft_layers} layers k={args.k}",
                dict(num_speculative_tokens=args.k, draft_model=args.draft_layers),
            ),
        ):
            llm = LLM(model, tokenizer=tok, **kw)
            llm.generate([code_prompt[:8]], SamplingParams(temperature=0.0, max_tokens=2))
            t = time.perf_counter()
            outs = [o.token_ids for o in llm.generate(prompts, sp)]
            times[name] = el = time.perf_counter() - t
            if label == "1 seq":  # generate yields the stop token too, the engine's output not
                same = [x for x in outs[0] if x not in eos] == [x for x in base if x not in eos]
            else:
                ref.setdefault(label, outs)
                same = outs == ref[label]
            st = llm.engine.stats
            n = sum(map(len, outs))
            acc = (
                f"  acceptance {100 * st['spec_accepted'] / max(1, st['spec_proposed']):.0f}%"
                if kw
                else ""
            )
            print(
                f"engine {label:>7s}, {name:<24}{el:7.2f} s  {n / el:6.1f} tok/s  speedup "
                f"{times['plain'] / el:.2f}x  target forwards {st['forwards']}{acc}  output "
                f"{'identical' if same else 'DIFFERENT'}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--engine-batch", type=int, default=8, help="sequences in the engine's batch run"
    )
    ap.add_argument("--skip-generate", action="store_true", help="only the engine rows")
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
    ][: 0 if args.skip_generate else 2]:
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
    # the batching engine: prompt lookup and the draft model inside LLMEngine's iteration, one
    # sequence (the code prompt) and a batch of chat prompts; greedy output checked against batch-1
    engine_rows(model, tok, prompt, base, eos, args)
    print("\n" + tok.decode(base)[:300])


if __name__ == "__main__":
    main()
