"""The seed's claim on the default corpus: validation loss of full attention, pure linear attention, Gated DeltaNet
and a 3:1 Gated-DeltaNet:full hybrid trained on the same tokens with (nearly) the same parameters.

CS336 notes "注意力机制" (linear mixers trade exact recall for an O(1) state; a 3:1 hybrid keeps most of full
attention's quality). The data is `lmstack demo`'s: the Python standard library's .py files, a 4096-token BPE,
the last 5 % held out (docs/training.md). Every model is the demo's shape (D=192, L=4, N=4, K=2, tied embeddings)
with its d_ff chosen so that its parameter count matches full attention's within one FFN row step; each trains
with the same seed, batches, AdamW and cosine schedule for ``--steps`` steps, evaluating every ``--eval-every``
steps on the same validation windows; recurrent layers start from ``init_recurrent_parameters``.

    nice -n 10 python benchmarks/attention_corpus.py --data-dir runs/demo --steps 300 --out docs/attention_corpus

``--data-dir`` holds `lmstack demo`'s tokenizer.json and tokens.bin (made there when missing, as the demo makes
them). Writes OUT.json (per-model eval curve, params, tokens/s) and OUT.png (validation loss vs step).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lmstack.accounting.mixers import model_params
from lmstack.demo import SEP, collect_corpus
from lmstack.model.config import ModelConfig, repeat_pattern
from lmstack.model.mixers import init_recurrent_parameters
from lmstack.tokenizer import Tokenizer, encode_files, load_tokenizer, save, train_bpe
from lmstack.train import TrainConfig, Trainer
from lmstack.utils import atomic_path, atomic_write_text

VARIANTS = {
    "full attention": ["attention"],
    "linear attention": ["linear_attention"],
    "gated deltanet": ["gated_deltanet"],
    "3:1 deltanet:full": ["gated_deltanet"] * 3 + ["attention"],
}
SHAPE = dict(
    d_model=192, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512, max_seq_len=512, tie_embeddings=True
)


def demo_data(data_dir: Path) -> tuple[Path, Path]:
    """tokenizer.json and tokens.bin of `lmstack demo` (built like the demo when absent)."""
    tok_path, tokens_path = data_dir / "tokenizer.json", data_dir / "tokens.bin"
    if not (tok_path.exists() and tokens_path.exists()):
        data_dir.mkdir(parents=True, exist_ok=True)
        corpus = data_dir / "corpus.txt"
        collect_corpus([], "*.py", 6.0, corpus)
        vocab, merges = train_bpe(corpus, 4096, [SEP], "gpt2", progress=True)
        tok = Tokenizer(vocab, merges, [SEP], pattern="gpt2")
        tok.eos_token_id = tok.special_tokens[SEP]
        save(tok, tok_path)
        encode_files(tok, [corpus], tokens_path, progress=True)
    return tok_path, tokens_path


def matched_d_ff(unit: list[str], vocab_size: int, target: int) -> int:
    """The d_ff (a multiple of 8) whose model has the parameter count closest to ``target``."""

    def params(d_ff):
        layers = repeat_pattern(unit, SHAPE["n_layers"])
        return model_params(
            ModelConfig(**{**SHAPE, "d_ff": d_ff}, vocab_size=vocab_size, layer_types=layers)
        )

    return min(range(8, 4 * SHAPE["d_ff"], 8), key=lambda f: abs(params(f) - target))


def run(name: str, args, tok_path: Path, tokens_path: Path, vocab_size: int, sep_id: int) -> dict:
    unit = VARIANTS[name]
    full = model_params(ModelConfig(**SHAPE, vocab_size=vocab_size))
    d_ff = matched_d_ff(unit, vocab_size, full)
    layers = repeat_pattern(unit, SHAPE["n_layers"])
    model = {
        **SHAPE,
        "d_ff": d_ff,
        "vocab_size": vocab_size,
        "eos_token_id": sep_id,
        "name": name.replace(" ", "_"),
        "layer_types": layers,
        "mixer_chunk_size": 64,
    }
    out_dir = Path(args.work_dir) / name.replace(" ", "_").replace(":", "-")
    cfg = TrainConfig(
        model=model,
        train_data=str(tokens_path),
        val_fraction=0.05,
        tokenizer=str(tok_path),
        sep_id=sep_id,
        batch_size=args.batch,
        seq_len=args.seq_len,
        grad_accum=1,
        lr=args.lr,
        min_lr=args.lr / 10,
        weight_decay=0.1,
        beta2=0.95,
        grad_clip=1.0,
        precision="fp32",
        device="cpu",
        eval_batches=args.eval_batches,
        eval_interval=args.eval_every,
        log_interval=10,
        out_dir=str(out_dir),
        keep_last=1,
        ckpt_interval=0,
        seed=0,
        max_steps=args.steps,
        warmup_steps=max(1, args.steps // 20),
    )
    trainer = Trainer(cfg, progress=True, overwrite=True)
    init_recurrent_parameters(
        trainer.raw_model, seed=0
    )  # Trainer draws A, Δ-bias, conv as plain weights
    t0 = time.perf_counter()
    summary = trainer.fit()
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["val_loss"]) for r in rows if r["kind"] == "eval"]
    return {
        "baseline": trainer.unigram_baseline(),
        "params": trainer.raw_model.num_params(),
        "d_ff": d_ff,
        "layer_types": layers,
        "seconds": seconds,
        "tokens": args.steps * args.batch * args.seq_len,
        "val_loss": summary["val_loss"],
        "curve": curve,
    }


def plot(results: dict, path: str, baseline: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in results.items():
        steps, losses = zip(*r["curve"])
        ax.plot(
            steps,
            losses,
            marker="o",
            markersize=3,
            label=f"{name} ({r['params'] / 1e6:.2f}M params)",
        )
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle=":", label=f"unigram baseline {baseline:.2f}")
    ax.set_xlabel("step (same batches for every model)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Demo corpus (stdlib .py, V=4096), same tokens")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--data-dir", default="runs/demo", help="`lmstack demo` output (tokenizer.json, tokens.bin)"
    )
    ap.add_argument("--work-dir", default="runs/attention_corpus", help="the runs' out_dirs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/attention_corpus")
    ap.add_argument("--plot-only", action="store_true", help="redraw OUT.png from OUT.json")
    args = ap.parse_args()
    if args.plot_only:
        results = json.loads(Path(args.out + ".json").read_text())["results"]
        plot(results, args.out + ".png", next(iter(results.values()))["baseline"])
        return
    torch.set_num_threads(args.threads)
    tok_path, tokens_path = demo_data(Path(args.data_dir))
    tok = load_tokenizer(tok_path)
    sep_id = tok.special_tokens[SEP]
    results, baseline = {}, None
    for name in args.variants.split(","):
        results[name] = r = run(name, args, tok_path, tokens_path, tok.vocab_size, sep_id)
        baseline = r["baseline"]
        print(
            f"{name}: {r['params']:,} params (d_ff {r['d_ff']}), {r['seconds']:.0f} s, "
            f"val loss {r['val_loss']:.4f}",
            flush=True,
        )
    atomic_write_text(
        args.out + ".json", json.dumps({"args": vars(args), "results": results}, indent=2) + "\n"
    )
    plot(results, args.out + ".png", baseline)
    print("\n| layers | params | d_ff | val loss | ppl | tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['params']:,} | {r['d_ff']} | {r['val_loss']:.3f} | {2.718281828 ** r['val_loss']:.1f} | "
            f"{r['tokens'] / r['seconds']:,.0f} |"
        )


if __name__ == "__main__":
    main()
