"""MoE / MLA benchmark: lmstack's grouped MoE layer vs HF's ``MixtralSparseMoeBlock``; MLA decode absorbed vs expanded.

1. MoE layer forward + backward tokens/s, lmstack ``model.moe.MoE`` vs HF transformers'
   ``MixtralSparseMoeBlock`` built from the same MixtralConfig, with the same weights (copied across and
   checked equal first), on the same (T, D) input; timed in alternation after warm-up, every round printed,
   on the wall clock and on this process's CPU time (the steadier one on a shared machine); ratio
   lmstack / HF (> 1: lmstack faster), and the matmul rate each reaches (both do the same 18·T·k·D·F matmul
   FLOPs per step). lmstack is timed twice: as it runs (CPU fp32: expert GEMMs by this CPU's policy, ``ops.gemm``) and with its
   expert matmuls through ``F.linear`` (torch's BLAS, what HF uses) — the same BLAS on both sides. ``--profile``: torch.profiler's top operators of one lmstack step.
2. MLA decode step at S keys (B = 1): the absorbed form (one latent cache of d_c + d_R per token, W_UK in
   the query, W_UV on the output) vs the expanded form (per-head K and V cached, N·(H_n + d_R + H_v) per
   token): time per step and KV bytes per token and layer.

3. ``--plot-runs RUN... --out PNG``: CPU training runs (configs/dense_small.toml, configs/moe_small.toml,
   configs/moe_top1.toml with and without balancing): loss curves on one plot, the expert load (max/mean over
   experts, 1 = balanced), the share of experts getting < 1 % of their layer's tokens, and each expert's share
   of the routed tokens over the steps; a summary line per run (the numbers in docs/moe.md).

  .venv/bin/python benchmarks/moe.py                  # defaults below, CPU
  .venv/bin/python benchmarks/moe.py --tokens 4096 --experts 16 --top-k 4
  .venv/bin/python benchmarks/moe.py --plot-runs runs/dense_small runs/moe_small runs/moe_nobal --out docs/moe_train.png
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _times(fns: dict, rounds: int, warmup: int = 2) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of each fn, called in alternation (so machine load hits all alike), after warm-up, on
    two clocks: "wall" and "cpu" (this process's CPU seconds — on a shared machine with one thread, the time the
    work took while it ran, not the time it waited for a core). -> {clock: {name: [seconds per round]}}"""
    times: dict[str, dict[str, list[float]]] = {
        "wall": {k: [] for k in fns},
        "cpu": {k: [] for k in fns},
    }
    for i in range(warmup + rounds):
        for name, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            if i >= warmup:
                times["wall"][name].append(time.perf_counter() - t)
                times["cpu"][name].append(time.process_time() - c)
    return times


def _median_time(fns: dict, rounds: int, warmup: int = 2) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in _times(fns, rounds, warmup)["wall"].items()}


def bench_moe(args) -> None:
    import transformers

    from lmstack.model.moe import MoE
    from lmstack.ops import gemm

    D, Fe, E, k, T = args.d_model, args.d_ff, args.experts, args.top_k, args.tokens
    torch.manual_seed(0)
    hf_cfg = transformers.MixtralConfig(
        hidden_size=D,
        intermediate_size=Fe,
        num_local_experts=E,
        num_experts_per_tok=k,
        router_jitter_noise=0.0,
    )
    hf = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(hf_cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
    ours = MoE(D, E, k, Fe, norm_topk=True)  # Mixtral: softmax -> top-k -> renormalise
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        gate_up = hf.experts.gate_up_proj  # (E, 2F, D): [gate; up]
        ours.gate_proj.weight.copy_(gate_up[:, :Fe])
        ours.up_proj.weight.copy_(gate_up[:, Fe:])
        ours.down_proj.weight.copy_(hf.experts.down_proj)  # (E, D, F)
    x = torch.randn(1, T, D)
    with torch.no_grad():
        diff = (ours(x) - hf(x)).abs().max().item()
    print(
        f"MoE layer: D={D} F_e={Fe} E={E} k={k} T={T}, threads={torch.get_num_threads()}; "
        f"max |lmstack - HF| = {diff:.2e}"
    )
    assert diff < 1e-4, diff
    g = torch.randn(1, T, D)

    def step(model):
        xi = x.clone().requires_grad_(True)
        (model(xi) * g).sum().backward()
        model.zero_grad(set_to_none=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        step(ours)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(ours)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

    def step_blas(
        model,
    ):  # lmstack's expert matmuls through torch's BLAS (F.linear) instead of oneDNN
        saved = gemm.set_gemm(gemm.BLAS_ONLY)
        try:
            step(model)
        finally:
            gemm.set_gemm(saved)

    fns = {
        "lmstack": lambda: step(ours),
        "lmstack_F.linear": lambda: step_blas(ours),
        "hf": lambda: step(hf),
    }
    for clock, ts in _times(fns, args.rounds).items():
        for name, v in ts.items():
            print(
                f"  {clock:4s} {name:17s} ms/step per round: {' '.join(f'{x * 1e3:.0f}' for x in v)}"
            )
        t = {name: statistics.median(v) for name, v in ts.items()}
        ratios = [h / o for h, o in zip(ts["hf"], ts["lmstack"])]
        flops = 18 * T * k * D * Fe  # fwd 3 matmuls of 2·(T·k)·D·F, backward twice that
        print(
            f"  {clock} time: matmul rate lmstack {flops / t['lmstack'] / 1e9:.0f} GFLOP/s (with F.linear "
            f"{flops / t['lmstack_F.linear'] / 1e9:.0f}), "
            f"HF {flops / t['hf'] / 1e9:.0f} GFLOP/s ({flops / 1e9:.1f} GFLOP of matmuls per step)"
        )
        print(
            f"  {clock} time, medians: lmstack {T / t['lmstack']:,.0f} tok/s ({t['lmstack'] * 1e3:.0f} ms/step), "
            f"lmstack with F.linear {T / t['lmstack_F.linear']:,.0f} tok/s, HF MixtralSparseMoeBlock "
            f"{T / t['hf']:,.0f} tok/s; ratio lmstack/HF = {t['hf'] / t['lmstack']:.2f}x "
            f"(per round {min(ratios):.2f}–{max(ratios):.2f}x), with F.linear {t['hf'] / t['lmstack_F.linear']:.2f}x"
        )


def bench_mla(args) -> None:
    from lmstack.model.config import ModelConfig
    from lmstack.model.mla import MLA, FoldHeads
    from lmstack.model.seam import SDPAAttention

    # DeepSeek-V2-Lite's attention shapes: D = 2048, N = 16, d_c = 512, d_R = 64, H_n = H_v = 128
    c = ModelConfig(
        vocab_size=64,
        d_model=2048,
        n_layers=1,
        n_heads=16,
        d_ff=64,
        head_dim=192,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_layout="interleaved",
        max_seq_len=8192,
    )
    torch.manual_seed(0)
    mla = MLA(c).eval()
    sdpa = SDPAAttention()
    N, dc, dr, hn, hv = 16, 512, 64, 128, 128
    print(
        f"MLA decode step (B=1, DeepSeek-V2-Lite attention: N={N}, d_c={dc}, d_R={dr}, H_n={hn}, H_v={hv})"
    )
    for S in args.mla_seq:
        x = torch.randn(1, 1, 2048)
        pos = torch.tensor([S - 1])
        with torch.no_grad():
            ctx = torch.randn(1, S, 2048)
            c_all, k_rope_all = mla.latent(ctx, torch.arange(S))  # (1, S, d_c), (1, 1, S, d_R)
            latent = torch.cat(
                [c_all[:, None], k_rope_all], dim=-1
            )  # (1, 1, S, d_c + d_R): the MLA cache
            kv = mla.kv_b_proj(c_all).view(1, S, N, hn + hv).transpose(1, 2)
            k_exp = torch.cat(
                [kv[..., :hn], k_rope_all.expand(-1, N, -1, -1)], dim=-1
            ).contiguous()  # (1,N,S,192)
            v_exp = kv[..., hn:].contiguous()  # (1, N, S, 128): the expanded cache

        from lmstack.model.seam import AttentionMetadata

        meta = AttentionMetadata(pos, key_positions=torch.arange(S))

        def absorbed():
            with torch.no_grad():
                qn, qr = mla.queries(x, pos)  # noqa: B023
                o = FoldHeads(sdpa)(mla.absorbed_query(qn, qr), latent, latent[..., :dc], meta)  # noqa: B023
                return mla.o_proj(mla.absorbed_output(o).transpose(1, 2).reshape(1, 1, -1))

        def expanded():
            with torch.no_grad():
                qn, qr = mla.queries(x, pos)  # noqa: B023
                o = sdpa(torch.cat([qn, qr], dim=-1), k_exp, v_exp, meta)  # noqa: B023
                return mla.o_proj(o.transpose(1, 2).reshape(1, 1, -1))

        diff = (absorbed() - expanded()).abs().max().item()
        t = _median_time({"absorbed": absorbed, "expanded": expanded}, args.rounds * 5)
        b_abs, b_exp = (dc + dr) * 2, N * (hn + dr + hv) * 2
        print(
            f"  S={S}: absorbed {t['absorbed'] * 1e3:.2f} ms, expanded {t['expanded'] * 1e3:.2f} ms "
            f"(ratio {t['expanded'] / t['absorbed']:.2f}x); KV bytes/token/layer bf16: {b_abs} vs {b_exp} "
            f"({b_exp / b_abs:.1f}x smaller); max |diff| = {diff:.1e}"
        )


def _rows(run: str, kind: str = "train") -> list[dict]:
    import json
    from pathlib import Path

    rows = [
        json.loads(line)
        for line in (Path(run) / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return [r for r in rows if r.get("kind") == kind]


def plot_runs(runs: list[str], out: str) -> None:
    """Loss curves of the runs on one axis; expert load balance, experts starved (< 1 % of their layer's
    assignments) and per-expert shares of the MoE runs; prints each run's final figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lmstack.utils import atomic_path

    moe_runs = [r for r in runs if "moe_load_0" in (_rows(r) or [{}])[-1]]
    cols = max(3, len(moe_runs))
    fig, grid = plt.subplots(
        2 if moe_runs else 1, cols, figsize=(5 * cols, 8 if moe_runs else 4), squeeze=False
    )
    axes = list(grid[0]) + list(grid[1] if moe_runs else [])
    for ax in axes[3:cols]:
        ax.set_visible(False)
    for run in runs:
        tr, ev = _rows(run), _rows(run, "eval")
        axes[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], label=run)
        last = ev[-1]["val_loss"] if ev else float("nan")
        line = f"{run}: final train loss {tr[-1]['loss']:.3f}, val loss {last:.3f}"
        if run in moe_runs:
            tail = tr[-10:]  # the last 10 logged steps, to smooth one batch's noise
            mean = lambda key: sum(r.get(key, float("nan")) for r in tail) / len(tail)  # noqa: B023, E731
            line += (
                f"; over the last {len(tail)} logs: max/mean load {mean('moe_load_max_over_mean'):.2f}, "
                f"experts < 1 % {mean('moe_experts_below_1pct'):.1%}, dead {mean('moe_experts_dead'):.1%}"
            )
        print(line)
    axes[0].set(
        xlabel="step", ylabel="train loss", title="loss (equal active params, equal tokens)"
    )
    axes[0].legend(fontsize=7)
    for run in moe_runs:
        tr = _rows(run)
        steps = [r["step"] for r in tr]
        axes[1].plot(steps, [r["moe_load_max_over_mean"] for r in tr], label=run)
        if "moe_experts_below_1pct" in tr[-1]:
            axes[2].plot(steps, [r["moe_experts_below_1pct"] for r in tr], label=run)
    axes[1].axhline(1.0, color="grey", lw=0.5)
    axes[1].set(
        xlabel="step",
        ylabel="max / mean expert load (mean over layers)",
        title="balance",
        yscale="log",
    )
    axes[1].legend(fontsize=7)
    axes[2].set(
        xlabel="step",
        ylabel="fraction of (layer, expert) pairs",
        title="experts getting < 1 % of tokens",
        ylim=(0, 1),
    )
    axes[2].legend(fontsize=7)
    for ax, run in zip(axes[cols:], moe_runs):
        tr = _rows(run)
        E = sum(1 for k in tr[0] if k.startswith("moe_load_") and k[9:].isdigit())
        loads = [[r[f"moe_load_{i}"] for i in range(E)] for r in tr]
        shares = [[x / max(sum(row), 1) for x in row] for row in loads]
        ax.stackplot([r["step"] for r in tr], list(zip(*shares)))
        ax.set(
            xlabel="step",
            ylabel="share of routed tokens (all layers)",
            title=f"{run}: experts",
            ylim=(0, 1),
        )
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mla-seq", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--profile", action="store_true", help="print torch.profiler's top operators of one step"
    )
    ap.add_argument("--skip-mla", action="store_true", help="only the MoE layer benchmark")
    ap.add_argument(
        "--plot-runs", nargs="+", metavar="RUN_DIR", help="plot these training runs and exit"
    )
    ap.add_argument("--out", default="docs/moe_train.png")
    args = ap.parse_args()
    if args.plot_runs:
        plot_runs(args.plot_runs, args.out)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_moe(args)
    if not args.skip_mla:
        bench_mla(args)


if __name__ == "__main__":
    main()
