"""Batch-1 decode and prefill on SmolLM2-135M: lmstack (fp32, bf16, int8, int4; eager and with a
compiled decode step) vs HF transformers vs llama.cpp, and the memory-bandwidth roofline of each
weight format (CS336 notes "性能指标分析": Latency = (Param + Memory_KV) / bandwidth).

    python benchmarks/inference_decode.py [--threads 1] [--new-tokens 32] [--prompt-tokens 128] [--repeats 3]
        [--lmstack fp32,bf16,int8,int4,fp32+compile,bf16+compile,int8+compile,int4+compile,int4t1+compile]
        (q/k/v and gate/up run as one linear each, Transformer.fuse_projections, in +static and +compile
        entries, StaticDecoder's default: +unfused keeps them apart; +fused fuses a dynamic-cache entry;
        a +compile entry may end in +whole: the decode step as one whole-model graph, StaticDecoder(regional=False),
        instead of one graph per group of blocks; +groupN: N blocks per graph, StaticDecoder's group, default 5)
        [--hf fp32,bf16]
        [--llama-threads 1,2]

Every engine is loaded and warmed up first (a compiled decode step is compiled then), then the
engines run interleaved, one round after another (lmstack a, lmstack b, ..., HF, llama.cpp,
then again), and the medians over rounds are printed with the ratios against HF fp32, HF in
the same dtype and llama.cpp. The roofline of a format is read bandwidth / bytes one decode
step reads (its weights, except the embedding table when it is not the unembedding, plus the KV
cache at the mean context). llama.cpp runs the Q4_1 GGUF through ``llama-cpp-python``; it is
skipped with a note when not installed. The int4 engines' names carry the kernel their linears ran
(``[vnni]``, ``[avx2]``: lmstack's; ``[aten]``: torch's), and the header prints torch's CPU capability and
llama.cpp's own system line, so a run restricted to AVX2 on an AVX-512 machine says so:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 LMSTACK_INT4_KERNEL=avx2 \
        python benchmarks/inference_decode.py --threads 1 --lmstack int4+compile --hf "" --llama-threads 1
    (with a llama-cpp-python built with -DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX2=ON on PYTHONPATH)

"decode tok/s" is wall-clock; "per CPU-s" divides the tokens by the process's CPU time over the same steps
(``time.process_time``, all its threads): on a machine shared with other jobs the wall-clock rate measures the
scheduler as much as the engine, while tokens per CPU-second at one thread is the engine's own cost (at two
threads it also counts threads spinning while they wait, so there it is a cost, not a speed). ``int4t1`` is
int4 with one int8 term per activation (``Int4Linear.terms = 1``: llama.cpp's Q4_1 x Q8_1 precision),
``int4t2`` with two; ``int4`` takes the kernel's default (``quant.int4.default_terms``: 1 on AVX2, 2 on VNNI).

``--profile`` runs instead: for each ``--lmstack`` engine, after its warm-up, ``--new-tokens``
decode steps under ``torch.profiler`` (CPU), and prints the ops with the most self CPU time and
the profile's total per decoded token (the per-token breakdowns in docs/log/inference.md: int4
matmuls, the small ops around them, Dynamo's guard check for a compiled step):

    python benchmarks/inference_decode.py --threads 1 --lmstack int4,int4+compile --profile
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import torch

from lmstack.accounting.memory import kv_cache_bytes
from lmstack.inference import SamplingParams, generate
from lmstack.inference.static import StaticDecoder
from lmstack.model.io import find_named_model, load_model
from lmstack.quant import Int4Linear, int4_vnni, quantize_model, quantized_weight_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bandwidths_gbs(threads: int, mib: int = 512, repeats: int = 7) -> tuple[float, float]:
    """(read, copy) bandwidth: a large fp32 sum (bytes read / s) and a large copy (read + written / s)."""
    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    reads, copies = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        b.copy_(a)
        copies.append(time.perf_counter() - t)
    n = a.numel() * 4
    return n / statistics.median(reads) / 1e9, 2 * n / statistics.median(copies) / 1e9


class LmstackEngine:
    def __init__(self, base, spec: str, max_len: int):
        fmt, *flags = spec.split("+")
        whole = (
            "whole" in flags
        )  # the compiled step as one whole-model graph (StaticDecoder(regional=False))
        # +groupN: N blocks per graph of the regional step (StaticDecoder's group; default 5)
        group = next((int(f[5:]) for f in flags if f.startswith("group") and f[5:].isdigit()), 5)
        flags = [f for f in flags if not (f.startswith("group") and f[5:].isdigit())]
        flag = "".join(f for f in flags if f not in ("fused", "unfused", "whole"))
        if flag not in ("", "static", "compile") or (whole and flag != "compile"):
            raise SystemExit(
                f"--lmstack entry {spec!r}: expected FORMAT, FORMAT+static or FORMAT+compile, "
                "each optionally +fused / +unfused (+compile also +whole)"
            )
        # q/k/v and gate/up as one (quantised) linear each: StaticDecoder's default, +fused for the dynamic cache
        fused = "fused" in flags or (bool(flag) and "unfused" not in flags)
        self.name = f"lmstack {fmt}" + {"": "", "static": " static", "compile": " compiled"}[flag]
        self.name += " whole-model" if whole else ""
        self.name += f" group {group}" if group != 5 and flag == "compile" and not whole else ""
        self.name += " fused" if fused and not flag else " unfused" if flag and not fused else ""
        self.fmt = fmt
        if fmt in ("int8", "int4", "int4t1", "int4t2"):
            self.model = quantize_model(copy.deepcopy(base), fmt[:4])
            for m in self.model.modules():  # int4t1 / int4t2: one / two int8 terms per activation
                if isinstance(m, Int4Linear) and fmt in ("int4t1", "int4t2"):
                    m.terms = int(fmt[-1])
        elif fmt == "bf16":
            self.model = copy.deepcopy(base).to(torch.bfloat16)
        else:
            self.model = base
        if fused:
            self.model = copy.deepcopy(self.model) if self.model is base else self.model
            self.model.fuse_projections()
        kernels = sorted({m.kernel for m in self.model.modules() if isinstance(m, Int4Linear)})
        if kernels:  # which int4 kernel ran: lmstack's vnni / avx2 or torch's aten
            self.name += f" [{'+'.join(kernels)}]"
        self.decoder = (
            StaticDecoder(
                self.model,
                max_len,
                compile=flag == "compile",
                regional=not whole,
                fuse_projections=fused,
                group=group,
            )
            if flag
            else None
        )
        self.weight_bytes = quantized_weight_bytes(self.model)

    @torch.inference_mode()
    def run(self, prompt, n_new):
        t0 = time.perf_counter()
        self.model(torch.tensor([prompt]), last_n=1)
        t1 = time.perf_counter()
        times, cpu, tokens = [], [], []
        for tok in generate(
            self.model,
            prompt,
            SamplingParams(temperature=0, max_tokens=n_new),
            decoder=self.decoder,
        ):
            times.append(time.perf_counter())
            cpu.append(time.process_time())
            tokens.append(tok)
        return (
            len(prompt) / (t1 - t0),
            (n_new - 1) / (times[-1] - times[0]),
            tokens,
            (n_new - 1) / (cpu[-1] - cpu[0]),
        )


class HFEngine:
    def __init__(self, path, fmt: str):
        import transformers

        self.name = f"HF transformers {fmt}"
        self.fmt = fmt
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=DTYPES[fmt]
        ).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def run(self, prompt, n_new):
        ids = torch.tensor([prompt])
        kw = dict(do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        self.model(ids)
        t1 = time.perf_counter()
        self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t2 = time.perf_counter()
        out = self.model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        t3 = time.perf_counter()
        return (
            len(prompt) / (t1 - t0),
            (n_new - 1) / ((t3 - t2) - (t2 - t1)),
            out[0, len(prompt) :].tolist(),
            float("nan"),  # (CPU time per token not taken apart for generate())
        )


class LlamaCppEngine:
    def __init__(self, path, threads: int, repack: bool = True):
        import llama_cpp.llama_cpp as api  # the binding Llama reads its defaults from
        from llama_cpp import Llama

        self.name = f"llama.cpp Q4_1 {threads}t" + ("" if repack else " -nr")
        self.fmt = "Q4_1"
        self.threads = threads
        default_params = api.llama_model_default_params
        if not repack:  # llama-server's -nr: no extra (repacked / AMX) weight buffers

            def no_repack():
                params = default_params()
                params.use_extra_bufts = False
                return params

            api.llama_model_default_params = no_repack
        try:
            self.llm = Llama(
                model_path=str(path),
                n_threads=threads,
                n_threads_batch=threads,
                n_ctx=512,
                n_batch=512,
                verbose=False,
            )
        finally:
            api.llama_model_default_params = default_params
        self.weight_bytes = path.stat().st_size

    def run(self, prompt, n_new):
        threads = torch.get_num_threads()
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        t1 = time.perf_counter()
        self.llm.reset()
        times, cpu, tokens = [], [], []
        for tok in self.llm.generate(prompt, temp=0.0, reset=True):
            times.append(time.perf_counter())
            cpu.append(time.process_time())
            tokens.append(tok)
            if len(tokens) == n_new:
                break
        torch.set_num_threads(threads)
        return (
            len(prompt) / (t1 - t0),
            (n_new - 1) / (times[-1] - times[0]),
            tokens,
            (n_new - 1) / (cpu[-1] - cpu[0]),
        )


def profile_decode(engine: LmstackEngine, prompt: list[int], n_new: int, rows: int) -> None:
    """Warm up (compile), then profile ``n_new`` decode steps; print the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    engine.run(prompt, n_new)  # warm-up: compiles a compiled step
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        n = sum(
            1
            for _ in generate(
                engine.model,
                prompt,
                SamplingParams(temperature=0, max_tokens=n_new),
                decoder=engine.decoder,
            )
        )
    events = prof.key_averages()
    total_us = sum(ev.self_cpu_time_total for ev in events)
    print(
        f"\n{engine.name}: {n} tokens, profiled self CPU time {total_us / 1e3 / n:.1f} ms per token "
        f"(the prompt's prefill included once)"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--lmstack",
        default="fp32,bf16,int8,int4,fp32+compile,bf16+compile,int8+compile,int4+compile",
        help="comma list of FORMAT[+static|+compile]: no suffix = the dynamic KV cache, "
        "+static = static cache eager, +compile = static cache + torch.compile'd decode step "
        "(per block; +compile+whole: one whole-model graph)",
    )
    ap.add_argument("--hf", default="fp32,bf16", help="HF transformers dtypes (empty: skip)")
    ap.add_argument("--llama-threads", default="1,2", help="llama.cpp thread counts (empty: skip)")
    ap.add_argument(
        "--llama-no-repack",
        action="store_true",
        help="llama.cpp without its extra weight buffers (llama-server's -nr): its native AMX Q4_1 path "
        "died with SIGILL on tilezero on an AMX Xeon VM where oneDNN's AMX kernels run",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler breakdown of each --lmstack engine's decode steps instead of the timing table",
    )
    ap.add_argument("--profile-rows", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = find_named_model("smollm2-135m")
    base = load_model(path).model.eval()
    cfg = base.config
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 20000, (args.prompt_tokens,), generator=g).tolist()
    max_len = -(-(args.prompt_tokens + args.new_tokens) // 64) * 64
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads "
        f"{args.threads}, load avg {os.getloadavg()[0]:.1f}; torch {torch.__version__}"
    )
    kernel, why = int4_vnni.selected()
    print(
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; lmstack int4 kernel {kernel}"
        + (f" ({why})" if why else "")
        + f"; {int4_vnni.ENV}={os.environ.get(int4_vnni.ENV, '')!r}"
    )
    print(
        f"SmolLM2-135M-Instruct, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens (greedy), "
        f"medians of {args.repeats} interleaved rounds after a warm-up"
    )

    engines = [LmstackEngine(base, s, max_len) for s in args.lmstack.split(",") if s]
    if args.profile:
        for e in engines:
            profile_decode(e, prompt, args.new_tokens, args.profile_rows)
        return
    engines += [HFEngine(path, f) for f in args.hf.split(",") if f]
    if args.llama_threads:
        try:
            engines += [
                LlamaCppEngine(path, int(t), repack=not args.llama_no_repack)
                for t in args.llama_threads.split(",")
            ]
            import llama_cpp

            print(
                f"llama.cpp {llama_cpp.__version__} ({os.path.dirname(llama_cpp.__file__)}): "
                f"{llama_cpp.llama_print_system_info().decode().strip()}"
            )
        except ImportError:
            print("llama.cpp: llama-cpp-python not installed; skipped")
    for e in engines:  # warm-up (compiles the compiled decode steps)
        torch.set_num_threads(args.threads)
        t = time.perf_counter()
        e.tokens = e.run(prompt, args.new_tokens)[2]
        print(f"  warm-up {e.name}: {time.perf_counter() - t:.1f} s", flush=True)
    results = {e.name: [] for e in engines}
    loads = []
    for r in range(args.repeats):
        for e in engines:
            torch.set_num_threads(args.threads)
            pre, dec, _, dec_cpu = e.run(prompt, args.new_tokens)
            results[e.name].append((pre, dec, dec_cpu))
        loads.append(os.getloadavg()[0])
        print(f"  round {r + 1}: load avg {loads[-1]:.1f}", flush=True)

    read_bw, copy_bw = bandwidths_gbs(args.threads)
    S = args.prompt_tokens + args.new_tokens // 2  # mean context during decode
    ref_tokens = engines[0].tokens
    med = {
        n: tuple(statistics.median(x[i] for x in v) for i in range(3)) for n, v in results.items()
    }
    print(
        f"\n{'engine':<30}{'weights MB':>11}{'prefill tok/s':>15}{'decode tok/s':>14}{'per CPU-s':>11}"
        f"{'roofline':>10}{'% roof':>8}  same tokens as {engines[0].name}"
    )
    for e in engines:
        pre, dec, dec_cpu = med[e.name]
        kv = kv_cache_bytes(cfg, 1, S, "bf16" if e.fmt == "bf16" else "fp32")
        step = e.weight_bytes + (0 if e.fmt == "Q4_1" else kv)
        roof = read_bw * 1e9 / step
        same = sum(a == b for a, b in zip(e.tokens, ref_tokens))
        print(
            f"{e.name:<30}{step / 1e6:>11.0f}{pre:>15.1f}{dec:>14.2f}{dec_cpu:>11.2f}{roof:>10.1f}"
            f"{100 * dec / roof:>7.0f}%  {same}/{len(ref_tokens)}"
        )
    print(
        f"\nbandwidth, {args.threads} thread(s): read {read_bw:.1f} GB/s (roofline uses this), copy "
        f"{copy_bw:.1f} GB/s (read + write); KV at S={S} included for lmstack/HF; load avg per round "
        f"{', '.join(f'{x:.1f}' for x in loads)}"
    )
    peers = [e for e in engines if not e.name.startswith("lmstack")]
    for e in engines:
        if not e.name.startswith("lmstack"):
            continue
        parts = []
        for p in peers:
            if p.name.startswith("HF") and p.fmt not in ("fp32", e.fmt):
                continue
            parts.append(
                f"/{p.name}: {med[e.name][1] / med[p.name][1]:.2f}x"
                + (
                    f" (per CPU-s {med[e.name][2] / med[p.name][2]:.2f}x)"
                    if med[p.name][2] == med[p.name][2]
                    else ""
                )
            )
        print(f"{e.name:<30} decode " + "  ".join(parts))
    aim = [e for e in engines if e.name.startswith("lmstack")]
    hf32 = med.get("HF transformers fp32")
    if hf32:
        best = max(aim, key=lambda e: med[e.name][1])
        ratio = med[best.name][1] / hf32[1]
        print(
            f"aim >= 3x HF transformers batch-1 decode: best {best.name} {ratio:.2f}x vs HF fp32 -> "
            f"{'met' if ratio >= 3 else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
