"""Server memory under load: the resident set (RSS) of ``lmstack serve`` over rounds of concurrent streams,
to tell a leak (growth that never stops) from allocator warm-up (growth that plateaus). Issue #31 §2.

    python benchmarks/serve_memory.py [--rounds 40] [--streams 64] [--max-tokens 32] [--plot docs/serve_memory.png]
    python benchmarks/serve_memory.py --model CKPT_DIR --tokenizer TOK     # another checkpoint

Without ``--model`` it saves a tiny random Llama (2 layers, d 64, a byte-level tokenizer) and serves that.
Each round opens ``--streams`` completion streams at once (prompts of 1–40 random characters,
``--max-tokens`` tokens each, ``ignore_eos``), reads them to ``[DONE]``, waits until the server reports no
request in flight, then reads the server process's RSS (psutil: the whole process, native and Python). Extra server flags go after ``--``: ``-- --kv-cache-mb 64``. ``--env
MALLOC_ARENA_MAX=2`` sets the server's environment (glibc's arena count, a common cause of native growth).
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
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from tqdm import tqdm


def tiny_checkpoint(folder: Path) -> tuple[Path, Path]:
    import torch

    from lmstack.model.config import ModelConfig
    from lmstack.model.io import save_pretrained
    from lmstack.model.transformer import Transformer
    from lmstack.tokenizer import Tokenizer, save_hf

    cfg = ModelConfig(
        vocab_size=258, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256
    )
    save_pretrained(Transformer(cfg, dtype=torch.float32, seed=1).eval(), folder)
    save_hf(
        Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]),
        folder / "tokenizer.json",
    )
    return folder, folder / "tokenizer.json"


def running(client: httpx.Client, url: str) -> float:
    for line in client.get(url + "/metrics").text.splitlines():
        if line.startswith("lmstack_requests_in_flight "):
            return float(line.split()[1])
    return 0.0


async def one_round(url: str, name: str, n: int, max_tokens: int, rng: random.Random) -> int:
    async def one(client, prompt):
        body = {
            "model": name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            return sum([line == "data: [DONE]" async for line in r.aiter_lines()])

    prompts = [
        "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 40)))
        for _ in range(n)
    ]
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n)) as client:
        done = await asyncio.gather(*[one(client, p) for p in prompts])
    return sum(done)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random model)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server process")
    p.add_argument("--json", default=None, help="write the per-round figures here")
    p.add_argument("--plot", default=None, help="RSS per round as a PNG")
    args = p.parse_args(argv)
    for flag in ("rounds", "streams", "max_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected >= 1")

    tmp = tempfile.TemporaryDirectory()
    model, tok = args.model, args.tokenizer
    if model is None:
        model, tok = tiny_checkpoint(Path(tmp.name) / "tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "lmstack", "serve", "--model", str(model), "--port", str(port)]
    cmd += ["--served-model-name", "m", "--threads", str(args.threads)]
    cmd += ["--tokenizer", str(tok)] if tok else []
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    proc = subprocess.Popen(cmd + extra, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    rss, rng = [], random.Random(0)
    try:
        with httpx.Client(timeout=30) as client:
            start = time.monotonic()
            while True:
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() - start > 120:
                    raise SystemExit(f"the server did not start:\n{proc.stderr.read().decode()}")
                time.sleep(0.2)
            server = psutil.Process(proc.pid)
            rss.append(server.memory_info().rss)
            print(f"start-up RSS {rss[0] / 2**20:.1f} MiB")
            for r in tqdm(range(args.rounds), desc="rounds"):
                done = asyncio.run(one_round(url, "m", args.streams, args.max_tokens, rng))
                if done != args.streams:
                    raise SystemExit(f"round {r}: {done} of {args.streams} streams ended in [DONE]")
                while running(client, url):
                    time.sleep(0.05)
                rss.append(server.memory_info().rss)
    finally:
        proc.terminate()
        proc.wait(30)
    mib = [x / 2**20 for x in rss]
    n = args.streams
    print("round  requests  RSS MiB")
    for i, m in enumerate(mib):
        if i % max(1, len(mib) // 20) == 0 or i == len(mib) - 1:
            print(f"{i:5d}  {i * n:8d}  {m:8.1f}")
    half = len(mib) // 2
    tail = (mib[-1] - mib[half]) / max(1, (len(mib) - 1 - half))
    print(
        f"RSS {mib[0]:.1f} -> {mib[-1]:.1f} MiB over {args.rounds * n} requests; max {max(mib):.1f}; "
        f"second half {tail:+.2f} MiB per round of {n}"
    )
    if args.json:
        from lmstack.utils import atomic_write_text

        atomic_write_text(args.json, json.dumps({"streams": n, "rss_mib": mib}, indent=1))
    if args.plot:
        from lmstack.utils import pyplot, save_png

        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([i * n for i in range(len(mib))], mib, marker=".")
        ax.set(xlabel="requests served", ylabel="server RSS (MiB)", title="lmstack serve memory")
        ax.set_ylim(0, max(mib) * 1.1)
        ax.grid(alpha=0.3)
        save_png(fig, args.plot, dpi=120, bbox_inches="tight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
