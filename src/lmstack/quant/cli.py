"""``lmstack compress``: width-prune a model by activation importance, distil it from the original, save it.

    lmstack compress --model smollm2-135m --d-ff 1024 --n-kv-heads 2 --distill-steps 50 --out smol-pruned
    lmstack compress --model runs/demo --d-ff 256 --out runs/demo-pruned

Calibration / distillation / evaluation text: ``--text FILE`` (default: the running Python's
standard-library sources, the demo's corpus); rows of ``--seq`` tokens: the first ``--calib-rows``
calibrate the pruning, the next ``--eval-rows`` are held out for the perplexities, and distillation
cycles through ``--distill-rows`` rows (default: the calibration rows; more are taken from after the
held-out ones). Prints parameters, perplexity of the original, the pruned and the distilled model
(also every ``--eval-every`` steps), batch-1 greedy decode tok/s of the original and the result
(``--speed-tokens``), and writes an lmstack checkpoint (config.json + model.safetensors) to ``--out``
with ``compress.json`` (the figures) and ``distill.png`` (loss and held-out perplexity per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from lmstack.eval.perplexity import perplexity
from lmstack.inference.loader import add_model_arguments
from lmstack.model.io import load_model, save_pretrained
from lmstack.quant.prune import distill, prune_width
from lmstack.threads import add_threads_argument, set_threads
from lmstack.tokenizer import load_tokenizer
from lmstack.utils import (
    atomic_write_text,
    check_outputs,
    finite_float,
    nonneg_int,
    own_folder,
    positive_int,
    pyplot,
    save_png,
    stdlib_root,
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compress",
        help="width pruning by activation importance + logit distillation",
        description=__doc__.split("\n")[0] + ' (CS336 notes "有损提速"; Minitron).',
    )
    add_model_arguments(
        p,
        model=None,
        model_help="smollm2-135m, a GGUF file or an lmstack checkpoint directory",
        tokenizer=False,
        dtype=None,
    )
    p.add_argument("--out", required=True, help="directory for the pruned checkpoint")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into --out even when it holds something other than an earlier compress output",
    )
    p.add_argument(
        "--d-ff", type=positive_int, default=None, help="FFN width F to keep (default: unchanged)"
    )
    p.add_argument(
        "--n-kv-heads",
        type=positive_int,
        default=None,
        help="KV groups K to keep, with their query heads",
    )
    p.add_argument(
        "--d-model", type=positive_int, default=None, help="embedding channels D to keep"
    )
    p.add_argument(
        "--text",
        default=None,
        help="calibration/distillation/eval text file (default: stdlib sources)",
    )
    p.add_argument("--seq", type=positive_int, default=256)
    p.add_argument("--calib-rows", type=positive_int, default=16)
    p.add_argument("--eval-rows", type=positive_int, default=4)
    p.add_argument("--distill-steps", type=nonneg_int, default=0)
    p.add_argument(
        "--distill-rows",
        type=positive_int,
        default=None,
        help="rows distillation cycles through (default: the --calib-rows; extra ones follow the held-out rows)",
    )
    p.add_argument(
        "--eval-every",
        type=nonneg_int,
        default=0,
        help="held-out perplexity every N distillation steps (0: end only)",
    )
    p.add_argument(
        "--speed-tokens",
        type=nonneg_int,
        default=32,
        help="new tokens per batch-1 greedy decode timing of the original and the result (0: skip)",
    )
    p.add_argument("--lr", type=finite_float, default=3e-4)
    p.add_argument("--temperature", type=finite_float, default=1.0)
    add_threads_argument(p)
    p.set_defaults(func=run_compress)


def _text(path: str | None) -> str:
    if path:
        return Path(path).read_text(errors="ignore")
    lib = stdlib_root()
    return "".join(f.read_text(errors="ignore") for f in sorted(lib.glob("*.py"))[:60])


def _ppl(model, rows) -> float:
    """Perplexity over rows (k, S), each scored on its own (tokens 1..S-1 from the ones before): eval's
    sliding windows with stride = window = S."""
    S = rows.shape[1]
    return perplexity(model, rows.reshape(-1), max_length=S, stride=S, progress=False).perplexity


@torch.inference_mode()
def _decode_speed(model, prompt: list[int], n_new: int, repeats: int = 3) -> float:
    """Median tok/s of batch-1 greedy ``generate`` (contiguous KV cache, eager) over ``repeats`` runs."""
    from lmstack.inference.generate import (
        generate,
    )  # a command may time the engine (pyproject: layers' ignore)
    from lmstack.inference.sampling import SamplingParams

    list(generate(model, prompt, SamplingParams(temperature=0, max_tokens=4)))  # warm-up
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = sum(
            1
            for _ in generate(
                model, prompt, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
            )
        )
        runs.append(n / (time.perf_counter() - t))
    return statistics.median(runs)


def _plot(
    path: Path, losses: list[float], evals: list[tuple[int, float]], teacher_ppl: float, title: str
) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(
        range(1, len(losses) + 1), losses, lw=1.2, label="distillation loss T²·KL (training batch)"
    )
    ax.set_xlabel("distillation step")
    ax.set_ylabel("T²·KL (nats/token)")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(*zip(*evals), "o-", color="C1", ms=4, label="held-out perplexity")
    ax2.axhline(teacher_ppl, color="gray", ls="--", lw=1, label=f"teacher {teacher_ppl:.2f}")
    ax2.set_yscale("log")
    ax2.set_ylabel("held-out perplexity")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path)


def run_compress(args: argparse.Namespace) -> int:
    check_outputs(
        [("--out", args.out)],
        [("--model", args.model), ("--text", args.text)],
        {
            "--out": (
                "an empty folder or an earlier `lmstack compress` output (one with compress.json)",
                lambda p: own_folder(p, "compress.json"),
            )
        },
        force=args.force,
    )
    set_threads(args.threads)
    lm = load_model(args.model)
    teacher = lm.model.eval()
    ids = load_tokenizer(lm.source).encode(_text(args.text))
    c, e = args.calib_rows, args.eval_rows
    avail = len(ids) // args.seq
    if avail <= e:
        raise ValueError(
            f"the text gives {len(ids)} tokens: fewer than {e + 1} rows of --seq {args.seq} "
            f"(--eval-rows {e} + at least one to calibrate)"
        )
    c = min(c, avail - e)  # a short text calibrates on what is left before the held-out rows
    d = c if args.distill_rows is None else args.distill_rows
    if d > c and avail < c + e + (d - c):
        raise ValueError(
            f"the text gives {avail} rows of --seq {args.seq}: fewer than --distill-rows {d} + --eval-rows {e}"
        )
    rows = torch.tensor(ids[: avail * args.seq]).view(avail, args.seq)
    calib, held = rows[:c], rows[c : c + e]
    train = calib[:d] if d <= c else torch.cat([calib, rows[c + e : c + e + d - c]])
    student = prune_width(teacher, calib, args.d_ff, args.n_kv_heads, args.d_model)
    before, pruned = _ppl(teacher, held), _ppl(student, held)
    evals = [(0, pruned)]

    def on_step(step: int, loss: float) -> None:
        if args.eval_every and step % args.eval_every == 0 and step != args.distill_steps:
            evals.append((step, _ppl(student, held)))
            tqdm.write(f"step {step}: loss {loss:.3f}, held-out perplexity {evals[-1][1]:.2f}")

    losses = []
    t0 = time.perf_counter()
    if args.distill_steps:
        losses = distill(
            student, teacher, train, args.distill_steps, args.lr, args.temperature, on_step=on_step
        )
        evals.append((args.distill_steps, _ppl(student, held)))
    distill_s = time.perf_counter() - t0
    after = evals[-1][1]
    p_t = sum(p.numel() for p in teacher.parameters())
    p_s = sum(p.numel() for p in student.parameters())
    print(
        f"parameters {p_t / 1e6:.1f}M -> {p_s / 1e6:.1f}M; "
        f"held-out perplexity {before:.2f} -> pruned {pruned:.2f} -> distilled ({args.distill_steps} steps) {after:.2f}"
    )
    report = dict(
        model=args.model,
        d_ff=student.config.d_ff,
        n_kv_heads=student.config.n_kv_heads,
        d_model=student.config.d_model,
        params_before=p_t,
        params_after=p_s,
        seq=args.seq,
        calib_rows=c,
        eval_rows=e,
        distill_rows=d,
        distill_steps=args.distill_steps,
        lr=args.lr,
        temperature=args.temperature,
        distill_seconds=round(distill_s, 1),
        ppl_teacher=before,
        ppl_pruned=pruned,
        ppl_distilled=after,
        held_out_ppl=evals,
        losses=losses,
    )
    save_pretrained(
        student, args.out
    )  # the distilled model first: nothing after it can lose the run
    out = Path(args.out)
    atomic_write_text(out / "compress.json", json.dumps(report, indent=1) + "\n")
    if args.speed_tokens:
        prompt = held[0, :16].tolist()
        report["decode_tok_s_before"] = _decode_speed(teacher, prompt, args.speed_tokens)
        report["decode_tok_s_after"] = _decode_speed(student, prompt, args.speed_tokens)
        print(
            f"batch-1 greedy generation (16-token prompt + {args.speed_tokens} tokens, eager, "
            f"{torch.get_num_threads()} thread(s)): "
            f"{report['decode_tok_s_before']:.1f} -> {report['decode_tok_s_after']:.1f} tok/s"
        )
        atomic_write_text(out / "compress.json", json.dumps(report, indent=1) + "\n")
    if losses:
        _plot(
            out / "distill.png",
            losses,
            evals,
            before,
            f"{args.model}: {p_t / 1e6:.1f}M -> {p_s / 1e6:.1f}M parameters, {d} rows × {args.seq} tokens, lr {args.lr}",
        )
    print(
        f"wrote {args.out}/config.json, model.safetensors, compress.json{', distill.png' if losses else ''} "
        f"(tokenizer: the original model's)"
    )
    return 0
