"""``lmstack serve``: load a model, build the engine and serve the OpenAI API with uvicorn.

CS336 notes "动态负载" (one engine loop batches every client's requests). SIGTERM / Ctrl-C shut
down gracefully: no new connections, in-flight requests get ``--shutdown-timeout`` seconds to
finish, then are aborted (their KV blocks freed), and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time

import torch

from lmstack.inference.engine import BLOCK_SIZE, LLMEngine
from lmstack.inference.loader import AUTO, add_model_arguments, load_for_inference
from lmstack.inference.paged import KV_CACHE_DTYPES, kv_cache_dtype, kv_pool_bytes
from lmstack.serve import require_serve
from lmstack.threads import add_threads_argument

DEFAULT_KV_MB = 512  # the largest default KV pool (MiB); --kv-cache-mb sets any size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API (FastAPI + uvicorn)")
    add_model_arguments(
        p,
        dtype=AUTO,
        auto=True,
        dtype_help="weight format; auto: a quantised GGUF stays quantised (Q4_* -> int4 linears, "
        "Q8_0 -> int8), anything else fp32",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: --model)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("LMSTACK_API_KEY"),
        help="require `Authorization: Bearer KEY` on every route but /health and the chat page "
        "(default: $LMSTACK_API_KEY, else none)",
    )
    p.add_argument(
        "--public-metrics",
        action="store_true",
        help="with --api-key, leave /metrics open (for a Prometheus scraper without the key); every "
        "other route but /health and the chat page needs the key",
    )
    p.add_argument(
        "--max-body-mb", type=float, default=4.0, help="largest request body in MiB (larger: 413)"
    )
    p.add_argument(
        "--max-seqs", type=int, default=64, help="sequences in the running batch at most"
    )
    p.add_argument(
        "--max-tokens-per-step", type=int, default=512, help="token budget of one engine step"
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        default=None,
        help="KV pool size in MiB (default: what every --max-seqs sequence at --max-model-len needs, "
        f"at most {DEFAULT_KV_MB})",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", *KV_CACHE_DTYPES),
        help="what the KV pool stores (vLLM's flag): auto, the default, is fp16 when the model computes "
        "in fp32 on the CPU (llama.cpp's default K/V type; half the pool's bytes and the decode "
        "attention's reads), else the model's dtype; int8 / fp8: codes with per-block scales",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--compile",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="compile the engine's decode step, one block graph per batch bucket, warmed up before serving "
        "(auto, the default: on a CPU with a C++ compiler; tens of seconds the first time, less from "
        "inductor's disk cache later; docs/inference.md)",
    )
    p.add_argument(
        "--speculative-tokens", type=int, default=0, help="prompt-lookup speculation (0 = off)"
    )
    p.add_argument(
        "--draft-layers",
        type=int,
        default=0,
        help="with --speculative-tokens: a draft model of the target's first N layers (0 = prompt lookup)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests admitted beyond --max-seqs; more get 429 (after --queue-timeout)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=0.0,
        help="seconds a request waits for room before 429",
    )
    p.add_argument("--max-n", type=int, default=16, help="choices (n) per request at most")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGTERM before they are aborted",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="the engine's sampling seed (requests without `seed`)"
    )
    add_threads_argument(p)
    p.set_defaults(func=run_serve)


def compute_dtype(model) -> torch.dtype:
    """The dtype the model's K/V come out in: its first parameter's, fp32 for a quantised one's codes."""
    dtype = next(model.parameters()).dtype
    return dtype if dtype.is_floating_point else torch.float32


def resolve_kv_cache_dtype(name: str, model) -> tuple[torch.dtype | str, str]:
    """(the pool dtype ``LLMEngine(kv_dtype=...)`` takes, why) for ``--kv-cache-dtype name``. auto: fp16 when
    the model computes in fp32 on the CPU (llama.cpp's default K/V type is f16: the same precision as that
    peer, half the pool and half the decode attention's memory reads), else the model's own dtype."""
    if name != "auto":
        return kv_cache_dtype(name), f"--kv-cache-dtype {name}"
    dtype = compute_dtype(model)
    if dtype == torch.float32 and next(model.parameters()).device.type == "cpu":
        return (
            torch.float16,
            "auto: the model computes in fp32 on the CPU, K/V kept in fp16 as llama.cpp's",
        )
    return dtype, "auto: the model's dtype"


def default_kv_cache_bytes(
    model, max_seqs: int, max_model_len: int | None, kv_dtype: torch.dtype | str | None = None
) -> int:
    """The KV pool a server needs at most: every one of ``max_seqs`` sequences at ``max_model_len`` tokens (the
    accounting formula, ``paged.kv_pool_bytes``, in the engine's block size and ``kv_dtype``, default the
    model's), capped at ``DEFAULT_KV_MB``. The pool is zeroed, so touched, at start: sized to the model, a small
    model's server takes little memory."""
    config = model.config
    length = config.max_seq_len if max_model_len is None else min(max_model_len, config.max_seq_len)
    dtype = compute_dtype(model) if kv_dtype is None else kv_dtype
    blocks = max_seqs * -(-length // BLOCK_SIZE) + 1  # + the null block
    return min(DEFAULT_KV_MB * 2**20, kv_pool_bytes(config, blocks, BLOCK_SIZE, dtype))


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping); None where unreadable."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_serve_args(args) -> None:
    """Refuse bad flags before anything loads, each named with what was expected (exit 2, no traceback)."""
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(
            "--api-key is empty (an unset shell variable?): pass a non-empty key, or leave the flag "
            "out (and LMSTACK_API_KEY unset) to serve without authentication"
        )
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port}: expected 1..65535")
    for flag, v in (
        ("--queue-timeout", args.queue_timeout),
        ("--shutdown-timeout", args.shutdown_timeout),
    ):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{flag} {v}: expected a finite number of seconds >= 0")
    for flag, v in (
        ("--max-seqs", args.max_seqs),
        ("--max-tokens-per-step", args.max_tokens_per_step),
        ("--kv-cache-mb", args.kv_cache_mb),
        ("--max-n", args.max_n),
    ):
        if v is not None and v < 1:
            raise ValueError(f"{flag} {v}: expected a positive integer")
    if not math.isfinite(args.max_body_mb) or args.max_body_mb <= 0:
        raise ValueError(f"--max-body-mb {args.max_body_mb}: expected a positive number of MiB")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue {args.max_queue}: expected >= 0")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len {args.max_model_len}: expected a positive integer")
    avail = available_memory_bytes()
    if args.kv_cache_mb is not None and avail is not None and args.kv_cache_mb * 2**20 > avail:
        raise ValueError(
            f"--kv-cache-mb {args.kv_cache_mb}: more than this machine's available memory "
            f"({avail // 2**20} MiB); pass a smaller pool"
        )


def run_serve(args) -> int:
    check_serve_args(args)
    require_serve()  # the serve extra, named before the model loads
    from lmstack.serve import Server, build_app
    from lmstack.serve.http import uvicorn_server

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model, tokenizer = load_for_inference(args.model, args.tokenizer, args.dtype)
    logging.getLogger("lmstack.serve").info(
        "weights: %s (--dtype %s)",
        getattr(model, "quantization", None) or (args.dtype if args.dtype != AUTO else "fp32"),
        args.dtype,
    )
    if args.max_model_len is not None and args.max_model_len > model.config.max_seq_len:
        raise ValueError(
            f"--max-model-len {args.max_model_len} exceeds the model's context "
            f"({model.config.max_seq_len} positions)"
        )
    kv_dtype, why = resolve_kv_cache_dtype(args.kv_cache_dtype, model)
    kv_bytes = (
        default_kv_cache_bytes(model, args.max_seqs, args.max_model_len, kv_dtype)
        if args.kv_cache_mb is None
        else args.kv_cache_mb * 2**20
    )
    engine = LLMEngine(
        model,
        tokenizer,
        max_num_seqs=args.max_seqs,
        max_num_batched_tokens=args.max_tokens_per_step,
        max_model_len=args.max_model_len,
        kv_cache_bytes=kv_bytes,
        kv_dtype=kv_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        num_speculative_tokens=args.speculative_tokens,
        draft_model=args.draft_layers or None,
        seed=args.seed,
        compile=args.compile,
    )
    pool = engine.cache
    logging.getLogger("lmstack.serve").info(
        "KV cache: %s (%s), %d blocks of %d tokens, %.0f MiB",
        pool.quant or str(pool.k.dtype).removeprefix("torch."),
        why,
        pool.k.shape[1],
        pool.block_size,
        pool.nbytes / 2**20,
    )
    t0 = time.perf_counter()
    engine.warm_up()  # the compiled buckets (nothing to do when the step runs eagerly)
    print(
        f"decode step: {engine.compile_reason}; warm-up {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    server = Server(
        engine,
        args.served_model_name or str(args.model),
        api_key=args.api_key,
        max_body_bytes=int(args.max_body_mb * 2**20),
        public_metrics=args.public_metrics,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
        max_n=args.max_n,
    )
    http = uvicorn_server(build_app(server), server, args.host, args.port, args.shutdown_timeout)
    print(
        f"lmstack serve: {server.model_name} on http://{args.host}:{args.port} (chat page at /)",
        flush=True,
    )
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it for the handler that was there
    # before: a no-op one makes that graceful shutdown a clean exit (status 0)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        http.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
