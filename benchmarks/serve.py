"""Load test of an OpenAI-compatible server: Poisson arrivals at several rates, TTFT / ITL percentiles,
throughput and goodput (Book of LLMs §2.1 “latency and throughput” latency vs throughput; CS336 notes "动态负载", "性能指标分析").

    python benchmarks/serve.py [--model smollm2-135m] [--rates 0.5,1,2,4] [--requests 32] [--threads 2]
    python benchmarks/serve.py --url http://127.0.0.1:8000 --served-model-name NAME   # a running server
    python benchmarks/serve.py --llama-cpp                # also llama.cpp's llama-server on the same GGUF
    python benchmarks/serve.py --concurrency 1,4,16 --max-seqs 16 --threads 1 --llama-cpp

Without ``--url`` it starts ``lmstack serve`` as a subprocess on a free port. The trace: ``--requests``
requests per rate, arrivals a Poisson process (exponential gaps, mean 1/rate), prompts of random
words with lengths uniform in [8, 96] words, output lengths uniform in [8, 64] tokens (``ignore_eos``
so every request produces exactly that; the same trace, same seed, at every rate). Each request
streams ``/v1/completions``; TTFT = send → first text chunk, ITL = gaps between chunks, e2e = send →
``[DONE]``. Goodput = requests per second that met the SLO (TTFT ≤ ``--slo-ttft`` s and mean ITL ≤
``--slo-itl`` s). ``--plot`` writes latency vs offered load as a PNG. ``--concurrency 1,4,16`` replaces
the Poisson arrivals by a closed loop: that many streams, each sending its next request of the trace
as soon as its previous one finished.

``--llama-cpp`` runs the same trace against llama.cpp's own ``llama-server`` on the same GGUF, with
continuous batching and as many parallel slots (``-np``) as lmstack's seats (``--max-seqs``), the
same threads, and prints the lmstack / llama.cpp ratios. The binary: ``--llama-server PATH``, else
``$LLAMA_SERVER``, else ``/tmp/llama_server/llama-server``; build it once from the llama.cpp source
vendored in llama-cpp-python's sdist (docs/serving.md: ``pip download llama-cpp-python --no-binary
:all:``, then ``cmake -DGGML_NATIVE=ON`` and ``ninja llama-server``, a few minutes). Without it, the
comparison falls back to ``python -m llama_cpp.server`` (llama-cpp-python: one request at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

WORDS = (
    "the model reads every token once and writes the next one while the scheduler fills each step "
    "with decodes and prefill chunks under a token budget so that short requests never wait for long ones "
    "paged blocks hold keys and values and a prefix cache shares them"
).split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def trace(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 96))) for _ in range(n)]
    outs = [rng.randint(8, 64) for _ in range(n)]
    gaps = [rng.expovariate(1.0) for _ in range(n)]  # unit-rate gaps, scaled by 1/rate
    return prompts, outs, gaps


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, extra: dict
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    t0 = time.perf_counter()
    for attempt in range(2):
        last, first, itl, tokens, chunks = None, None, [], 0, 0
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return Result(False, error=f"{r.status_code} {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if any(c.get("text") for c in chunk.get("choices") or []):
                        chunks += 1
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            itl.append(now - last)
                        last = now
            break
        except httpx.RemoteProtocolError as e:
            # a keep-alive connection the server had closed (llama-server does): the request never
            # started, so send it once more on a fresh connection; the lost time stays in its TTFT
            if attempt or first is not None:
                return Result(False, error=repr(e))
        except httpx.HTTPError as e:
            return Result(False, error=repr(e))
    end = time.perf_counter()
    # a server without stream_options (llama-cpp-python) sends no usage: one chunk per token there
    return Result(first is not None, (first or end) - t0, itl, end - t0, tokens or chunks)


async def run_rate(
    url, model, rate, prompts, outs, gaps, extra, desc
) -> tuple[list[Result], float]:
    limits = httpx.Limits(
        max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4
    )
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        bar = tqdm(total=len(prompts), desc=desc, leave=False)
        tasks = []
        t0 = time.perf_counter()
        for p, m, g in zip(prompts, outs, gaps):
            await asyncio.sleep(g / rate)

            async def go(p=p, m=m):
                res = await one(client, url, model, p, m, extra)
                bar.update(1)
                return res

            tasks.append(asyncio.create_task(go()))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        bar.close()
    return results, wall


async def run_closed(url, model, streams, prompts, outs, extra, desc) -> tuple[list[Result], float]:
    """``streams`` concurrent clients, each sending the trace's next request when its last one ended."""
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    results: list[Result | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        bar = tqdm(total=len(prompts), desc=desc, leave=False)

        async def stream():
            for i in todo:
                results[i] = await one(client, url, model, prompts[i], outs[i], extra)
                bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(streams)))
        wall = time.perf_counter() - t0
        bar.close()
    return results, wall


def summarize(results: list[Result], wall: float, slo_ttft: float, slo_itl: float) -> dict:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    good = [r for r in ok if r.ttft <= slo_ttft and (sum(r.itl) / max(1, len(r.itl))) <= slo_itl]
    return {
        "ok": len(ok),
        "n": len(results),
        "wall": wall,
        "tok_s": sum(r.tokens for r in ok) / wall,
        "req_s": len(ok) / wall,
        "goodput": len(good) / wall,
        **{f"ttft_p{q}": pct([r.ttft for r in ok], q) for q in (50, 90, 99)},
        **{f"itl_p{q}": pct(itl, q) for q in (50, 90, 99)},
        "e2e_p50": pct([r.e2e for r in ok], 50),
        "errors": [r.error for r in results if not r.ok][:3],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, env=None, timeout: float = 300) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not answer within {timeout} s")


def bench(name, url, model, rates, args, extra) -> list[dict]:
    prompts, outs, gaps = trace(args.requests, args.seed)
    asyncio.run(
        run_rate(url, model, 100.0, prompts[:4], outs[:4], gaps[:4], extra, f"{name} warm-up")
    )
    rows = []
    closed = args.concurrency is not None
    for rate in rates:  # with --concurrency: the number of streams
        if closed:
            results, wall = asyncio.run(
                run_closed(url, model, int(rate), prompts, outs, extra, f"{name} {rate:g} streams")
            )
        else:
            results, wall = asyncio.run(
                run_rate(url, model, rate, prompts, outs, gaps, extra, f"{name} {rate:g} req/s")
            )
        s = summarize(results, wall, args.slo_ttft, args.slo_itl)
        s["rate"] = rate
        rows.append(s)
        print(
            f"{name:9s} {rate:6.2f} {s['ok']:3d}/{s['n']:<3d} {s['tok_s']:7.1f} {s['req_s']:6.2f} "
            f"{s['goodput']:6.2f}  {s['ttft_p50']:6.3f} {s['ttft_p90']:6.3f} {s['ttft_p99']:6.3f}  "
            f"{s['itl_p50'] * 1e3:6.1f} {s['itl_p90'] * 1e3:6.1f} {s['itl_p99'] * 1e3:6.1f}",
            flush=True,
        )
        if s["errors"]:
            print("   errors:", s["errors"])
    return rows


def ratios(all_rows: dict[str, list[dict]], load: str) -> None:
    for a, b in zip(all_rows["lmstack"], all_rows["llama.cpp"]):
        print(
            f"{load} {a['rate']:g}: lmstack / llama.cpp tokens/s {a['tok_s'] / b['tok_s']:.2f}x, "
            f"TTFT p50 {a['ttft_p50'] / b['ttft_p50']:.2f}x, ITL p50 {a['itl_p50'] / b['itl_p50']:.2f}x"
        )


def plot(all_rows: dict[str, list[dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, rows in all_rows.items():
        rates = [r["rate"] for r in rows]
        for q, style in ((50, "-o"), (90, "--s")):
            axes[0].plot(rates, [r[f"ttft_p{q}"] for r in rows], style, label=f"{name} p{q}")
            axes[1].plot(rates, [r[f"itl_p{q}"] * 1e3 for r in rows], style, label=f"{name} p{q}")
        axes[2].plot(rates, [r["tok_s"] for r in rows], "-o", label=f"{name} throughput")
        axes[2].plot(rates, [r["goodput"] for r in rows], "--s", label=f"{name} goodput (req/s)")
    for ax, t in zip(axes, ("TTFT (s)", "inter-token latency (ms)", "tokens/s, goodput req/s")):
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_title(t)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)  # atomic
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--url",
        default=None,
        help="a running OpenAI-compatible server (else lmstack serve is started)",
    )
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--label", default="lmstack", help="the name printed for --url's server")
    ap.add_argument("--rates", default="0.5,1,2,4", help="offered loads, requests/s")
    ap.add_argument("--requests", type=int, default=32, help="requests per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument(
        "--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT at most this (s)"
    )
    ap.add_argument(
        "--slo-itl",
        type=float,
        default=0.2,
        help="goodput SLO: mean inter-token latency at most (s)",
    )
    ap.add_argument(
        "--concurrency",
        default=None,
        help="closed loop: these numbers of concurrent streams (e.g. 1,4,16) instead of --rates",
    )
    ap.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also run llama.cpp's llama-server (or llama-cpp-python's server) on the same GGUF",
    )
    ap.add_argument(
        "--llama-server",
        default=os.environ.get("LLAMA_SERVER", "/tmp/llama_server/llama-server"),
        help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, else /tmp/llama_server/llama-server)",
    )
    ap.add_argument(
        "--llama-server-args",
        default="",
        help="extra llama-server flags, e.g. '-nr' (no AMX/repacked weights: the native AMX path "
        "segfaulted in this container)",
    )
    ap.add_argument(
        "--lmstack-args",
        default="",
        help="extra flags for lmstack serve, e.g. '--compile' or '--speculative-tokens 3 --draft-layers 8'",
    )
    ap.add_argument("--plot", default=None, help="PNG path for latency vs load")
    args = ap.parse_args()
    rates = [float(r) for r in (args.concurrency or args.rates).split(",")]
    load = "streams" if args.concurrency else "rate"
    name = args.served_model_name or args.model
    print(
        f"{args.requests} requests per rate; prompts 8-96 words, outputs 8-64 tokens; SLO TTFT <= {args.slo_ttft} s, "
        f"mean ITL <= {args.slo_itl * 1e3:g} ms; server threads {args.threads}"
    )
    print(
        f"{'system':9s} {load:>6s} {'ok':>7s} {'tok/s':>7s} {'req/s':>6s} {'good':>6s}  "
        f"{'TTFT p50':>6s} {'p90':>6s} {'p99':>6s}  {'ITL ms p50':>6s} {'p90':>6s} {'p99':>6s}"
    )
    all_rows = {}
    procs = []
    try:
        url = args.url
        if url is None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            procs.append(
                start(
                    [
                        sys.executable,
                        "-m",
                        "lmstack",
                        "serve",
                        "--model",
                        args.model,
                        "--port",
                        str(port),
                        "--served-model-name",
                        name,
                        "--threads",
                        str(args.threads),
                        "--max-seqs",
                        str(args.max_seqs),
                        "--max-queue",
                        str(4 * args.requests),
                        *args.lmstack_args.split(),
                    ],
                    url,
                    timeout=1800,  # --compile warms its buckets up before answering
                )
            )
        all_rows["lmstack"] = bench(args.label, url, name, rates, args, {"ignore_eos": True})
        if args.llama_cpp and os.access(args.llama_server, os.X_OK):
            from lmstack.model.io import find_named_model

            gguf = find_named_model(args.model)
            port = free_port()
            lurl = f"http://127.0.0.1:{port}"
            ctx = 512  # per slot: prompts of <= 96 words + 64 tokens
            procs.append(
                start(
                    [
                        args.llama_server,
                        "-m",
                        str(gguf),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "-t",
                        str(args.threads),
                        "-tb",
                        str(args.threads),
                        "-np",
                        str(args.max_seqs),
                        "-c",
                        str(ctx * args.max_seqs),
                        "--cont-batching",
                        "--no-webui",
                        *args.llama_server_args.split(),
                    ],
                    lurl,
                )
            )
            all_rows["llama.cpp"] = bench(
                "llama.cpp", lurl, name, rates, args, {"ignore_eos": True}
            )
            ratios(all_rows, load)
        elif args.llama_cpp:
            import importlib.util

            print(f"no llama-server at {args.llama_server} (--llama-server / $LLAMA_SERVER)")
            if importlib.util.find_spec("llama_cpp") is None:
                print(
                    "llama-cpp-python is not installed (it compiles llama.cpp for minutes; docs/log/serving.md): "
                    "skipping the comparison"
                )
            else:
                from lmstack.model.io import find_named_model

                gguf = find_named_model(args.model)
                port = free_port()
                lurl = f"http://127.0.0.1:{port}"
                procs.append(
                    start(
                        [
                            sys.executable,
                            "-m",
                            "llama_cpp.server",
                            "--model",
                            str(gguf),
                            "--port",
                            str(port),
                            "--n_threads",
                            str(args.threads),
                            "--n_ctx",
                            "4096",
                            # queue concurrent requests (by default a new one interrupts the running one)
                            "--interrupt_requests",
                            "False",
                        ],
                        lurl,
                    )
                )
                # llama-cpp-python has no ignore_eos: a -100 logit bias on EOS keeps every output at max_tokens
                from lmstack.inference.loader import model_tokenizer

                eos = model_tokenizer(gguf).eos_token_id
                all_rows["llama.cpp"] = bench(
                    "llama.cpp", lurl, name, rates, args, {"logit_bias": {str(eos): -100}}
                )
                ratios(all_rows, load)
    finally:
        for p in procs:
            p.terminate()
            p.wait(60)
    if args.plot:
        plot(
            all_rows,
            args.plot,
            f"{name}: {args.requests} requests per rate, {args.threads} server threads",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
