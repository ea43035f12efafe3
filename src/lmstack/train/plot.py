"""Loss curves from a run's ``metrics.jsonl`` as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lmstack.utils import pyplot, save_png


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All JSON lines of a metrics file; a resumed run's later line for a step replaces the earlier one."""
    rows: dict[tuple[str, int], dict] = {}
    p = Path(path)
    if not p.is_file():
        return []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        rows[(r.get("kind", "train"), int(r.get("step", 0)))] = r
    return [rows[k] for k in sorted(rows, key=lambda k: (k[1], k[0]))]


def plot_loss_curve(
    metrics_path: str | os.PathLike,
    out_png: str | os.PathLike,
    baseline: float | None = None,
    title: str | None = None,
) -> Path:
    """Train loss per logged step, validation loss at each evaluation, optional unigram baseline."""
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if r.get("kind", "train") == "train"]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("kind") == "eval"]
    fig, ax = pyplot().subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5, ms=4)
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label=f"unigram baseline {baseline:.2f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "lmstack training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_png(fig, out_png)
