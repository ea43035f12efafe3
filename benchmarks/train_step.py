"""Training-step benchmark: lmstack's Trainer step vs HF transformers' LlamaForCausalLM, same config.

Both run forward + loss + backward + AdamW step on the same (B, S) token batch, same dtype mode
(bf16 autocast with fp32 master weights, or plain fp32), same threads, on this machine. The two
are timed in alternation (lmstack step, HF step, ...) so a change in machine load hits both; we
report medians after warm-up, the tokens/s ratio lmstack/HF (> 1: lmstack faster), and MFU =
model FLOPs per step (lmstack.accounting, Book of LLMs §1.6 “forward and backward FLOPs”: 3 x forward) / step time / the measured
matmul peak of this machine in that dtype (measure_cpu; CS336 notes "工程细节/基准测试": warm up,
time with a monotonic clock, synchronise CUDA before reading it).

  .venv/bin/python benchmarks/train_step.py                      # the demo's model, bf16 and fp32
  .venv/bin/python benchmarks/train_step.py --d-model 512 --layers 8 --precision bf16
  .venv/bin/python benchmarks/train_step.py --compile            # + torch.compile'd lmstack and HF
  .venv/bin/python benchmarks/train_step.py --ab-attn sdpa        # in-process A/B of lmstack's attention

HF is timed with three optimizers, each on its own copy of the same model: ``torch.optim.AdamW``
as constructed by default (on CPU: the per-tensor for-loop), with ``foreach=True`` (multi-tensor,
what lmstack's AdamW does) and with ``fused=True`` where this torch has it. The ratio against
each separates what lmstack's model code and fused loss buy from what the optimizer buys.

``--ab-attn BACKEND`` adds a second lmstack row, "lmstack@BACKEND": the *same* lmstack model and
optimizer with ``set_attention`` of BACKEND's implementation for its step and the default one back for
the next, stepped in the same rounds as the others — an A/B of one change inside one process, which
machine-load swings between separate runs would drown.

lmstack's step is the Trainer's: forward to the final hidden states, then the block-wise
unembedding + cross-entropy (lmstack.train.losses.linear_cross_entropy; ``--no-fused-loss``
materialises the logits instead), AdamW. The aim (lmstack >= 1.5x HF) is judged eager vs eager
(TrainConfig's default, compile = false); ``--compile`` adds compiled lmstack vs eager HF and
compiled lmstack vs compiled HF.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import platform
import statistics
import time
import timeit

import torch


def build(args):
    import transformers

    from lmstack.model import ModelConfig
    from lmstack.model.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        d_ff=args.d_ff,
        max_seq_len=max(args.seq, 128),
        tie_embeddings=True,
        rope_theta=10000.0,
        norm_eps=1e-5,
    )
    ours = Transformer(cfg, seed=0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.d_ff,
        max_position_embeddings=max(args.seq, 128),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attn_implementation="eager" if args.attn == "eager" else "sdpa",
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    return cfg, ours, hf


def cpu_clock_peak(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    """Matmul FLOP/s per process CPU-second (robust to other jobs; equals wall-clock peak when idle)."""
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        torch.mm(a, b)
        times.append(time.process_time() - t0)
    return 2 * n**3 / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=688)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32", "both"],
        default="auto",
        help="auto (default): what the Trainer would choose on this CPU (lmstack.cpu.choose_precision: "
        "bf16 only where it is native and faster); both: bf16 then fp32 (bf16 is skipped, with the "
        "reason, on a CPU that would only emulate it — an emulated bf16 step takes minutes)",
    )
    ap.add_argument(
        "--attn",
        choices=["auto", "sdpa", "eager"],
        default="auto",
        help="auto = lmstack's default attn_backend (what the Trainer runs; lmstack.kernels.backends picks "
        "per device/autocast/grad) vs HF sdpa; sdpa = F.scaled_dot_product_attention for both; "
        "eager = explicit softmax(QKᵀ)V (lmstack attn_backend='reference', HF attn_implementation='eager')",
    )
    ap.add_argument(
        "--no-fused-loss",
        dest="fused_loss",
        action="store_false",
        help="lmstack: materialise the logits and call cross_entropy (TrainConfig fused_loss=false)",
    )
    ap.add_argument(
        "--ab-attn",
        default=None,
        choices=["sdpa", "matmul", "reference", "flash_pytorch"],
        help="also time the same lmstack model with this attention backend, alternating every step",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile'd lmstack and HF models (compiling takes minutes on one thread)",
    )
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: timeit.default_timer; cpu: process CPU time (robust when other jobs share the machine)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from lmstack.accounting import measure_cpu, training_step_flops
    from lmstack.kernels.backends import attention_impl, choose_attention
    from lmstack.train import AdamW, cross_entropy
    from lmstack.train.losses import linear_cross_entropy

    cfg, ours, hf = build(args)
    B, S = args.batch, args.seq
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, args.vocab, (B, S + 1), generator=g)
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    opt_ours = AdamW(ours.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    hf_kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    hf_models = {"hf": hf, "hf+foreach": copy.deepcopy(hf)}  # same weights, an optimizer each
    hf_opts = {
        "hf": torch.optim.AdamW(hf.parameters(), **hf_kw),  # torch's default: for-loop on CPU
        "hf+foreach": torch.optim.AdamW(
            hf_models["hf+foreach"].parameters(), foreach=True, **hf_kw
        ),
    }
    try:
        fused_model = copy.deepcopy(hf)
        hf_opts["hf+fused"] = torch.optim.AdamW(fused_model.parameters(), fused=True, **hf_kw)
        hf_models["hf+fused"] = fused_model
    except (RuntimeError, TypeError) as e:  # fused AdamW needs a newer torch on CPU
        print(
            f"torch.optim.AdamW(fused=True) is not available here ({str(e).splitlines()[0][:100]})"
        )
    flops = training_step_flops(cfg, B, S)
    from lmstack.cpu import choose_precision, cpu_features

    print(f"CPU: {cpu_features().summary()}")
    if args.precision == "both":
        precisions = ["bf16", "fp32"]
        if not cpu_features().native_bf16:
            print(
                "bf16 skipped: this CPU has no native bf16 matmul (AVX512_BF16, AMX or ARM BF16); torch would "
                "emulate it (pass --precision bf16 to time it anyway)"
            )
            precisions = ["fp32"]
    elif args.precision == "auto":
        choice = choose_precision("auto", "cpu")
        print(choice.line())
        precisions = [choice.precision]
    else:
        precisions = [args.precision]
    if args.clock == "wall":
        hw = measure_cpu(dtypes=tuple(precisions))
        peak = {p: hw.flops(p) for p in precisions}
    else:  # the same 2n³ / median time of an (n, n) @ (n, n) matmul, timed with the process CPU clock
        peak = {p: cpu_clock_peak(p) for p in precisions}
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.clock} clock; measured matmul peak "
        + ", ".join(f"{p} {peak[p] / 1e9:.0f} GFLOP/s" for p in precisions)
    )
    print(
        f"model: V={cfg.vocab_size} D={cfg.d_model} L={cfg.n_layers} N={cfg.n_heads} K={cfg.n_kv_heads} "
        f"F={cfg.d_ff}, {ours.num_params():,} params, {args.attn} attention; batch B={B} S={S} ({B * S} tokens/step); "
        f"{flops / 1e9:.1f} GFLOP/step"
    )

    models = {"lmstack": ours, **hf_models}
    if args.ab_attn:
        models[f"lmstack@{args.ab_attn}"] = ours  # the same model and optimizer, another attention
    if (
        args.compile
    ):  # same parameters and optimizers, compiled graphs (what TrainConfig compile=true does)
        models["lmstack+compile"] = torch.compile(ours)
        models["hf+compile"] = torch.compile(hf)
        hf_opts["hf+compile"] = hf_opts["hf"]

    for prec in precisions:
        ac = (
            (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
            if prec == "bf16"
            else contextlib.nullcontext
        )

        # each lmstack row's attention, decided once as the Trainer does (kernels.backends.choose_attention)
        attn = {"auto": "auto", "sdpa": "sdpa", "eager": "reference"}[
            args.attn
        ]  # RuntimeConfig.attn_backend
        autocast = "bf16" if prec == "bf16" else None
        impls = {
            k: attention_impl(
                choose_attention(
                    k.partition("@")[2] or attn, "cpu", autocast, k.endswith("compile"), S
                )[0]
            )
            for k in models
        }
        print(
            f"  [{prec}] attention: "
            + ", ".join(f"{k} {v.name}" for k, v in impls.items() if k.startswith("lmstack"))
        )

        def step_ours(model, key):  # what Trainer.forward_loss + train_step do
            ours.set_attention(impls[key])  # noqa: B023
            with ac():  # noqa: B023
                if args.fused_loss:
                    h = model(x, return_hidden=True)  # (B, S, D)
                    ce, z = linear_cross_entropy(h, ours.unembedding, y)
                else:
                    logits = model(x)
            if not args.fused_loss:
                ce, z = cross_entropy(logits, y)
            (ce + z).backward()
            opt_ours.step()
            opt_ours.zero_grad(set_to_none=True)

        def step_hf(model, opt):
            with ac():  # noqa: B023
                out = model(input_ids=x, labels=None)
            # HF's own loss on the same targets (labels already shifted): ForCausalLMLoss upcasts and uses F.cross_entropy
            loss = hf.loss_function(out.logits, labels=None, vocab_size=args.vocab, shift_labels=y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps = {
            k: (
                functools.partial(step_ours, m, k)
                if k.startswith("lmstack")
                else functools.partial(step_hf, m, hf_opts[k])
            )
            for k, m in models.items()
        }
        for k in [k for k in steps if k.endswith("compile")]:
            t0 = timeit.default_timer()
            try:
                steps[k]()  # compiles (forward and backward graphs) for this precision
                print(f"  [{prec}] {k}: compiled in {timeit.default_timer() - t0:.0f} s")
            except Exception as e:  # report, time the rest
                print(
                    f"  [{prec}] {k}: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                )
                del steps[k]
        clock = timeit.default_timer if args.clock == "wall" else time.process_time
        times = {k: [] for k in steps}
        for i in range(args.warmup + args.repeats):
            for (
                name,
                fn,
            ) in steps.items():  # interleaved: lmstack, hf, lmstack+compile, hf+compile, ...
                t0 = clock()
                fn()
                dt = clock() - t0
                if i >= args.warmup:
                    times[name].append(dt)
        med = {k: statistics.median(v) for k, v in times.items()}
        tps = {k: B * S / v for k, v in med.items()}
        mfu = {k: flops / v / peak[prec] for k, v in med.items()}
        print(
            f"[{prec}{' autocast, fp32 master weights' if prec == 'bf16' else ''}] "
            + " | ".join(
                f"{k} {med[k] * 1e3:.0f} ms/step {tps[k]:,.0f} tok/s MFU {mfu[k]:.1%}" for k in med
            )
        )
        ratios = [
            ("eager lmstack / eager HF (default AdamW)", "lmstack", "hf"),
            ("eager lmstack / eager HF (AdamW foreach)", "lmstack", "hf+foreach"),
            ("eager lmstack / eager HF (AdamW fused)", "lmstack", "hf+fused"),
            (f"lmstack / lmstack@{args.ab_attn}", "lmstack", f"lmstack@{args.ab_attn}"),
            ("compiled lmstack / eager HF", "lmstack+compile", "hf"),
            ("compiled lmstack / compiled HF", "lmstack+compile", "hf+compile"),
        ]
        print(
            f"[{prec}] tokens/s ratio "
            + ", ".join(
                f"{label} = {tps[a] / tps[b]:.2f}x"
                for label, a, b in ratios
                if a in tps and b in tps
            )
        )


if __name__ == "__main__":
    main()
