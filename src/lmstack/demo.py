"""``lmstack demo``: the tour. For now: load the real SmolLM2-135M and continue a prompt."""

from __future__ import annotations

import argparse
import time

DEFAULT_PROMPT = "The three most important ideas in machine learning are"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the tour: load SmolLM2-135M from its GGUF and generate")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=run_demo)


def run_demo(args) -> int:
    from lmstack.inference.cli import load_tokenizer, stream_generate
    from lmstack.model.io import load_model

    t0 = time.perf_counter()
    lm = load_model("smollm2-135m")
    model = lm.model.eval()
    tok = load_tokenizer(lm.source)
    c = model.config
    print(f"loaded {lm.source.name}: {model.num_params():,} parameters "
          f"(L={c.n_layers}, D={c.d_model}, N={c.n_heads}, K={c.n_kv_heads}, F={c.d_ff}, V={c.vocab_size}) "
          f"in {time.perf_counter() - t0:.1f} s\n")
    print(args.prompt, end="", flush=True)
    stats = stream_generate(model, tok, args.prompt, args.max_tokens)
    print(f"\n{stats['new_tokens']} new tokens; prompt {stats['prompt_tokens']} tokens; "
          f"TTFT {stats['ttft_s'] * 1000:.0f} ms; decode {stats['decode_tokens_per_s']:.1f} tokens/s (fp32, CPU, KV cache)")
    return 0
