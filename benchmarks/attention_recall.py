"""The seed's recall claim, measured small: multi-query associative recall (MQAR) with full attention, pure
linear attention, Gated DeltaNet and a 3:1 Gated-DeltaNet:full hybrid (CS336 notes "注意力机制": linear mixers
compress the past into a fixed-size state and lose exact recall; a few full layers recover it).

    nice -n 10 python benchmarks/attention_recall.py [--steps 1500] [--pairs 8,16,32,64] [--out docs/attention_recall]

Task (Zoology-style MQAR, Arora et al. 2023): P key-value pairs ``k1 v1 ... kP vP`` then the P keys again in
random order, each followed by its value: ``q1 a1 ... qP aP`` (keys from one half of the vocabulary, values
from the other, no key twice in a sequence). The model is trained (AdamW, same tokens for every model) on
a mix of P over ``--pairs``; accuracy is exact-match of the predicted value after each query, on fresh
sequences, per P (sequence length 4P). Writes ``OUT.json`` and ``OUT.png`` (accuracy vs sequence length).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lmstack.model.config import ModelConfig, repeat_pattern
from lmstack.model.mixers import init_recurrent_parameters
from lmstack.model.transformer import Transformer
from lmstack.utils import atomic_path, atomic_write_text

VOCAB = 64  # keys 0..31, values 32..63 (--vocab)
VARIANTS = {
    "full attention": ["attention"],
    "linear attention": ["linear_attention"],
    "gated deltanet": ["gated_deltanet"],
    "3:1 deltanet:full": ["gated_deltanet"] * 3 + ["attention"],
}


def mqar_batch(B: int, P: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, 4P) and targets (B, 4P) with -100 everywhere except the answer after each query."""
    keys = torch.argsort(torch.rand(B, VOCAB // 2, generator=gen), dim=1)[
        :, :P
    ]  # distinct keys per row
    values = torch.randint(VOCAB // 2, VOCAB, (B, P), generator=gen)
    order = torch.argsort(torch.rand(B, P, generator=gen), dim=1)
    ctx = torch.stack([keys, values], dim=2).reshape(B, 2 * P)
    qk, qv = keys.gather(1, order), values.gather(1, order)
    queries = torch.stack([qk, qv], dim=2).reshape(B, 2 * P)
    tokens = torch.cat([ctx, queries], dim=1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * P :: 2] = qv  # at query position 2P + 2i the next token is its value
    return tokens, targets


def build(unit: list[str], n_layers: int, d_model: int, max_len: int) -> Transformer:
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=2,
        d_ff=2 * d_model,
        max_seq_len=max_len,
        layer_types=repeat_pattern(unit, n_layers),
        mixer_chunk_size=32,
        linear_feature_map="elu1",
    )
    model = Transformer(cfg, seed=0)
    init_recurrent_parameters(model, seed=0)
    return model


def accuracy(model: Transformer, P: int, n: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    tokens, targets = mqar_batch(n, P, gen)
    with torch.no_grad():
        pred = model(tokens).argmax(-1)
    mask = targets != -100
    return (pred[mask] == targets[mask]).float().mean().item()


def train(name: str, args) -> dict:
    pairs = [int(p) for p in args.pairs.split(",")]
    model = build(VARIANTS[name], args.layers, args.d_model, 4 * max(pairs))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)  # the same batches for every model
    t0 = time.perf_counter()
    losses = []
    for step in tqdm(range(args.steps), desc=name, leave=False):
        lr = (
            args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        P = pairs[step % len(pairs)]
        tokens, targets = mqar_batch(
            args.batch * max(pairs) // P, P, gen
        )  # same tokens per step for every P
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    acc = {P: accuracy(model, P, 256, seed=10_000 + P) for P in pairs}
    return {
        "params": model.num_params(),
        "seconds": time.perf_counter() - t0,
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "accuracy": acc,
    }


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in results.items():
        Ps = sorted(int(p) for p in r["accuracy"])
        ax.plot(
            [4 * p for p in Ps],
            [r["accuracy"][str(p)] if str(p) in r["accuracy"] else r["accuracy"][p] for p in Ps],
            marker="o",
            label=f"{name} ({r['params'] / 1e3:.0f}k params)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (4 x key-value pairs)")
    ax.set_ylabel("recall accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title("Multi-query associative recall")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main() -> None:
    global VOCAB
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument(
        "--batch",
        type=int,
        default=16,
        help="sequences per step at the largest P (more at smaller P)",
    )
    ap.add_argument("--pairs", default="8,16,32,64")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--vocab", type=int, default=VOCAB, help="keys from the lower half, values from the upper"
    )
    ap.add_argument("--out", default="docs/attention_recall")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    VOCAB = args.vocab
    results = {}
    for name in args.variants.split(","):
        results[name] = train(name, args)
        r = results[name]
        print(
            f"{name}: {r['params']:,} params, {r['seconds']:.0f} s, final loss {r['final_loss']:.3f}, accuracy "
            + ", ".join(f"L={4 * P}: {a:.3f}" for P, a in r["accuracy"].items()),
            flush=True,
        )
    atomic_write_text(
        args.out + ".json", json.dumps({"args": vars(args), "results": results}, indent=2) + "\n"
    )
    plot(results, args.out + ".png")
    pairs = [int(p) for p in args.pairs.split(",")]
    print("\n| layers | params | " + " | ".join(f"L={4 * P}" for P in pairs) + " |")
    print("|---|---|" + "---|" * len(pairs))
    for name, r in results.items():
        print(
            f"| {name} | {r['params']:,} | "
            + " | ".join(f"{r['accuracy'][P]:.3f}" for P in pairs)
            + " |"
        )


if __name__ == "__main__":
    main()
