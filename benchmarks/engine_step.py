"""One decode step of the batching engine at batch 1, 4, 16: its time and where it goes.

    python benchmarks/engine_step.py --threads 1 [--batch 1,4,16] [--steps 8] [--profile] [--quant int4|int8]

``--batch`` sequences with 128-token random prompts are prefilled, then ``--steps`` decode-only
iterations (``LLMEngine.step``: schedule, forward, sample, commit) are timed; the median is printed
per batch size with the tokens/s it implies, and the median CPU time of the process per step (at one
thread: the step's own cost, less of other jobs' load). ``--profile`` also runs torch.profiler over those steps
and prints the ops with the most self CPU time (linears = ``aten::addmm``/``mm``/``linear``, the K/V
gathers = ``index_select``/``index``, attention, norms, ...) and the time no op accounts for
(Python: scheduling, batch construction, the seam objects). ``--compile`` builds the engine with
its compiled decode step (``LLMEngine(compile=True)``) and warms it up first (printing the warm-up time
and the graphs; a second run reads inductor's on-disk caches); ``--interleave`` then alternates compiled
and eager steps on the same sequences and prints both medians. ``--dtype auto`` loads the Q4_1 GGUF as
``lmstack serve --dtype auto`` does (int4 linears, int8 head).

``--mixed P`` times *mixed* steps instead: with the batch's sequences decoding, ``--prefills K`` new requests
of P random tokens each join, and the step that prefills them (and gives them their first token: the TTFT
of a request arriving at a busy server) is timed, ``--steps`` times on fresh prompts; with ``--profile`` the
ops of those steps are listed as above.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lmstack.inference import LLMEngine, SamplingParams, generate, truncated_draft
from lmstack.inference.loader import load_for_inference
from lmstack.inference.paged import KV_CACHE_DTYPES, kv_cache_dtype
from lmstack.model.io import find_named_model
from lmstack.quant import Int4Linear, quantize_model


def decode_steps(
    engine: LLMEngine, batch: int, steps: int, prompt_len: int, profile: bool, interleave: bool
):
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(
            f"r{batch}-{i}",
            torch.randint(1000, 20000, (prompt_len,), generator=g).tolist(),
            SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True),
        )
    while any(s.num_computed < s.num_prompt for s in engine.requests.values()):
        engine.step()  # prefill (chunks), not timed
    times, cpu, prof = [], [], None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    decode = engine.runner.decode
    for i in range(steps):
        if interleave:  # even steps compiled, odd steps eager, on the same sequences
            decode.compiled = i % 2 == 0
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if interleave:
        decode.compiled = True
    if prof is not None:
        prof.__exit__(None, None, None)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return times, cpu, prof


def mixed_steps(
    engine: LLMEngine,
    batch: int,
    steps: int,
    prompt_len: int,
    new_len: int,
    prefills: int,
    profile: bool,
):
    """``batch`` decoding sequences; per timed step ``prefills`` new requests of ``new_len`` fresh random
    tokens join them: (seconds per mixed step, CPU seconds, profiler or None, rows of the last step)."""
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(
            f"d{batch}-{i}",
            torch.randint(1000, 20000, (prompt_len,), generator=g).tolist(),
            SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True),
        )
    while any(s.num_computed < s.num_prompt for s in engine.requests.values()):
        engine.step()  # prefill (chunks), not timed
    times, cpu, prof, shape = [], [], None, ""
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    for i in range(steps):
        new = [f"p{batch}-{i}-{k}" for k in range(prefills)]
        for rid in new:
            engine.add_request(
                rid,
                torch.randint(1000, 20000, (new_len,), generator=g).tolist(),
                SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            )
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        firsts = sum(o.request_id in new and len(o.token_ids) == 1 for o in outs)
        shape = f"{len(outs) - firsts} decode rows + {firsts} first tokens"
        for rid in new:
            engine.abort_request(rid)
    if prof is not None:
        prof.__exit__(None, None, None)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return times, cpu, prof, shape


def batch1_decode(model, steps: int, prompt_len: int) -> float:
    """Seconds per token of the batch-1 loop (``generate``, contiguous KV cache, eager) after its first token."""
    prompt = torch.randint(
        1000, 20000, (prompt_len,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    times = [
        time.perf_counter()
        for _ in generate(
            model, prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        )
    ]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "int8", "int4", "auto"),
        default="fp32",
        help="auto: the GGUF's own format (Q4_1 -> int4 linears, what `lmstack serve --dtype auto` runs)",
    )
    ap.add_argument(
        "--kv-dtype",
        choices=("model", *KV_CACHE_DTYPES),
        default="model",
        help="the paged pool's K/V dtype (LLMEngine(kv_dtype=...); model: the model's dtype)",
    )
    ap.add_argument("--compile", action="store_true")
    ap.add_argument(
        "--quant", choices=("int4", "int8"), default=None, help="quantise the linears first"
    )
    ap.add_argument(
        "--terms",
        type=int,
        default=None,
        help="int4: int8 terms per activation (Int4Linear.terms; default: the kernel's)",
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="with --compile: alternate compiled and eager steps on the same sequences (a fair ratio "
        "on a shared machine)",
    )
    ap.add_argument(
        "--no-fuse", action="store_true", help="keep q/k/v and gate/up as separate linears"
    )
    ap.add_argument(
        "--max-compiled-batch",
        type=int,
        default=None,
        help="compile decode batches up to this many rows (default: the engine's, larger run eagerly)",
    )
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument(
        "--mixed",
        type=int,
        default=None,
        metavar="P",
        help="time mixed steps: the batch decoding while --prefills new requests of P tokens join",
    )
    ap.add_argument("--prefills", type=int, default=1, help="with --mixed: new requests per step")
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="keep only the first N layers (compiling all 30 takes very long on a loaded CPU)",
    )
    ap.add_argument(
        "--batch1",
        action="store_true",
        help="also time the batch-1 loop (generate, eager) after each batch",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_for_inference(find_named_model("smollm2-135m"), None, args.dtype)
    if args.layers is not None:
        model = truncated_draft(model, args.layers).eval()
    if args.quant:
        model = quantize_model(model, args.quant)
        for m in model.modules():
            if isinstance(m, Int4Linear) and args.terms is not None:
                m.terms = args.terms
    batches = [int(b) for b in args.batch.split(",")]
    kw: dict = {"compile": True} if args.compile else {}
    kw["fuse_projections"] = not args.no_fuse
    if args.kv_dtype != "model":
        kw["kv_dtype"] = kv_cache_dtype(args.kv_dtype)
    seats = max(batches) + (args.prefills if args.mixed is not None else 0)
    engine = LLMEngine(model, max_num_seqs=seats, max_num_batched_tokens=512, **kw)
    if args.max_compiled_batch is not None and engine.runner.decode is not None:
        engine.runner.decode.max_compiled_batch = args.max_compiled_batch
    print(
        f"SmolLM2-135M {args.dtype}{' ' + args.quant if args.quant else ''} ({getattr(model, 'quantization', None) or args.quant or args.dtype} linears, {model.config.n_layers} layers), torch threads {args.threads}, cpu {torch.backends.cpu.get_cpu_capability()}, "
        f"load avg {os.getloadavg()[0]:.1f}, compile={args.compile}, kv {engine.cache.quant or engine.cache.k.dtype}, fused projections {not args.no_fuse}"
    )
    if args.compile:
        t0 = time.perf_counter()
        engine.warm_up()  # every bucket up to the seats: a batch's prefill passes through smaller ones
        print(
            f"warm-up {time.perf_counter() - t0:.1f} s, {engine.runner.decode.graphs} graphs "
            "(a second run reads inductor's on-disk caches)"
        )
    for b in batches:
        graphs = engine.runner.decode.graphs if engine.runner.decode else 0
        if args.mixed is not None:
            times, cpu, prof, shape = mixed_steps(
                engine, b, args.steps, args.prompt_len, args.mixed, args.prefills, args.profile
            )
            ms = statistics.median(times[1:] or times) * 1000
            cpu_ms = statistics.median(cpu[1:] or cpu) * 1000
            print(
                f"batch {b:3d} + {args.prefills} x {args.mixed}-token prefill: mixed step {ms:7.1f} ms "
                f"({shape}), CPU {cpu_ms:7.1f} ms, load avg {os.getloadavg()[0]:.1f}"
            )
            print_profile(prof, times, args.rows)
            continue
        times, cpu, prof = decode_steps(
            engine, b, args.steps, args.prompt_len, args.profile, args.interleave
        )
        if args.interleave:
            c, e = (statistics.median(times[i::2]) * 1000 for i in (2, 3))
            cc, ce = (statistics.median(cpu[i::2]) * 1000 for i in (2, 3))  # CPU: less of the load
            print(
                f"batch {b:3d}: compiled {c:7.1f} ms ({b / c * 1000:6.1f} tok/s), eager {e:7.1f} ms "
                f"({b / e * 1000:6.1f} tok/s), interleaved: compiled / eager = {e / c:.2f}x; "
                f"CPU compiled {cc:.1f} ms, eager {ce:.1f} ms"
            )
        ms = statistics.median(times[1:] or times) * 1000
        cpu_ms = (
            statistics.median(cpu[1:] or cpu) * 1000
        )  # the process's CPU time: less of the load's noise
        print(
            f"batch {b:3d}: decode step {ms:7.1f} ms  ({b / ms * 1000:6.1f} tok/s), CPU {cpu_ms:7.1f} ms  "
            f"load avg {os.getloadavg()[0]:.1f}"
            + (
                f", recompilations {engine.runner.decode.graphs - graphs}"
                if engine.runner.decode
                else ""
            )
        )
        if args.batch1:
            s1 = batch1_decode(model, args.steps, args.prompt_len)
            print(
                f"           batch-1 generate (eager): {s1 * 1000:7.1f} ms/token; engine / batch-1 = "
                f"{b / ms * 1000 * s1:.2f}x tokens/s"
            )
        print_profile(prof, times, args.rows)


def print_profile(prof, times: list[float], rows: int) -> None:
    """The ops with the most self CPU time per step, and the time no op accounts for (Python)."""
    if prof is None:
        return
    ev = prof.key_averages()
    total_ops = sum(e.self_cpu_time_total for e in ev) / 1000 / len(times)
    print(
        f"  per step: ops {total_ops:.1f} ms, outside ops (Python) {sum(times) / len(times) * 1000 - total_ops:.1f} ms"
    )
    for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:rows]:
        print(
            f"  {e.key:40s} {e.self_cpu_time_total / 1000 / len(times):7.2f} ms  {e.count // len(times):5d} calls"
        )


if __name__ == "__main__":
    main()
