"""``lmstack bench``: time attention backends or a model's training step (CS336 notes "基准测试").

    lmstack bench model --preset smollm2-135m --n-layers 2 --batch 2 --seq 128 [--json out.json] [--nvtx]
    lmstack bench attention --seq 256,512,1024 --backends sdpa,flash_pytorch,reference

Every run warms up, synchronises the device around each clock read, repeats, and prints the
median and min; ``--json`` also writes the numbers with the machine description. ``--nvtx``
opens NVTX ranges (forward / backward / optimizer) for ``nsys profile`` — off by default.
"""

from __future__ import annotations

import argparse
import json

import torch

from lmstack.kernels.bench import (
    bench_attention,
    bench_model,
    format_table,
    machine_info,
    parse_dtype,
    write_json,
)
from lmstack.kernels.runtime import RuntimeConfig, configure
from lmstack.model.config import ModelConfig
from lmstack.model.hf import load_config
from lmstack.model.transformer import Transformer
from lmstack.threads import add_threads_argument
from lmstack.utils import check_outputs, is_json_file


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark attention backends or a model training step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(title="what", metavar="WHAT")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        q.add_argument(
            "--dtype", default=None, help="fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu)"
        )
        q.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls (default 1)")
        q.add_argument(
            "--repeats",
            type=int,
            default=3,
            help="timed calls; median and min reported (default 3)",
        )
        q.add_argument("--json", metavar="PATH", help="also write the results as JSON")
        q.add_argument(
            "--force", action="store_true", help="replace an existing --json file that is not JSON"
        )
        add_threads_argument(q)
        q.add_argument(
            "--nvtx", action="store_true", help="emit NVTX ranges for Nsight Systems (CUDA)"
        )

    m = sub.add_parser(
        "model", help="forward / backward / optimizer-step breakdown of a model config"
    )
    m.add_argument("--preset", default="smollm2-135m", help="model preset (default smollm2-135m)")
    m.add_argument(
        "--config",
        metavar="PATH",
        help="config JSON (lmstack or HF config.json) instead of a preset",
    )
    m.add_argument("--n-layers", type=int, help="override the number of layers L (a quicker run)")
    m.add_argument("--batch", type=int, default=2, help="B (default 2)")
    m.add_argument("--seq", type=int, default=128, help="S (default 128)")
    m.add_argument(
        "--attn-backend",
        default=None,
        help="auto | sdpa | reference | flash_pytorch | flash_triton",
    )
    m.add_argument("--norm-backend", default=None, help="auto | torch | triton")
    common(m)
    m.set_defaults(func=_run_model)

    a = sub.add_parser("attention", help="sweep S for attention backends (time and peak memory)")
    a.add_argument("--seq", type=_ints, default=[256, 512, 1024], help="comma-separated S values")
    a.add_argument(
        "--backends",
        default=None,
        help="comma-separated: reference, sdpa, sdpa_flash, flash_pytorch, flash_triton "
        "(default: reference,sdpa,flash_pytorch on CPU; sdpa_flash,flash_triton on CUDA)",
    )
    a.add_argument("--batch", type=int, default=1, help="B (default 1)")
    a.add_argument("--heads", type=int, default=8, help="N query heads (default 8)")
    a.add_argument("--kv-heads", type=int, default=None, help="K kv heads (default N)")
    a.add_argument("--head-dim", type=int, default=64, help="H (default 64)")
    a.add_argument("--no-causal", action="store_true", help="full (bidirectional) attention")
    a.add_argument("--fwd-only", action="store_true", help="time the forward pass only")
    a.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    common(a)
    a.set_defaults(func=_run_attention)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def _device_dtype(args):
    device = args.device or _default_device()
    dtype = parse_dtype(args.dtype or ("bf16" if device.startswith("cuda") else "fp32"))
    return device, dtype


def _check_json_output(args, inputs) -> None:
    """``--json`` must not be an input, nor replace a file that is not JSON (without --force)."""
    check_outputs(
        [("--json", args.json)], inputs, {"--json": ("a JSON file", is_json_file)}, force=args.force
    )


def _run_model(args) -> int:
    _check_json_output(args, [("the --config", args.config)])
    device, dtype = _device_dtype(args)
    cfg = load_config(args.config) if args.config else ModelConfig.from_preset(args.preset)
    overrides = {}
    if args.n_layers:
        overrides["n_layers"] = args.n_layers
    if args.seq > cfg.max_seq_len:
        overrides["max_seq_len"] = args.seq
    cfg = cfg.replace(**overrides)
    runtime = RuntimeConfig(args.attn_backend or "auto", args.norm_backend or "auto")
    model = Transformer(cfg, device=device, dtype=dtype)
    line = configure(model, runtime, max_keys=args.seq)
    attn = model.attention  # None when no layer is softmax attention (e.g. a pure Mamba-2 model)
    res = bench_model(
        model,
        args.batch,
        args.seq,
        {
            "attn_backend": attn.name if attn is not None else "none",
            "norm_backend": runtime.norm_backend,
        },
        args.warmup,
        args.repeats,
        args.nvtx,
    )
    print(
        f"{res['config']}: {res['params'] / 1e6:.1f}M params, B={args.batch} S={args.seq} {res['dtype']} on "
        f"{device} ({line}), median of {args.repeats} after {args.warmup} warm-up"
    )
    print(format_table(res["phases"]))
    print(
        f"tokens/s {res['tokens_per_s']:.1f}   peak memory {res['peak_memory_mib']:.1f} MiB "
        f"(+{res['peak_memory_delta_mib']:.1f} MiB during the step; {res['memory_method']})"
    )
    if args.json:
        write_json(args.json, res)
    return 0


def _run_attention(args) -> int:
    _check_json_output(args, [])
    device, dtype = _device_dtype(args)
    if args.backends:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    else:
        backends = (
            ["sdpa_flash", "flash_triton"]
            if device.startswith("cuda")
            else ["reference", "sdpa", "flash_pytorch"]
        )
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        raise ValueError(f"--kv-heads={kv} does not divide --heads={args.heads}")
    rows = []
    for S in args.seq:
        for backend in backends:
            rows.append(
                bench_attention(
                    backend,
                    args.batch,
                    args.heads,
                    kv,
                    S,
                    args.head_dim,
                    dtype,
                    device,
                    causal=not args.no_causal,
                    backward=not args.fwd_only,
                    warmup=args.warmup,
                    repeats=args.repeats,
                    memory=not args.no_memory,
                    nvtx=args.nvtx,
                )
            )
    cols = ["backend", "S", "pass", "median_ms", "min_ms"] + (
        [] if args.no_memory else ["peak_mib"]
    )
    print(
        f"attention B={args.batch} N={args.heads} K={kv} H={args.head_dim} {str(dtype)[6:]} on {device}, "
        f"{'causal' if not args.no_causal else 'full'}; median/min of {args.repeats} after {args.warmup} warm-up"
    )
    print(format_table(rows, cols))
    if args.json:
        write_json(args.json, {"rows": rows, "machine": machine_info(device)})
    return 0


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps({"usage": "lmstack bench --help"}))
