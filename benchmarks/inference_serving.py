"""Offline serving on SmolLM2-135M: continuous batching vs static batching, latency percentiles,
prefix-cache hit rate (Book of LLMs §2.2 “batching and packing”, CS336 notes "动态负载").

    python benchmarks/inference_serving.py [--requests 64] [--batch 16] [--dtype fp32|bf16|int8|int4|auto]
        [--compile] [--batch1] [--skip-hf] [--draft-layers N --speculative-tokens K]

Workload: ``--requests`` requests with prompt lengths uniform in [16, 160] and output lengths
uniform in [8, 96] (eos ignored so every system produces exactly those tokens). Systems:

- lmstack continuous batching (``LLM.generate``: iteration-level scheduling, paged KV,
  chunked prefill, at most ``--batch`` running sequences);
- static batching with HF transformers ``generate``: batches of ``--batch`` requests, left
  padding, every batch runs until its longest output (the seed's "traditional batching");
- static batching with the same lmstack engine (each batch waits for its longest request), to
  separate the scheduling gain from the kernels;
- ``--batch1``: the batch-1 decoder (``generate`` with a ``StaticDecoder``, compiled with
  ``--compile``) over the requests one after another, on the same weights.

``--dtype auto`` keeps the GGUF's Q4_1 as int4 linears (what ``lmstack serve`` runs); ``--compile``
compiles the engine's decode step per batch bucket (warmed up before timing; the number of graphs
compiled during the timed run is printed, 0 expected) and the batch-1 decoder's step.
``--speculative-tokens K --draft-layers N`` runs the continuous engine with a draft model of the
target's first N layers (``--draft-layers 0``: prompt lookup).

Throughput counts only the tokens each request asked for. Then a shared-system-prompt workload
reports the prefix-cache hit rate and the throughput with and without prefix caching.

``--profile`` runs only the continuous-batching workload, under cProfile, and prints the
functions with the most internal time and the ones with the most cumulative time (the engine
profile in docs/log/inference.md: linears, attention over the paged cache, gathers, norms, RoPE,
scheduling, sampling are sums of these rows):

    python benchmarks/inference_serving.py --threads 1 --requests 24 --batch 16 --profile
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from lmstack.inference import LLM, SamplingParams, generate
from lmstack.inference.loader import load_for_inference
from lmstack.inference.paged import KV_CACHE_DTYPES
from lmstack.inference.static import StaticDecoder
from lmstack.model.io import find_named_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FORMATS = ("fp32", "bf16", "int8", "int4", "auto")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


OUTPUT_LENGTHS = ("uniform", "exponential")


def workload(n, seed=0, lengths="uniform"):
    """n random prompts of 16-160 tokens; output lengths uniform in [8, 96] or, ``lengths="exponential"``,
    8 + an exponential of mean 44 capped at 504 (the same mean, a long tail as chat traces have)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(
            1000, 20000, (int(torch.randint(16, 161, (), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]
    if lengths == "uniform":
        outs = [int(torch.randint(8, 97, (), generator=g)) for _ in range(n)]
    else:
        u = torch.rand(n, generator=g, dtype=torch.float64)
        outs = [8 + min(496, int(-44.0 * float(torch.log1p(-x)))) for x in u]
    return prompts, outs


def static_rows(outs, batch) -> int:
    """Decode rows static batching computes: every request of a batch runs to the batch's longest."""
    return sum(
        len(outs[i : i + batch]) * max(outs[i : i + batch]) for i in range(0, len(outs), batch)
    )


def compiled_graphs(engine) -> int:
    decode = engine.runner.decode
    return decode.graphs if decode is not None and decode.compiled else 0


def run_continuous(model, prompts, outs, batch, compile=False, **kw):
    llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=512, compile=compile, **kw)
    if compile:
        t0 = time.perf_counter()
        llm.engine.warm_up()
        print(
            f"  warm-up: {compiled_graphs(llm.engine)} decode graphs compiled in "
            f"{time.perf_counter() - t0:.0f} s"
        )
    before = compiled_graphs(llm.engine)
    decode = llm.engine.runner.decode
    counts = (decode.steps, decode.rows) if decode is not None else (0, 0)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs]
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    assert [len(r.token_ids) for r in res] == outs
    llm.engine.stats["graphs_compiled_while_timed"] = compiled_graphs(llm.engine) - before
    if decode is not None:  # decode-only steps and their rows while timed (mean occupancy)
        llm.engine.stats["decode_steps"] = decode.steps - counts[0]
        llm.engine.stats["decode_rows"] = decode.rows - counts[1]
    return wall, res, llm.engine


def run_batch1(model, prompts, outs, compile: bool) -> float:
    """The batch-1 decoder over the requests one after another (its compilation paid before timing)."""
    decoder = StaticDecoder(model, max(map(len, prompts)) + max(outs) + 1, compile=compile)
    list(
        generate(
            model, prompts[0][:8], SamplingParams(temperature=0, max_tokens=4), decoder=decoder
        )
    )
    t0 = time.perf_counter()
    for p, m in zip(prompts, outs):
        params = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        assert len(list(generate(model, p, params, decoder=decoder))) == m
    return time.perf_counter() - t0


def run_static_lmstack(model, prompts, outs, batch, compile=False):
    """Static batches on the same engine and kernels: one batch of ``batch`` requests at a time, each run to
    the batch's longest output (compiled like the continuous run when asked, warmed up before the clock)."""
    llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=4096, compile=compile)
    if compile:
        llm.engine.warm_up()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        longest = max(outs[i : i + batch])
        llm.generate(
            prompts[i : i + batch],
            SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True),
        )
    return time.perf_counter() - t0


@torch.inference_mode()
def run_static_hf(path, dtype, prompts, outs, batch):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        T = max(map(len, chunk))
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, T - len(p) :] = torch.tensor(p)
            mask[j, T - len(p) :] = 1
        n = max(outs[i : i + batch])
        hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", choices=FORMATS, default="fp32")
    ap.add_argument(
        "--compile", action="store_true", help="compiled decode steps (engine, batch-1)"
    )
    ap.add_argument("--batch1", action="store_true", help="also the batch-1 decoder, sequentially")
    ap.add_argument("--speculative-tokens", type=int, default=0)
    ap.add_argument("--draft-layers", type=int, default=0, help="draft = the first N layers")
    ap.add_argument(
        "--lengths",
        choices=OUTPUT_LENGTHS,
        default="uniform",
        help="output lengths: uniform in [8, 96], or 8 + exponential (mean 44, long tail)",
    )
    ap.add_argument("--skip-prefix", action="store_true", help="skip the shared-prompt workload")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--kv-dtype",
        choices=("model", *KV_CACHE_DTYPES),
        default="model",
        help="the continuous engine's KV pool dtype (LLMEngine(kv_dtype=...); model: the model's)",
    )
    ap.add_argument(
        "--admission-batch",
        type=int,
        default=1,
        help="the continuous engine admits waiting requests once this many seats are free "
        "(LLMEngine(admission_batch=...); 1: as soon as one frees)",
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-static-lmstack", action="store_true")
    ap.add_argument(
        "--profile", action="store_true", help="cProfile the continuous-batching run only"
    )
    ap.add_argument("--profile-rows", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = find_named_model("smollm2-135m")
    model, _ = load_for_inference(path, None, args.dtype)
    fmt = getattr(model, "quantization", None) or args.dtype
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch "
        f"{torch.backends.cpu.get_cpu_capability()}, threads {args.threads}, load avg "
        f"{os.getloadavg()[0]:.1f}; SmolLM2-135M {args.dtype} ({fmt} linears)"
        + (", compiled" if args.compile else "")
        + f", KV {args.kv_dtype}, admission batch {args.admission_batch}"
    )
    spec = (
        dict(num_speculative_tokens=args.speculative_tokens, draft_model=args.draft_layers or None)
        if args.speculative_tokens
        else {}
    )
    if args.kv_dtype != "model":
        spec["kv_dtype"] = args.kv_dtype
    if args.admission_batch != 1:
        spec["admission_batch"] = args.admission_batch
    prompts, outs = workload(args.requests, lengths=args.lengths)
    useful = sum(outs)
    print(
        f"{args.requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, outputs "
        f"{min(outs)}-{max(outs)} tokens ({args.lengths}, {useful} in all), batch {args.batch}; static "
        f"batching computes {static_rows(outs, args.batch)} decode rows: token-row bound "
        f"{static_rows(outs, args.batch) / useful:.2f}x\n"
    )

    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        wall, res, engine = prof.runcall(
            run_continuous, model, prompts, outs, args.batch, compile=args.compile, **spec
        )
        print(
            f"continuous (lmstack) under cProfile: {wall:.1f} s, {engine.stats['computed_tokens']} tokens computed, "
            f"{engine.stats['forwards']} forwards"
        )
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(args.profile_rows)
        stats.sort_stats("cumulative").print_stats(args.profile_rows)
        return
    wall, res, engine = run_continuous(
        model, prompts, outs, args.batch, compile=args.compile, **spec
    )
    ttft = [r.ttft for r in res]
    itl = [b - a for r in res for a, b in zip(r.token_times, r.token_times[1:])]
    thr = useful / wall
    print(
        f"continuous (lmstack): {wall:7.1f} s  {thr:7.1f} tok/s   steps {engine.stats['steps']}, "
        f"preemptions {engine.stats['preemptions']}, forwards {engine.stats['forwards']}"
        + (
            f", graphs compiled while timed {engine.stats['graphs_compiled_while_timed']}"
            if args.compile
            else ""
        )
    )
    if engine.stats.get("decode_steps"):
        st = engine.stats
        print(
            f"  decode occupancy: {st['decode_rows'] / st['decode_steps']:.1f} rows per decode-only "
            f"step of {args.batch} seats ({st['decode_steps']} of {st['steps']} steps decode-only)"
        )
    if args.speculative_tokens:
        st = engine.stats
        print(
            f"  speculation: {st['spec_accepted']}/{st['spec_proposed']} drafts accepted "
            f"({st['spec_accepted'] / max(1, st['spec_proposed']):.2f}), "
            f"{st['generated_tokens'] / max(1, st['forwards']):.2f} tokens per target forward"
        )
    print(
        f"  TTFT p50 {pct(ttft, 50):.2f} s  p90 {pct(ttft, 90):.2f} s  p99 {pct(ttft, 99):.2f} s;  inter-token "
        f"p50 {pct(itl, 50) * 1000:.0f} ms  p90 {pct(itl, 90) * 1000:.0f} ms  p99 {pct(itl, 99) * 1000:.0f} ms"
    )
    if args.batch1:
        w = run_batch1(model, prompts, outs, args.compile)
        print(
            f"batch-1 decoder{' (compiled)' if args.compile else ''}: {w:7.1f} s  "
            f"{useful / w:7.1f} tok/s   continuous/batch-1 = {w / wall:.2f}x"
        )
    if not args.skip_static_lmstack:
        w = run_static_lmstack(model, prompts, outs, args.batch, compile=args.compile)
        print(
            f"static (lmstack):     {w:7.1f} s  {useful / w:7.1f} tok/s   continuous/static = {w / wall:.2f}x"
        )
    if not args.skip_hf:
        w = run_static_hf(path, DTYPES.get(args.dtype, torch.float32), prompts, outs, args.batch)
        print(
            f"static (HF generate): {w:7.1f} s  {useful / w:7.1f} tok/s   continuous/static = {w / wall:.2f}x"
        )

    if args.skip_prefix:
        return
    # shared system prompt: prefix caching
    g = torch.Generator().manual_seed(1)
    system = torch.randint(1000, 20000, (192,), generator=g).tolist()
    shared = [
        system
        + torch.randint(
            1000, 20000, (int(torch.randint(8, 33, (), generator=g)),), generator=g
        ).tolist()
        for _ in range(args.requests // 2)
    ]
    souts = [16] * len(shared)
    print(
        f"\nshared system prompt: {len(shared)} requests = 192-token system prompt + 8-32 token question, 16 out"
    )
    for caching in (True, False):
        w, _, eng = run_continuous(model, shared, souts, args.batch, enable_prefix_caching=caching)
        print(
            f"  prefix caching {'on ' if caching else 'off'}: {w:6.1f} s  {sum(souts) / w:6.1f} tok/s  "
            f"hit rate {100 * eng.prefix_cache_hit_rate:.1f}% of prompt tokens; computed {eng.stats['computed_tokens']}"
        )


if __name__ == "__main__":
    main()
