"""Quality vs speed of every quantisation method on SmolLM2-135M in one run (docs/quant.md's table).

    nice -n 10 python benchmarks/quant_quality.py [--threads 1] [--seq 256] [--eval-rows 16] [--calib-rows 16]
        [--methods fp32,bf16,...] [--out results.md] [--plot quant_quality.png] [--race-rounds 5] [--race-threads 1,2]

With no --methods every method runs (weights, formats, peers, the KV pool rows), then llama.cpp's own row and
the decode race; a method that fails gets a row saying why and the run goes on. ``--out`` is rewritten
atomically after every method (marked partial until the end), ``--plot`` written atomically at the end.

For each method: perplexity on the evaluation text (rows of ``--seq`` tokens, next-token NLL over all
positions), Δ vs fp32, the weight bytes one decode step reads (the embedding table only when it is
also the unembedding), batch-1 greedy decode tok/s (``--decode`` new tokens after a 16-token prompt,
the contiguous KV cache) and prefill tok/s (one forward over ``--seq`` tokens, last logits only).

Texts (offline): evaluation = the GPL-3 licence text, calibration (GPTQ/AWQ) = the Apache-2.0 and
GFDL-1.3 licence texts, all from /usr/share/common-licenses; where those are missing, held-out /
calibration slices of Python standard-library sources (the demo's default corpus).

The "fp32" model is the shipped GGUF dequantised: its block linears are Q4_1 (int4, groups of 32),
its embedding Q8_0. int4 with groups of 32 therefore reproduces the block weights exactly (RTN's
loss at G = 32 is the unembedding's); groups of 64 are the comparison where the methods differ.
The KV-cache rows run the engine's paged pool (``PagedKVCache``, blocks of 16, fp32 weights) the way
decoding fills it: a 16-token prefill, then one token per forward, over ``--kv-rows`` rows; each compares
with the fp32 pool fed the same way (their Δ is against that row) and states the pool's bytes.
The decode race (item "int4 decode vs llama.cpp"): lmstack int4 with a compiled decode step on its own
VNNI kernel and on torch's kernel, and llama.cpp on the Q4_1 GGUF, at each of ``--race-threads``,
``--race-rounds`` interleaved rounds (each engine once per round), medians and ms/token.
Peers when installed and runnable on this CPU: bitsandbytes (Linear8bitLt, Linear4bit NF4),
torchao (int8 / int4 weight-only), llama.cpp on the same GGUF (``llama-cpp-python``; its
perplexity over the same token ids from its logits); a peer that is missing or fails gets a row
saying why.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from lmstack.inference import SamplingParams, generate
from lmstack.inference.loader import model_tokenizer
from lmstack.model.gguf import read_gguf_header, unpermute_rope_rows
from lmstack.model.io import find_named_model, load_model
from lmstack.model.layers import Linear
from lmstack.quant import Int4Linear, Int8Linear, quantize_model
from lmstack.quant.awq import awq_quantize_model
from lmstack.quant.formats import simulate_model
from lmstack.quant.gguf_blocks import gguf_int4
from lmstack.quant.gptq import gptq_quantize_model
from lmstack.quant.llm_int8 import llm_int8_model, outlier_stats
from lmstack.utils import atomic_path, atomic_write_text

LICENSES = Path("/usr/share/common-licenses")


def texts() -> tuple[str, str, str]:
    """(evaluation text, calibration text, where they came from)."""
    if all((LICENSES / n).is_file() for n in ("GPL-3", "Apache-2.0", "GFDL-1.3")):
        return (
            (LICENSES / "GPL-3").read_text(),
            (LICENSES / "Apache-2.0").read_text() + (LICENSES / "GFDL-1.3").read_text(),
            "eval GPL-3, calibration Apache-2.0 + GFDL-1.3 licence texts",
        )
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(lib.glob("*.py"))
    half = len(files) // 2
    cal = "".join(f.read_text(errors="ignore") for f in files[:20])
    ev = "".join(f.read_text(errors="ignore") for f in files[half : half + 20])
    return ev, cal, "eval/calibration: disjoint Python stdlib modules"


def rows(ids: list[int], n: int, seq: int) -> torch.Tensor:
    k = min(n, len(ids) // seq)
    if k < 1:
        raise ValueError(f"{len(ids)} tokens do not fill one row of {seq}")
    return torch.tensor(ids[: k * seq]).view(k, seq)


@torch.inference_mode()
def perplexity(model: nn.Module, ev: torch.Tensor, desc: str = "perplexity") -> float:
    nll, n = 0.0, 0
    for r in tqdm(ev, desc=desc, leave=False, unit="row"):
        logits = model(r[None])[0].float()  # (S, V)
        nll += F.cross_entropy(logits[:-1], r[1:], reduction="sum").item()
        n += r.numel() - 1
    return math.exp(nll / n)


@torch.inference_mode()
def kv_perplexity(
    model: nn.Module, ev: torch.Tensor, fmt: str | None, prefill: int = 16, step: int = 1
) -> tuple[float, int]:
    """Perplexity when each row goes through the engine's paged pool (blocks of 16; fp32 when ``fmt`` is
    None, else "int8"/"fp8" blocks): a ``prefill``-token chunk, then ``step`` tokens per forward (1 = decode),
    and the pool's bytes for one row."""
    from lmstack.inference.paged import PagedKVCache

    nll, count, S = 0.0, 0, ev.shape[1]
    for r in tqdm(ev, desc=f"KV {fmt or 'fp32'}", leave=False):
        pool = PagedKVCache(
            model.config,
            S // 16 + 1,
            16,
            torch.float32 if fmt is None else fmt,
            enable_prefix_caching=False,
        )
        ids = r.tolist()
        pool.blocks.allocate(0, ids)
        logits, start = [], 0
        while start < S:
            n = min(prefill if start == 0 else step, S - start)
            pool.blocks.reserve(0, n)
            batch, pos, seq = pool.packed_batch([(0, start, n)])
            logits.append(
                model(r[None, start : start + n], pos, kv_cache=batch, document_ids=seq)[0]
            )
            pool.blocks.commit(0, ids, n)
            start += n
        logits = torch.cat(logits).float()
        nll += F.cross_entropy(logits[:-1], r[1:], reduction="sum").item()
        count += S - 1
    return math.exp(nll / count), pool.nbytes


KV_METHODS = {
    "KV pool fp32 (paged decode)": None,
    "KV pool int8 (paged blocks of 16)": "int8",
    "KV pool fp8 e4m3 (paged blocks of 16)": "fp8",
}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: ``kernel_bytes()`` of each quantised module (plus its float
    parameters), every other parameter once, the embedding only when it is also the unembedding."""
    total, seen = 0, set()
    for m in model.modules():
        if hasattr(m, "kernel_bytes") and not any(id(p) in seen for p in m.parameters()):
            total += m.kernel_bytes()  # codes and scales; a float bias is counted below
            for name, p in m.named_parameters():
                if name != "bias":
                    seen.add(id(p))
    tied = getattr(model, "lm_head", None) is None
    for name, p in model.named_parameters():
        if id(p) not in seen and (tied or not name.startswith("embed.")):
            total += p.numel() * p.element_size()
    return total


@torch.inference_mode()
def speed(
    model: nn.Module, prompt: list[int], ev: torch.Tensor, n_new: int, repeats: int
) -> tuple[float, float]:
    list(generate(model, prompt, SamplingParams(temperature=0, max_tokens=4)))  # warm-up
    dec, pre = [], []
    for _ in tqdm(range(repeats), desc="decode/prefill timing", leave=False):
        t = time.perf_counter()
        n = sum(1 for _ in generate(model, prompt, SamplingParams(temperature=0, max_tokens=n_new)))
        dec.append(n / (time.perf_counter() - t))
        t = time.perf_counter()
        model(ev[:1], last_n=1)
        pre.append(ev.shape[1] / (time.perf_counter() - t))
    return statistics.median(dec), statistics.median(pre)


# ---- peers ---------------------------------------------------------------------------------------------------


def _swap_linears(model: nn.Module, make) -> nn.Module:
    for block in model.blocks:
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, Linear):
                    setattr(parent, name, make(child.weight.detach(), child.bias))
    W = model.embed.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = make(W.detach().clone(), None)
    return model


class _Once(logging.Filter):
    """Let each distinct message through once (bitsandbytes logs its fp32 -> fp16 cast on every call)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg in self.seen:
            return False
        self.seen.add(msg)
        return True


def bnb_model(model: nn.Module, kind: str) -> nn.Module:
    import bitsandbytes as bnb

    log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _Once) for f in log.filters):
        log.addFilter(_Once())

    def make(w, b):
        O, I = w.shape
        if kind == "int8":
            lin = bnb.nn.Linear8bitLt(I, O, bias=False, has_fp16_weights=False, threshold=6.0)
            lin.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
        else:
            lin = bnb.nn.Linear4bit(
                I, O, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4"
            )
            lin.weight = bnb.nn.Params4bit(
                w.clone(), requires_grad=False, quant_type="nf4", blocksize=64
            )
        return lin.to(
            "cpu"
        )  # its packed weight is its parameter (counted; the absmax / SCB scales are not)

    return _swap_linears(model, make)


def torchao_model(model: nn.Module, kind: str) -> nn.Module:
    from torchao.quantization import quantize_

    def make(w, b):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        O, I = w.shape
        lin.kernel_bytes = lambda: (
            O * I * (1 if kind == "int8" else 0.5) + 2 * O * (1 if kind == "int8" else 2 * I // 32)
        )
        return lin

    _swap_linears(model, make)
    model.to(torch.bfloat16)
    if kind == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        quantize_(model, Int8WeightOnlyConfig())
    else:
        from torchao.quantization import Int4WeightOnlyConfig

        quantize_(model, Int4WeightOnlyConfig(group_size=32))
    return model


def int8_head(model: nn.Module) -> nn.Module:
    """The unembedding as ``Int8Linear`` (per-row scales) of the tied embedding / lm_head weight."""
    W = model.embed.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = Int8Linear.from_weight(W.detach())
    return model


def gguf_own_model(model: nn.Module) -> nn.Module:
    """The GGUF's Q4_1 block linears read as codes straight into Int4Linear (no float round trip); the
    Q8_0 embedding stays as its dequantised floats (tied unembedding)."""
    path = find_named_model("smollm2-135m")
    header = read_gguf_header(path)
    cfg = model.config
    for name, s in header.spans.items():
        if s.qtype.name not in ("Q4_0", "Q4_1", "Q4_K") or not name.startswith("blocks."):
            continue
        q, sc, lo = gguf_int4(header.data[s.start : s.end].reshape(s.shape[0], -1), s.qtype.name)
        heads = cfg.n_heads if ".q_proj." in name else cfg.n_kv_heads if ".k_proj." in name else 0
        if heads:
            q, sc, lo = (unpermute_rope_rows(t, heads) for t in (q, sc, lo))
        parent = model.get_submodule(name.rsplit(".", 2)[0])
        setattr(
            parent,
            name.rsplit(".", 2)[1],
            Int4Linear(q.contiguous(), sc.contiguous(), lo.contiguous()),
        )
    model.quantization = "gguf-q4_1"
    return model


def llama_cpp_ppl(ev: torch.Tensor) -> float:
    """llama.cpp's perplexity over the same token ids: its logits for every position (``logits_all``)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(find_named_model("smollm2-135m")),
        n_ctx=ev.shape[1],
        logits_all=True,
        n_threads=1,
        verbose=False,
    )
    nll, n = 0.0, 0
    for r in ev.tolist():
        llm.reset()
        llm.eval(r)
        logits = torch.tensor(llm.scores[: len(r)]).float()
        nll += F.cross_entropy(logits[:-1], torch.tensor(r[1:]), reduction="sum").item()
        n += len(r) - 1
    return math.exp(nll / n)


class LlamaCpp:
    """llama.cpp on the Q4_1 GGUF at ``threads`` threads: ``run`` -> (prefill tok/s, decode tok/s)."""

    def __init__(self, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.name = f"llama.cpp Q4_1 GGUF ({threads}t)"
        self.llm = Llama(
            model_path=str(find_named_model("smollm2-135m")),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def run(self, prompt: list[int], n_new: int) -> tuple[float, float]:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(prompt)
        pre = len(prompt) / (time.perf_counter() - t)
        stamps = []
        token = int(torch.tensor(self.llm.scores[len(prompt) - 1]).argmax())
        for _ in range(n_new):
            self.llm.eval([token])
            stamps.append(time.perf_counter())
            token = int(torch.tensor(self.llm.scores[self.llm.n_tokens - 1]).argmax())
        return pre, (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float(
            "nan"
        )


class LmstackInt4:
    """lmstack int4 (RTN G32 = the GGUF's Q4_1 block weights, int4 unembedding) with a compiled decode step
    on ``kernel`` ("vnni": lmstack's, the VNNI or AVX2 one ``int4_vnni.kernel()`` chose; "aten": torch's):
    ``run`` -> (prefill tok/s, decode tok/s); the name says which kernel ran."""

    def __init__(self, base: nn.Module, kernel: str, max_len: int, compile: bool = True):
        from lmstack.inference.static import StaticDecoder

        self.model = quantize_model(copy.deepcopy(base), "int4")
        if kernel == "aten":
            to_aten_int4(self.model)
        ran = "+".join(
            sorted({m.kernel for m in self.model.modules() if isinstance(m, Int4Linear)})
        )
        self.name = f"lmstack int4 {'compiled' if compile else 'static cache, eager'} ({ran} kernel)"  # the one that ran
        self.decoder = StaticDecoder(self.model, max_len, compile=compile)
        self.decoder.warm_up()

    @torch.inference_mode()
    def run(self, prompt: list[int], n_new: int) -> tuple[float, float]:
        self.decoder.reset()
        t = time.perf_counter()
        logits = self.decoder.prefill(prompt)
        pre = len(prompt) / (time.perf_counter() - t)
        stamps, token = [], logits.argmax()
        for i in range(n_new):
            logits = self.decoder.decode(token.view(1, 1), torch.tensor([len(prompt) + i]))
            token = logits.argmax()
            int(token)  # the host reads the token, as a sampler does
            stamps.append(time.perf_counter())
        return pre, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def to_aten_int4(model: nn.Module) -> nn.Module:
    """Every Int4Linear on lmstack's VNNI kernel rebuilt on torch's ``_weight_int4pack_mm_for_cpu`` (same codes)."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Int4Linear) and mod.vnni:
            parent, _, attr = name.rpartition(".")
            setattr(
                model.get_submodule(parent) if parent else model,
                attr,
                Int4Linear(mod._codes(), mod.scale, mod.lo, mod.bias, kernel="aten"),
            )
    return model


def decode_race(
    base: nn.Module,
    prompt: list[int],
    n_new: int,
    threads: list[int],
    rounds: int,
    compile: bool = True,
    kernels: tuple[str, ...] = ("vnni", "aten"),
) -> list[str]:
    """Interleaved rounds of lmstack int4 (``kernels``: "vnni" = lmstack's chosen kernel, "aten" = torch's;
    compiled step, built and compiled once for all thread counts) and llama.cpp per thread count."""
    out = [
        "| threads | engine | decode tok/s (median) | ms/token | all rounds tok/s | prefill tok/s | "
        "lmstack / this |",
        "|---|---|---|---|---|---|---|",
    ]
    torch.set_num_threads(threads[0])
    lm_engines = [
        LmstackInt4(
            base, k, len(prompt) + n_new + 8, compile
        )  # the compile is most of the race's time
        for k in tqdm(
            kernels, desc=f"{'compiling' if compile else 'building'} int4 decode steps", leave=False
        )
    ]
    for th in threads:
        torch.set_num_threads(th)
        engines = list(lm_engines)
        try:
            engines.append(LlamaCpp(th, len(prompt) + n_new + 8))
            if th == threads[0]:
                import llama_cpp

                out.insert(
                    0,
                    f"llama.cpp {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}; "
                    f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}\n",
                )
        except Exception as e:  # noqa: BLE001
            out.append(f"| {th} | llama.cpp | — ({type(e).__name__}: {str(e)[:80]}) | | | | |")
        res: dict[str, list] = {e.name: [] for e in engines}
        for e in engines:
            e.run(prompt, 4)  # warm-up
        for _ in tqdm(range(rounds), desc=f"decode race, {th} thread(s)", leave=False):
            for e in engines:
                res[e.name].append(e.run(prompt, n_new))
        med = {k: statistics.median(d for _, d in v) for k, v in res.items()}
        ours = med[engines[0].name]
        for k, v in res.items():
            out.append(
                f"| {th} | {k} | {med[k]:.1f} | {1000 / med[k]:.1f} | {', '.join(f'{d:.0f}' for _, d in v)} | "
                f"{statistics.median(p for p, _ in v):.0f} | {ours / med[k]:.2f}x |"
            )
        print("\n".join(out), flush=True)
    return out


# ---- the methods ---------------------------------------------------------------------------------------------


def builders(calib: torch.Tensor) -> dict:
    return {
        "fp32": lambda m: m,
        "bf16": lambda m: m.to(torch.bfloat16),
        "int8 RTN": lambda m: quantize_model(m, "int8"),
        "LLM.int8 (t=6)": lambda m: llm_int8_model(m),
        "LLM.int8 (t=2)": lambda m: llm_int8_model(m, threshold=2.0),
        "int4 RTN G32": lambda m: quantize_model(m, "int4"),
        "GPTQ int4 G32": lambda m: gptq_quantize_model(m, calib, 4, 32),
        "AWQ int4 G32": lambda m: awq_quantize_model(m, calib, 32),
        "int4 RTN G64": lambda m: quantize_model(m, "int4", group_size=64),
        "GPTQ int4 G64": lambda m: gptq_quantize_model(m, calib, 4, 64),
        "GPTQ int4 G64 act-order": lambda m: gptq_quantize_model(m, calib, 4, 64, act_order=True),
        "GPTQ int4 G64 act-order + range search": lambda m: gptq_quantize_model(
            m, calib, 4, 64, act_order=True, shrink_grid=20
        ),
        "GPTQ int4 G64 act-order + range search; int8 unembedding": lambda m: int8_head(
            gptq_quantize_model(m, calib, 4, 64, act_order=True, shrink_grid=20, lm_head=False)
        ),
        "AWQ int4 G64": lambda m: awq_quantize_model(m, calib, 64),
        "fp8 e4m3 per-channel (sim)": lambda m: simulate_model(m, "fp8-e4m3"),
        "fp8 e4m3 W8A8 (sim)": lambda m: simulate_model(m, "fp8-e4m3-w8a8"),
        "fp8 e5m2 per-channel (sim)": lambda m: simulate_model(m, "fp8-e5m2"),
        "MXFP8 (sim)": lambda m: simulate_model(m, "mxfp8"),
        "MXFP4 (sim)": lambda m: simulate_model(m, "mxfp4"),
        "NF4 blocks of 64 (sim)": lambda m: simulate_model(m, "nf4"),
        "GGUF Q4_1 blocks -> Int4Linear (Q8_0 embedding as floats)": gguf_own_model,
        "bitsandbytes LLM.int8": lambda m: bnb_model(m, "int8"),
        "bitsandbytes NF4": lambda m: bnb_model(m, "nf4"),
        "torchao int8 weight-only": lambda m: torchao_model(m, "int8"),
        "torchao int4 weight-only G32": lambda m: torchao_model(m, "int4"),
    }


LLAMA_CPP_ROW = "llama.cpp Q4_1 GGUF (its own logits)"


def run_method(
    name: str,
    table: dict,
    base: nn.Module,
    ev: torch.Tensor,
    prompt: list[int],
    args: argparse.Namespace,
) -> dict:
    """One row: build the model (a deep copy of ``base``), its perplexity, weight bytes and speed; a KV row
    runs the paged pool instead. A method that fails gets a row saying why (the run goes on)."""
    t = time.perf_counter()
    try:
        if name in KV_METHODS:
            p, kv = kv_perplexity(base, ev[: args.kv_rows], KV_METHODS[name], step=args.kv_step)
            return dict(
                ppl=p,
                bytes=weight_bytes(base),
                decode=float("nan"),
                prefill=float("nan"),
                seconds=time.perf_counter() - t,
                note=f"fp32 weights, {min(args.kv_rows, ev.shape[0])} rows, 16-token prefill then "
                f"{args.kv_step} token(s) per forward; pool of {ev.shape[1] // 16 + 1} blocks x 16: "
                f"{kv / 1e6:.2f} MB",
            )
        model = table[name](copy.deepcopy(base)).eval()
        build = time.perf_counter() - t
        r = dict(
            ppl=perplexity(model, ev, desc=f"perplexity ({name})"),
            bytes=weight_bytes(model),
            build=build,
        )
        r["decode"], r["prefill"] = speed(model, prompt, ev, args.decode, args.repeats)
        if name.startswith("LLM.int8 (t=6"):
            st = outlier_stats(model)
            r["note"] = (
                f"outlier columns per call, mean over layers "
                f"{sum(s['mean_per_call'] for s in st) / len(st):.2f}; max "
                f"{max(s['mean_per_call'] for s in st):.1f} ({max(st, key=lambda s: s['mean_per_call'])['layer']})"
            )
    except Exception as e:  # noqa: BLE001 — a peer that does not run here gets a row saying why
        r = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    r["seconds"] = time.perf_counter() - t
    return r


def llama_cpp_row(ev: torch.Tensor, prompt: list[int], args: argparse.Namespace) -> dict:
    t = time.perf_counter()
    try:
        r = dict(ppl=llama_cpp_ppl(ev), bytes=find_named_model("smollm2-135m").stat().st_size)
        for th in sorted({1, 2, args.threads}):
            eng = LlamaCpp(th, ev.shape[1] + args.decode + 8)
            eng.run(prompt, 4)
            runs = [eng.run(prompt, args.decode) for _ in range(args.repeats)]
            pre = [eng.run(ev[0].tolist(), 1)[0] for _ in range(args.repeats)]
            r[f"decode_{th}t"] = statistics.median(d for _, d in runs)
            r[f"prefill_{th}t"] = statistics.median(pre)
        r["decode"], r["prefill"] = r[f"decode_{args.threads}t"], r[f"prefill_{args.threads}t"]
        r["note"] = (
            "; ".join(
                f"{th} thread(s): decode {r[f'decode_{th}t']:.1f}, prefill {r[f'prefill_{th}t']:.0f} tok/s"
                for th in sorted({1, 2, args.threads})
            )
            + " (file bytes as weight MB)"
        )
    except Exception as e:  # noqa: BLE001
        r = dict(error=f"{type(e).__name__}: {e}"[:140])
    r["seconds"] = time.perf_counter() - t
    return r


def markdown(results: dict[str, dict], header: str, race: list[str]) -> str:
    ref = results.get("fp32", {}).get("ppl")
    kv_ref = results.get("KV pool fp32 (paged decode)", {}).get("ppl")
    lines = [
        header,
        "",
        "| method | perplexity | Δ vs fp32 | weight MB | decode tok/s | prefill tok/s | time s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | — | — | — | — | — ({r['error']}) | {r['seconds']:.0f} |")
            continue
        base_ppl = kv_ref if name in KV_METHODS else ref
        delta = f"{100 * (r['ppl'] / base_ppl - 1):+.2f}%" if base_ppl else "—"
        dec = "—" if math.isnan(r["decode"]) else f"{r['decode']:.1f}"
        pre = "—" if math.isnan(r["prefill"]) else f"{r['prefill']:.0f}"
        lines.append(
            f"| {name} | {r['ppl']:.3f} | {delta} | {r['bytes'] / 1e6:.1f} | {dec} | {pre} | {r['seconds']:.0f} |"
        )
    notes = [f"- {n}: {r['note']}" for n, r in results.items() if r.get("note")]
    if any(n in KV_METHODS for n in results):
        notes.append(
            '- KV rows: Δ against the fp32 pool fed the same way ("KV pool fp32"), not against fp32 above'
        )
    return "\n".join(lines + [""] + notes + race) + "\n"


def plot(results: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        if "error" not in r and name not in KV_METHODS:  # KV rows: fp32 weights, another baseline
            ax.scatter(r["bytes"] / 1e6, r["ppl"])
            ax.annotate(name, (r["bytes"] / 1e6, r["ppl"]), fontsize=6)
    ax.set_xlabel("weight MB read per decode step")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M: quality vs size")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--eval-rows", type=int, default=16)
    ap.add_argument("--calib-rows", type=int, default=16)
    ap.add_argument("--decode", type=int, default=32, help="new tokens per decode timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--methods",
        default="",
        help="comma-separated subset of the method names (default: all, the KV pool rows included)",
    )
    ap.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--kv-rows", type=int, default=4, help="evaluation rows fed through the KV pool"
    )
    ap.add_argument(
        "--kv-step",
        type=int,
        default=1,
        help="tokens per forward after the 16-token prefill (1 = decode)",
    )
    ap.add_argument(
        "--race-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compiled lmstack decode steps in the race (--no-race-compile: eager)",
    )
    ap.add_argument(
        "--race-threads",
        default="1,2",
        help="thread counts of the int4 / llama.cpp decode race ('' = none)",
    )
    ap.add_argument("--race-rounds", type=int, default=5)
    ap.add_argument(
        "--race-kernels",
        default="vnni,aten",
        help="lmstack int4 engines of the race: vnni (lmstack's kernel, VNNI or AVX2 as chosen), aten",
    )
    ap.add_argument("--race-prompt", type=int, default=128, help="prompt tokens of the race")
    ap.add_argument("--race-decode", type=int, default=64, help="new tokens per race round")
    ap.add_argument(
        "--out",
        help="also write the markdown table here (rewritten after every method, atomically)",
    )
    ap.add_argument("--plot", help="write a perplexity vs weight-bytes scatter (PNG) here")
    args = ap.parse_args()
    for flag in (
        "threads",
        "seq",
        "eval_rows",
        "calib_rows",
        "decode",
        "repeats",
        "kv_rows",
        "kv_step",
        "race_rounds",
        "race_prompt",
        "race_decode",
    ):
        if getattr(args, flag) < 1:
            sys.exit(f"--{flag.replace('_', '-')}={getattr(args, flag)}: expected ≥ 1")
    try:
        threads = [int(t) for t in args.race_threads.split(",") if t.strip()]
    except ValueError:
        sys.exit(
            f"--race-threads={args.race_threads!r}: expected comma-separated integers, e.g. 1,2"
        )
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            sys.exit(f"{flag} {path}: its folder does not exist")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    lm = load_model("smollm2-135m")
    base = lm.model.eval()
    tok = model_tokenizer(lm.source)
    ev_text, cal_text, where = texts()
    ev = rows(tok.encode(ev_text), args.eval_rows, args.seq)
    calib = rows(tok.encode(cal_text), args.calib_rows, args.seq)
    prompt = ev[0, :16].tolist()
    race_prompt = ev[1 % ev.shape[0]].tolist()[: args.race_prompt]
    if len(race_prompt) < args.race_prompt:
        race_prompt = tok.encode(ev_text)[: args.race_prompt]
    header = (
        f"SmolLM2-135M, torch {torch.__version__}, {args.threads} thread(s), load avg at start "
        f"{os.getloadavg()[0]:.1f}; {where}; eval {tuple(ev.shape)}, calibration {tuple(calib.shape)}; "
        f"`{shlex.join(['python', 'benchmarks/quant_quality.py'] + sys.argv[1:])}`"
    )
    print(header, flush=True)
    table = builders(calib)
    table.update({k: None for k in KV_METHODS})
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()] or list(table)
    for m in wanted:
        if m not in table:
            sys.exit(f"--methods: unknown method {m!r}; expected names from {list(table)}")
    results: dict[str, dict] = {}
    bar = tqdm(wanted + ([LLAMA_CPP_ROW] if args.llama_cpp else []), desc="methods", unit="method")
    for name in bar:
        bar.set_postfix_str(name[:40])
        if name == LLAMA_CPP_ROW:
            results[name] = r = llama_cpp_row(ev, prompt, args)
        else:
            results[name] = r = run_method(name, table, base, ev, prompt, args)
        tqdm.write(
            f"{name} { ({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}) }"
        )
        if args.out:  # a crash later keeps the rows so far
            atomic_write_text(args.out, markdown(results, header + " (partial: still running)", []))
    race = []
    if threads:
        try:
            race = [""] + decode_race(
                base,
                race_prompt,
                args.race_decode,
                threads,
                args.race_rounds,
                args.race_compile,
                tuple(k for k in args.race_kernels.split(",") if k),
            )
        except Exception as e:  # noqa: BLE001 — the table above stays
            race = ["", f"decode race failed: {type(e).__name__}: {e}"]
        torch.set_num_threads(args.threads)
    race.append(
        f"\n(total {(time.perf_counter() - t_start) / 60:.1f} min, load avg at the end {os.getloadavg()[0]:.1f})"
    )
    text = markdown(results, header, race)
    print(text)
    if args.out:
        atomic_write_text(args.out, text)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
