"""Batch-1 decode and prefill on SmolLM2-135M: lmstack vs HF transformers vs llama.cpp, and the
memory-bandwidth roofline (seed 001 "性能指标分析": Latency = (Param + Memory_KV) / bandwidth).

    python benchmarks/inference_decode.py [--dtype fp32] [--new-tokens 64] [--prompt-tokens 128] [--repeats 3]

Prints tokens/s for each engine (medians over repeats after one warm-up), the ratios
lmstack/peer, the measured copy bandwidth, the bytes one decode step must read, and the % of
the roofline each engine reaches. llama.cpp (``llama-cpp-python``) runs the same GGUF file
with 2 threads; it is skipped with a note when not installed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from lmstack.accounting.memory import kv_cache_bytes, weight_bytes
from lmstack.inference import generate
from lmstack.inference.kv_cache import KVCache
from lmstack.model.io import find_named_model, load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 7) -> float:
    """Copy bandwidth: bytes read + written per second by a large tensor copy."""
    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return 2 * a.numel() * 4 / statistics.median(times) / 1e9


@torch.inference_mode()
def lmstack_rates(model, prompt, n_new, repeats):
    prefill, decode = [], []
    for r in range(repeats + 1):
        cache = KVCache(model.config, 1, len(prompt) + n_new, dtype=next(model.parameters()).dtype)
        t0 = time.perf_counter()
        model(torch.tensor([prompt]), torch.arange(len(prompt)), kv_cache=cache, last_n=1)
        t1 = time.perf_counter()
        times = [time.perf_counter()]
        for _ in generate(model, prompt, n_new):
            times.append(time.perf_counter())
        if r:  # the first round warms up
            prefill.append(len(prompt) / (t1 - t0))
            decode.append((n_new - 1) / (times[-1] - times[1]))  # after the first token (= prefill)
    return statistics.median(prefill), statistics.median(decode)


@torch.inference_mode()
def hf_rates(path, dtype, prompt, n_new, repeats):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=0)
    prefill, decode = [], []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        hf(ids)
        t1 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t2 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        t3 = time.perf_counter()
        if r:
            prefill.append(len(prompt) / (t1 - t0))
            decode.append((n_new - 1) / ((t3 - t2) - (t2 - t1)))
    return statistics.median(prefill), statistics.median(decode)


def llama_cpp_rates(path, prompt, n_new, repeats, threads):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512,
                verbose=False)
    prefill, decode = [], []
    for r in range(repeats + 1):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        llm.reset()
        times = []
        for i, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True)):
            times.append(time.perf_counter())
            if i + 1 == n_new:
                break
        if r:
            prefill.append(len(prompt) / (t1 - t0))
            decode.append((n_new - 1) / (times[-1] - times[0]))
    return statistics.median(prefill), statistics.median(decode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    path = find_named_model("smollm2-135m")
    model = load_model(path, dtype=dtype).model.eval()
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 20000, (args.prompt_tokens,), generator=g).tolist()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads "
          f"{args.threads}, load avg {os.getloadavg()[0]:.1f}; torch {torch.__version__}")
    print(f"SmolLM2-135M {args.dtype}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, "
          f"median of {args.repeats}")

    bw = bandwidth_gbs(args.threads)
    torch.set_num_threads(args.threads)
    S = args.prompt_tokens + args.new_tokens // 2  # mean context during decode
    step_bytes = weight_bytes(cfg, args.dtype) + \
        kv_cache_bytes(cfg, 1, S, args.dtype)
    roof = bw * 1e9 / step_bytes
    rows = {}
    rows["lmstack"] = lmstack_rates(model, prompt, args.new_tokens, args.repeats)
    if not args.skip_hf:
        rows["hf transformers"] = hf_rates(path, dtype, prompt, args.new_tokens, args.repeats)
    cpp = llama_cpp_rates(path, prompt, args.new_tokens, args.repeats, args.threads)
    print(f"\n{'engine':<18}{'prefill tok/s':>15}{'decode tok/s':>14}{'% roofline':>12}")
    for name, (pre, dec) in rows.items():
        print(f"{name:<18}{pre:>15.1f}{dec:>14.2f}{100 * dec / roof:>11.1f}%")
    if cpp is not None:
        gguf_bytes = path.stat().st_size
        print(f"{'llama.cpp Q4_1':<18}{cpp[0]:>15.1f}{cpp[1]:>14.2f}{100 * cpp[1] * gguf_bytes / (bw * 1e9):>11.1f}%"
              f"   (its roofline: {bw * 1e9 / gguf_bytes:.0f} tok/s reading the {gguf_bytes / 1e6:.0f} MB GGUF)")
    else:
        print("llama.cpp: llama-cpp-python not installed; skipped")
    print(f"\nbandwidth (copy, {args.threads} threads): {bw:.1f} GB/s; one {args.dtype} decode step reads "
          f"{step_bytes / 1e6:.0f} MB (weights + KV at S={S}) -> roofline {roof:.1f} tok/s")
    lm = rows["lmstack"]
    for name, (pre, dec) in rows.items():
        if name != "lmstack":
            print(f"lmstack/{name}: decode {lm[1] / dec:.2f}x, prefill {lm[0] / pre:.2f}x")
    if cpp is not None:
        print(f"lmstack/llama.cpp: decode {lm[1] / cpp[1]:.2f}x, prefill {lm[0] / cpp[0]:.2f}x")


if __name__ == "__main__":
    main()
