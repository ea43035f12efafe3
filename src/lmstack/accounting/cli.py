"""``lmstack plan``: what fits and how fast it runs, before spending a GPU hour.

lmstack plan --model llama2-13b --hardware h100 --batch 1,64,256 --seq 1024
lmstack plan --model path/to/config.json --hardware a100-80gb --json plan.json --plot roofline.png
"""

from __future__ import annotations

import argparse
import json
import os

from rich.console import Console
from rich.table import Table

from lmstack.accounting import param_counts
from lmstack.accounting.hardware import HARDWARE, get_hardware, measure_cpu
from lmstack.accounting.mixers import cache_table, plot_cache_vs_context
from lmstack.accounting.plan import build_plan
from lmstack.accounting.roofline import plot_roofline
from lmstack.model.config import PRESETS, ModelConfig
from lmstack.model.hf import load_config
from lmstack.scaling.planner import optimal_for_params
from lmstack.threads import add_threads_argument
from lmstack.utils import atomic_write_text, check_outputs, is_json_file, is_png_file


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="parameters, FLOPs, memory, roofline latency/throughput and communication for a model on a device",
        description="Accounting for a model (preset, lmstack JSON or HF config.json) on a device at batch sizes B "
        "and context length S (Book of LLMs §1.4-1.9, §2.1, §2.5, §4.1, §5.2, §6.2-6.6; CS336 notes).",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"preset ({', '.join(sorted(PRESETS))}) or a config JSON path",
    )
    p.add_argument(
        "--hardware",
        default="h100",
        help=f"{', '.join(sorted(HARDWARE))}, h100 (= h100-sxm), a100 (= a100-80gb) or cpu (measured)",
    )
    p.add_argument(
        "--batch", default="1,64,256", help="comma-separated batch sizes B (default 1,64,256)"
    )
    p.add_argument("--seq", type=int, default=1024, help="context length S (default 1024)")
    p.add_argument(
        "--dtype", default="bf16", help="weights/KV/activation dtype: bf16, fp16, fp32, fp8, int8"
    )
    p.add_argument(
        "--devices", type=int, default=8, help="M devices for the training/communication tables"
    )
    p.add_argument(
        "--train-batch",
        type=int,
        default=None,
        help="global training batch in sequences of S tokens (default: one per device)",
    )
    p.add_argument(
        "--step-time",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a measured training step time: report MFU for --train-batch sequences on --devices devices",
    )
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH")
    p.add_argument(
        "--plot", metavar="PNG", help="draw the roofline with this workload's points to PNG"
    )
    p.add_argument(
        "--mixers-plot",
        metavar="PNG",
        help="KV + state bytes per sequence vs context for full / 3:1 Gated-DeltaNet:full / 5:1 "
        "local:global / pure Gated DeltaNet layer patterns of this model: a table, and this PNG",
    )
    p.add_argument(
        "--local-window", type=int, default=4096, help="W of the 5:1 local layers (default 4096)"
    )
    p.add_argument(
        "--quick", action="store_true", help="with --hardware cpu: a fast, rough measurement"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --json/--plot file of another kind",
    )
    add_threads_argument(
        p, help="CPU threads for --hardware cpu (default: the CPUs available to this process)"
    )
    p.add_argument(
        "--scaling-law",
        metavar="LAW",
        default=None,
        help="also print the compute-optimal tokens for this model under a lmstack.scaling preset "
        "(chinchilla, epoch, chinchilla-approach1)",
    )
    p.set_defaults(func=run_plan)


def _load_model(spec: str) -> ModelConfig:
    if spec.lower() in PRESETS:
        return ModelConfig.from_preset(spec)
    if os.path.exists(spec):
        return load_config(spec)
    raise ValueError(
        f"--model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing file"
    )


def _parse_batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--batch {text!r}: expected comma-separated integers like 1,64,256"
        ) from None
    if not out or any(b < 1 for b in out):
        raise ValueError(f"--batch {text!r}: batch sizes must be >= 1")
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def run_plan(args: argparse.Namespace) -> int:
    model_file = (
        args.model if args.model.lower() not in PRESETS and os.path.exists(args.model) else None
    )
    check_outputs(
        [("--json", args.json), ("--plot", args.plot), ("--mixers-plot", args.mixers_plot)],
        [("the --model", model_file)],
        {
            "--json": ("a JSON file", is_json_file),
            "--plot": ("a PNG image", is_png_file),
            "--mixers-plot": ("a PNG image", is_png_file),
        },
        force=args.force,
    )
    if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
        raise ValueError(f"--json and --plot are both {args.json!r}; give them different paths")
    cfg = _load_model(args.model)
    hw = (
        measure_cpu(quick=args.quick)
        if args.hardware.lower() == "cpu"
        else get_hardware(args.hardware)
    )
    batches = _parse_batches(args.batch)
    plan = build_plan(
        cfg,
        hw,
        batches,
        args.seq,
        args.dtype,
        devices=args.devices,
        train_batch=args.train_batch,
        step_time_s=args.step_time,
    )
    _print_plan(plan)
    if args.scaling_law:
        _print_compute_optimal(cfg, hw, args)
    if args.json:
        atomic_write_text(args.json, json.dumps(plan, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        pts = []
        for d, p in zip(plan["decode"], plan["prefill"]):
            pts.append((f"decode B={d['B']}", d["intensity"]))
            pts.append((f"prefill B={p['B']}", p["intensity"]))
        plot_roofline(
            hw,
            pts,
            args.plot,
            plan["workload"]["dtype"],
            title=f"{cfg.name} on {hw.name}, S={args.seq}, {plan['workload']['dtype']}",
        )
        print(f"wrote {args.plot}")
    if args.mixers_plot:
        _print_mixer_cache(cfg, plan["workload"]["dtype"], args.local_window, args.mixers_plot)
    return 0


def _print_compute_optimal(cfg: ModelConfig, hw, args: argparse.Namespace) -> None:
    """One line from ``lmstack.scaling``: the tokens and FLOPs for which this N is compute-optimal."""
    p = optimal_for_params(param_counts(cfg).total, args.scaling_law)
    hours = p.C / (args.devices * hw.flops(args.dtype) * 0.4) / 3600
    loss = "" if p.loss != p.loss else f", predicted loss {p.loss:.3f}"
    print(
        f"compute-optimal ({p.law} law, lmstack scaling plan): N={p.N:.3g} params wants D={p.D:.3g} tokens "
        f"({p.tokens_per_param:.1f}/param), C=6ND={p.C:.3g} FLOPs{loss}; {hours:,.1f} h on {args.devices} x "
        f"{hw.name} at 40% MFU"
    )


def _print_plan(plan: dict) -> None:
    console = Console(width=None if os.isatty(1) else 150)
    m, hw, w, pc = plan["model"], plan["hardware"], plan["workload"], plan["params"]
    console.print(
        f"[bold]{m['name']}[/bold]  V={m['V']} D={m['D']} L={m['L']} N={m['N']} K={m['K']} (G={m['G']}) "
        f"H={m['H']} F={m['F']}{' tied' if m['tie_embeddings'] else ''}"
        f"{' W=' + str(m['sliding_window']) if m['sliding_window'] else ''}"
    )
    console.print(
        f"[bold]{hw['name']}[/bold]  {hw['peak_flops'] / 1e12:,.1f} TFLOP/s {w['dtype']}, "
        f"HBM {_gb(hw['hbm_bytes'])} at {hw['hbm_bandwidth'] / 1e12:.2f} TB/s, "
        f"ridge {hw['ridge_point']:.1f} FLOPs/byte  ({hw['source']})"
    )
    console.print(f"workload: S={w['S']}, {w['dtype']} ({w['bytes_per_element']} bytes/element)\n")

    t = Table(title="Parameters (Book of LLMs §1.4 “parameter count”)")
    columns = {k: k for k in ("embedding", "attention", "ffn", "norms", "unembedding", "total")}
    columns["CS336 notes Param"] = "seed001_param"  # header -> key of param_counts
    for c in columns:
        t.add_column(c, justify="right")
    t.add_row(*[f"{pc[k]:,}" for k in columns.values()])
    console.print(t)

    t = Table(
        title="Decoding roofline (CS336 notes 性能指标分析): latency = (Param + KV) / bandwidth"
    )
    for c in (
        "B",
        "num_params",
        "memory (bytes)",
        "latency (s)",
        "throughput (tok/s)",
        "compute (s)",
        "bound",
        "fits",
    ):
        t.add_column(c, justify="right")
    t.columns[-1].header = "fits (W+KV)"
    for d in plan["decode"]:
        t.add_row(
            str(d["B"]),
            f"{d['num_params']:,.0f}",
            f"{d['memory_bytes']:,.0f}",
            f"{d['latency_s']:.4f}",
            f"{d['throughput_tok_s']:.4f}",
            f"{d['compute_s']:.4f}",
            d["bound"],
            "yes" if d["fits"] else "NO",
        )
    console.print(t)

    t = Table(title="Prefill and time to first token")
    for c in ("B", "FLOPs", "compute (s)", "memory (s)", "bound", "TTFT (s)"):
        t.add_column(c, justify="right")
    for p in plan["prefill"]:
        t.add_row(
            str(p["B"]),
            f"{p['flops']:.3e}",
            f"{p['compute_s']:.4f}",
            f"{p['memory_s']:.4f}",
            p["bound"],
            f"{p['ttft_s']:.4f}",
        )
    console.print(t)

    t = Table(
        title="Inference memory (Book of LLMs §1.7 “inference memory”): weights + KV cache + peak activations"
    )
    for c in (
        "B",
        "weights",
        "KV cache",
        "act (FlashAttn)",
        "act (no FA)",
        "total (FA)",
        "total (no FA)",
        "fits",
    ):
        t.add_column(c, justify="right")
    for r in plan["inference_memory"]:
        fits = "yes" if r["fits_no_flash"] else ("FA only" if r["fits_flash"] else "NO")
        t.add_row(
            str(r["B"]),
            _gb(r["weights"]),
            _gb(r["kv_cache"]),
            _gb(r["activations_flash"]),
            _gb(r["activations_no_flash"]),
            _gb(r["total_flash"]),
            _gb(r["total_no_flash"]),
            fits,
        )
    console.print(t)
    kv = plan["kv_cache_variants_B1"]
    console.print(
        "KV cache per sequence (Book of LLMs §2.5 “shrinking the KV cache”): "
        + ", ".join(f"{k.upper()} {_gb(v)}" for k, v in kv.items())
    )

    t = Table(
        title=f"Arithmetic intensity (CS336 notes 计算强度分析), ridge {hw['ridge_point']:.1f} FLOPs/byte"
    )
    for c in ("B", "phase", "FFN I", "FFN", "attention I", "attention"):
        t.add_column(c, justify="right")
    for r in plan["intensity"]:
        for ph in ("prefill", "decode"):
            x = r[ph]
            t.add_row(
                str(r["B"]),
                f"{ph} (T={x['T']})",
                f"{x['ffn_intensity']:.1f}",
                x["ffn"],
                f"{x['attention_intensity']:.2f}",
                x["attention"],
            )
    console.print(t)

    f = plan["flops"]
    console.print(
        f"FLOPs per sequence (Book of LLMs §1.6 “forward and backward FLOPs”): forward {f['forward_per_sequence']:.3e}, training step "
        f"{f['training_step_per_sequence']:.3e}; 6ND {f['six_nd']:.3e} (exact/6ND = {f['ratio_exact_over_6nd']:.3f}); "
        "attention share by S: "
        + ", ".join(f"{s}: {v:.1%}" for s, v in f["attention_share"].items())
    )

    tr = plan["training_per_device"]
    t = Table(
        title=f"Training memory per device (Book of LLMs §1.8 “training memory”, §6.4-6.6): M={tr['M']}, global B={tr['B']}, "
        f"S={tr['S']}, FlashAttention"
    )
    for c in (
        "strategy",
        "master fp32",
        "bf16 copy",
        "AdamW",
        "grads",
        "activations",
        "total",
        "fits",
    ):
        t.add_column(c, justify="right")
    for name, r in tr["strategies"].items():
        t.add_row(
            name,
            _gb(r["master_weights"]),
            _gb(r["low_precision_weights"]),
            _gb(r["optimizer"]),
            _gb(r["gradients"]),
            _gb(r["activations"]),
            _gb(r["total"]),
            "yes" if r["fits"] else "NO",
        )
    console.print(t)
    if "mfu" in tr:
        console.print(
            f"MFU (CS336 notes 可用资源盘点): {tr['step_flops']:.3e} FLOPs per step in {tr['step_time_s']} s on "
            f"{tr['M']} devices = {tr['mfu']:.1%}"
        )

    c = plan["communication"]
    t = Table(
        title=f"Communication per training step (Book of LLMs §6.2 “collectives”, §6.4), M={c['M']}, bf16 gradients"
    )
    for col in ("strategy", "bytes sent / device", "time on NVLink (s)"):
        t.add_column(col, justify="right")
    for name, r in c["data_parallel"].items():
        t.add_row(
            name,
            _gb(r["bytes_sent_per_device"]),
            f"{r['time_s_nvlink']:.4f}" if "time_s_nvlink" in r else "-",
        )
    console.print(t)
    console.print(
        f"TP over M={c['M']} (CS336 notes 张量并行): compute/communication ratio 4h/tp = {c['tp_compute_comm_ratio']:.0f}; "
        f"{_gb(c['tp_layer_bytes_per_device'])} sent per layer per sequence (fwd + bwd)"
    )
    if "moe" in plan:  # mixture of experts / MLA
        e = plan["moe"]
        console.print(
            f"MoE / MLA (CS336 notes MoE, 有损提速): routed {e['routed']}, active {e['active']}, "
            f"shared {e['shared']}, "
            f"fine-grained {e['fine_grained_ratio']:.3g}, {e['moe_layers']} MoE layers; params total "
            f"{e['total_params'] / 1e9:,.2f}B, active {e['active_params'] / 1e9:,.2f}B; training FLOPs per token "
            f"6·N_active = {e['six_n_active_per_token']:.3e} (6·N_total {e['six_n_total_per_token']:.3e}); KV "
            f"{e['kv_bytes_per_token']:,.0f} bytes/token (MHA of the same heads: "
            f"{e['kv_bytes_per_token_gqa_equivalent']:,.0f}); EP={e['ep']} all-to-all "
            f"{_gb(e['all_to_all_bytes_per_step_per_device'])} per device per step"
        )


def _print_mixer_cache(cfg: ModelConfig, dtype: str, window: int, path: str) -> None:
    """CS336 notes "注意力机制": the O(n²) → O(n) argument in bytes — KV + state per sequence vs context."""
    contexts = [1 << k for k in range(10, 21, 2)]  # 1k .. 1M tokens
    table = cache_table(cfg, contexts, dtype, window)
    t = Table(title=f"KV + state per sequence ({dtype}) vs context S (accounting.mixers)")
    t.add_column("layers")
    for S in contexts:
        t.add_column(f"S={S:,}", justify="right")
    for name, ys in table.items():
        t.add_row(name, *[_gb(y) for y in ys])
    Console(width=None if os.isatty(1) else 150).print(t)
    plot_cache_vs_context(cfg, contexts, path, dtype, window)
    print(f"wrote {path}")
