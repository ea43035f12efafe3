"""One report from a run's task stats: merged per stage and step, as a table and a funnel PNG.

``<output>/<stage>/stats/*.json`` (written by :func:`lmstack.data.executor.run_task`) are summed step by step
(:meth:`StepStats.merge`); the funnel shows the documents and bytes that leave each step, stage after stage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lmstack.data.step import StepStats
from lmstack.utils import pyplot, save_png


def merge_stats(output: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """{stage: {"tasks": done, "world": n, "steps": [StepStats summed over tasks]}} in the run's stage order."""
    output = Path(output)
    if not output.is_dir():
        raise FileNotFoundError(f"{output}: no such folder (expected a pipeline's output folder)")
    tasks_file = output / "tasks.json"
    worlds = json.loads(tasks_file.read_text()) if tasks_file.exists() else {}
    stages = list(worlds) + sorted(
        p.parent.name for p in output.glob("*/stats") if p.parent.name not in worlds
    )
    merged: dict[str, dict[str, Any]] = {}
    for stage in stages:
        files = sorted((output / stage / "stats").glob("*.json"))
        steps: list[StepStats] = []
        for f in files:
            try:
                d = json.loads(f.read_text())
                task = [StepStats.from_dict(s) for s in d["steps"]]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{f}: not a task stats file ({type(e).__name__}: {e})") from None
            if steps and [s.name for s in task] != [s.name for s in steps]:
                raise ValueError(
                    f"{f}: steps {[s.name for s in task]} differ from the stage's other tasks "
                    f"{[s.name for s in steps]}"
                )
            steps = task if not steps else [a.merge(b) for a, b in zip(steps, task)]
        merged[stage] = {
            "tasks": len(files),
            "world": worlds.get(stage, len(files)),
            "steps": steps,
        }
    if not merged:
        raise FileNotFoundError(
            f"{output}: no <stage>/stats/*.json inside (is it a pipeline's output folder?)"
        )
    return merged


def to_json(merged: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {stage: {**m, "steps": [s.to_dict() for s in m["steps"]]} for stage, m in merged.items()}


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def format_table(merged: dict[str, dict[str, Any]]) -> str:
    """A plain-text table: stage, step, documents and MB in/out, each drop reason with its count."""
    rows = [("stage", "step", "docs in", "docs out", "MB in", "MB out", "dropped (reason: docs)")]
    for stage, m in merged.items():
        label = f"{stage} ({m['tasks']}/{m['world']} tasks)"
        for s in m["steps"]:
            drops = ", ".join(
                f"{k}: {v}" for k, v in sorted(s.dropped.items(), key=lambda kv: (-kv[1], kv[0]))
            )
            rows.append(
                (
                    label,
                    s.name,
                    str(s.docs_in),
                    str(s.docs_out),
                    _mb(s.bytes_in),
                    _mb(s.bytes_out),
                    drops,
                )
            )
            label = ""
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1])] + [
            c.rjust(w) for c, w in zip(r[2:6], widths[2:6])
        ]
        lines.append("  ".join(cells + [r[6]]).rstrip())
    return "\n".join(lines)


def plot_funnel(merged: dict[str, dict[str, Any]], path: str | os.PathLike) -> Path:
    """Bars of the documents and MB kept after each step (input of the first step first), stage after stage.
    Left out: steps no document went through (dedup's global stages) and a later stage's reader that reads
    back exactly what the stage before wrote (same documents and bytes)."""
    labels, docs, nbytes = [], [], []
    for stage, m in merged.items():
        steps = [s for s in m["steps"] if s.docs_in or s.docs_out]
        if steps and not labels:
            first = steps[0]
            labels.append(f"{stage}: input")
            docs.append(first.docs_in or first.docs_out)
            nbytes.append(first.bytes_in or first.bytes_out)
        elif steps and (steps[0].docs_out, steps[0].bytes_out) == (docs[-1], nbytes[-1]):
            steps = steps[1:]
        for s in steps:
            labels.append(f"{stage}: {s.name}")
            docs.append(s.docs_out)
            nbytes.append(s.bytes_out)
    top = max(nbytes, default=0)
    unit, scale = ("GB", 1e9) if top >= 1e9 else ("MB", 1e6) if top >= 1e6 else ("KB", 1e3)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, max(3.0, 0.45 * len(labels) + 1.2)))
    y = list(range(len(labels)))[::-1]
    panels = (
        (axes[0], docs, "documents kept", "{:,.0f}"),
        (
            axes[1],
            [b / scale for b in nbytes],
            f"{unit} kept (text; raw HTML before extraction)",
            "{:,.2f}",
        ),
    )
    for ax, values, title, fmt in panels:
        ax.barh(y, values, color="#4c72b0")
        base = values[0] or 1
        for yi, v in zip(y, values):
            ax.text(v, yi, f" {fmt.format(v)} ({100 * v / base:.0f}%)", va="center", fontsize=8)
        ax.set_yticks(y)
        ax.set_yticklabels(labels if ax is axes[0] else [""] * len(labels), fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.3)
    fig.suptitle("data pipeline funnel (after each step)")
    fig.tight_layout()
    return save_png(fig, path, dpi=110)
