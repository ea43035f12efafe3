"""Prefill and decode speed and cache memory of the token mixers on CPU: full attention vs linear attention
vs Gated DeltaNet vs Mamba-2 vs a 3:1 Gated-DeltaNet:full hybrid (CS336 notes "注意力机制": O(n²) → O(n)).

    python benchmarks/attention_variants.py [--contexts 1024,4096,16384] [--threads 2] [--decode-steps 16]

For each layer pattern and context S: prefill tokens/s (one forward over S tokens, chunked forms for the
recurrent layers), decode ms/token (then ``--decode-steps`` single tokens through ``MixerCache``: the
recurrent form, state in and out), and the KV + state bytes the cache holds. Decode time per token stays
flat in S for the recurrent mixers and grows with S for full attention. Then the chunked Gated DeltaNet
(UT/WY form) against the token-by-token recurrent loop, forward + backward (training), as a ratio
(the ``flash-linear-attention`` package needs a GPU/Triton and is not a dependency here).
Prefill: the fastest of ``--repeats`` runs; decode: the fastest of the ``--decode-steps`` steps (the machine
these figures come from is shared, so the least disturbed run is the estimate); a small model (D=256, L=4, H=64) so the mixers dominate.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from tqdm import tqdm

from lmstack.inference.kv_cache import MixerCache
from lmstack.model.config import ModelConfig, repeat_pattern
from lmstack.model.linear_scan import delta_chunked, delta_recurrent
from lmstack.model.transformer import Transformer

PATTERNS = {
    "full": ["attention"],
    "linear": ["linear_attention"],
    "gated deltanet": ["gated_deltanet"],
    "mamba2": ["mamba2"],
    "3:1 deltanet:full": ["gated_deltanet"] * 3 + ["attention"],
}


def build(unit: list[str], max_seq_len: int) -> Transformer:
    L = 4
    cfg = ModelConfig(
        vocab_size=1024,
        d_model=256,
        n_layers=L,
        n_heads=4,
        n_kv_heads=2,
        d_ff=512,
        max_seq_len=max_seq_len,
        layer_types=repeat_pattern(unit, L),
        mixer_chunk_size=64,
        ssm_head_dim=64,
        ssm_state_size=64,
        ssm_expand=1,
    )
    return Transformer(cfg).eval()


def best_time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` runs: on a CPU shared with other jobs the minimum is the least disturbed."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@torch.no_grad()
def measure(model: Transformer, S: int, decode_steps: int, repeats: int) -> dict:
    tokens = torch.randint(
        0, 1024, (1, S + decode_steps), generator=torch.Generator().manual_seed(0)
    )
    prefill = best_time(lambda: model(tokens[:, :S], last_n=1), repeats)
    cache = MixerCache()
    model(tokens[:, :S], positions=torch.arange(S), kv_cache=cache, last_n=1)
    steps = []
    for i in range(S, S + decode_steps):
        t = time.perf_counter()
        model(tokens[:, i : i + 1], positions=torch.tensor([i]), kv_cache=cache)
        steps.append(time.perf_counter() - t)
    return {
        "prefill_tok_s": S / prefill,
        "decode_ms": 1e3 * min(steps),
        "cache_mib": sum(cache.nbytes().values()) / 2**20,
    }


def chunked_vs_loop(S: int, repeats: int) -> tuple[float, float]:
    """Forward + backward seconds of the gated delta rule, chunked (C=64) vs the per-token loop."""
    gen = torch.Generator().manual_seed(1)
    B, N, H = 1, 4, 64
    q = torch.randn(B, N, S, H, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, N, S, H, generator=gen), dim=-1)
    v, beta = torch.randn(B, N, S, H, generator=gen), torch.rand(B, N, S, generator=gen)
    g = -torch.rand(B, N, S, generator=gen) * 0.1

    def run(fn):
        xs = [t.clone().requires_grad_(True) for t in (q, k, v, beta, g)]
        y, _ = fn(*xs)
        y.sum().backward()

    chunked = best_time(lambda: run(lambda *a: delta_chunked(*a, chunk_size=64)), repeats)
    loop = best_time(lambda: run(delta_recurrent), repeats)
    return chunked, loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(s) for s in args.contexts.split(",")]
    names = args.patterns.split(",")
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"fp32, D=256 L=4, decode {args.decode_steps} tokens, best of {args.repeats}"
    )
    rows = []
    for name in tqdm(names, desc="patterns"):
        model = build(PATTERNS[name], max(contexts) + args.decode_steps)
        for S in contexts:
            rows.append((name, S, measure(model, S, args.decode_steps, args.repeats)))
    print(
        "\n| layers | S | prefill tok/s | decode ms/token | KV+state MiB |\n|---|---|---|---|---|"
    )
    for name, S, r in rows:
        print(
            f"| {name} | {S} | {r['prefill_tok_s']:,.0f} | {r['decode_ms']:.2f} | {r['cache_mib']:.2f} |"
        )
    print("\ndecode ms/token at the longest / shortest context (1.0 = flat in S):")
    for name in names:
        d = [r["decode_ms"] for n, _, r in rows if n == name]
        print(f"  {name}: {d[-1] / d[0]:.2f}x")
    S = 1024
    chunked, loop = chunked_vs_loop(S, args.repeats)
    print(
        f"\nGated DeltaNet fwd+bwd, B=1 N=4 H=64 S={S}: chunked UT/WY {chunked * 1e3:.1f} ms, per-token loop "
        f"{loop * 1e3:.1f} ms -> chunked is {loop / chunked:.1f}x faster"
    )


if __name__ == "__main__":
    main()
