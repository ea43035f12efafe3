"""Two small CPU scaling experiments on a token file, with the trainer:

- ``lr_transfer``: final validation loss vs learning rate for several widths under SP and under µP
  (Book of LLMs §3.1 “muP”: under µP the best LR found at the base width stays the best at larger widths);
- ``batch_sweep``: loss vs steps at several batch sizes, with the gradient-noise-scale estimate of the
  critical batch size logged along the run (CS336 notes "规模定律": batch size; McCandlish et al. 2018).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lmstack.scaling.mup import MupTrainer
from lmstack.scaling.noise_scale import NoiseScaleCallback
from lmstack.train import TrainConfig, Trainer, TrainingDiverged
from lmstack.utils import pyplot, save_png


def _config(
    train_data: str,
    out_dir: Path,
    width: int,
    lr: float,
    steps: int,
    batch: int,
    seq: int,
    n_heads: int = 4,
    n_layers: int = 2,
    seed: int = 0,
) -> TrainConfig:
    return TrainConfig(
        model=dict(
            d_model=width,
            n_layers=n_layers,
            n_heads=n_heads,
            d_ff=4 * width,
            max_seq_len=seq,
            tie_embeddings=False,
            name=f"w{width}",
        ),
        train_data=train_data,
        batch_size=batch,
        seq_len=seq,
        max_steps=steps,
        warmup_steps=max(1, steps // 10),
        lr=lr,
        min_lr=lr / 10,
        weight_decay=0.0,
        beta2=0.95,
        grad_clip=1.0,
        precision="fp32",
        device="cpu",
        eval_interval=0,
        eval_batches=8,
        log_interval=max(1, steps // 20),
        out_dir=str(out_dir),
        keep_last=1,
        seed=seed,
    )


def _fit(trainer: Trainer, callback=None) -> dict[str, Any]:
    try:
        return trainer.fit(callback=callback)
    except TrainingDiverged:  # a diverged run is a data point (loss = nan), not a failed experiment
        return {"val_loss": float("nan")}


def lr_transfer(
    train_data: str,
    out_dir: Path,
    widths: list[int],
    lrs: list[float],
    base_width: int,
    steps: int = 150,
    batch: int = 8,
    seq: int = 64,
    progress: bool = True,
) -> dict[str, Any]:
    """{"sp"|"mup": {width: {lr: final val loss}}} and the best lr per width."""
    results: dict[str, dict[int, dict[float, float]]] = {"sp": {}, "mup": {}}
    runs = [(p, w, lr) for p in results for w in widths for lr in lrs]
    for p, w, lr in tqdm(runs, desc="lr-transfer", unit="run", disable=not progress):
        cfg = _config(train_data, out_dir / f"{p}_w{w}_lr{lr:g}", w, lr, steps, batch, seq)
        with contextlib.redirect_stdout(io.StringIO()):
            tr = (
                MupTrainer(cfg, base_width, progress=False, overwrite=True)
                if p == "mup"
                else Trainer(cfg, progress=False, overwrite=True)
            )
            loss = _fit(tr)["val_loss"]
        results[p].setdefault(w, {})[lr] = loss
    best = {
        p: {w: min(r, key=lambda k: r[k] if r[k] == r[k] else float("inf")) for w, r in res.items()}
        for p, res in results.items()
    }
    return {
        "results": results,
        "best_lr": best,
        "widths": widths,
        "lrs": lrs,
        "base_width": base_width,
        "steps": steps,
        "batch": batch,
        "seq": seq,
    }


def plot_lr_transfer(summary: dict[str, Any], path: Path) -> Path:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, p in zip(axes, ("sp", "mup")):
        for i, w in enumerate(summary["widths"]):
            r = summary["results"][p][w]
            lrs = sorted(r)
            ax.plot(
                lrs,
                [r[lr] for lr in lrs],
                "-o",
                ms=3,
                label=f"width {w}",
                color=plt.get_cmap("viridis")(i / max(1, len(summary["widths"]) - 1)),
            )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(f"{p.upper()} ({summary['steps']} steps, base width {summary['base_width']})")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("final validation loss")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    return path


def batch_sweep(
    train_data: str,
    out_dir: Path,
    batches: list[int],
    steps: int,
    width: int = 64,
    lr: float = 3e-3,
    seq: int = 64,
    noise_every: int = 20,
    progress: bool = True,
) -> dict[str, Any]:
    """Loss-vs-steps curves at each batch size, and B_simple (tokens) measured during the smallest one."""
    curves, noise = {}, None
    for b in tqdm(batches, desc="batch-sweep", unit="run", disable=not progress):
        cfg = _config(train_data, out_dir / f"b{b}", width, lr, steps, b, seq)
        cfg.log_interval = max(1, steps // 40)
        cb = NoiseScaleCallback(every=noise_every, big=4) if b == min(batches) else None
        with contextlib.redirect_stdout(io.StringIO()):
            tr = Trainer(cfg, progress=False, overwrite=True)
            _fit(tr, cb)
        rows = [json.loads(line) for line in open(tr.metrics_path, encoding="utf-8")]
        curves[b] = [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]
        if cb is not None:
            noise = {
                "b_simple_tokens": cb.estimate.b_simple,
                "trace": [
                    (r["step"], r["b_simple_tokens"]) for r in rows if r["kind"] == "noise_scale"
                ],
            }
    return {
        "curves": curves,
        "noise_scale": noise,
        "seq": seq,
        "width": width,
        "lr": lr,
        "steps": steps,
    }


def plot_batch_sweep(summary: dict[str, Any], path: Path) -> Path:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    S = summary["seq"]
    for b, pts in sorted(summary["curves"].items()):
        s, l = zip(*pts)
        axes[0].plot(s, l, label=f"B={b} ({b * S} tokens)")
        axes[1].plot([x * b * S for x in s], l, label=f"B={b}")
    axes[0].set_xlabel("optimizer steps")
    axes[1].set_xlabel("tokens")
    axes[1].set_xscale("log")
    axes[0].set_ylabel("training loss")
    ns = summary.get("noise_scale")
    title = f"B_simple ≈ {ns['b_simple_tokens']:,.0f} tokens" if ns else ""
    axes[0].set_title("loss vs steps " + title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    return path
