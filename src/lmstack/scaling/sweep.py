"""The IsoFLOP sweep: a grid of small models (several compute budgets C × several sizes N), each trained
with the existing trainer on D = C/(6N) tokens, recorded in ``runs.jsonl``; resumable.

CS336 notes "规模定律" (extrapolate from small experiments), Book of LLMs §1.6 (C ≈ 6ND). N counts the
parameters that do work for every token: everything but the input embedding lookup, plus the
unembedding V·D even when it is tied to the embedding (``compute_params``); the row also records
the exact FLOPs of the steps taken (``accounting.training_step_flops``, attention included).

A sweep file (TOML)::

    out_dir = "runs/scaling"          # runs.jsonl and one folder per run
    budgets = [1e11, 3e11, 1e12]      # C, FLOPs
    min_steps = 20                    # (C, N) pairs with fewer optimizer steps are left out
    warmup_fraction = 0.05
    eval_points = 4                   # validation losses along each run (approach 1's curves)
    flops = "6nd"                     # steps from C = 6ND, or "exact": C = accounting's FLOPs per step × steps
    [train]                           # TrainConfig keys shared by every run (train_data, batch_size, lr, ...)
    [model]                           # ModelConfig keys shared by every size
    [[sizes]]                         # one table per model shape: d_model, n_layers, n_heads, d_ff, ...
    [holdout]                         # optional: a larger run kept out of the fits, to check the prediction
    budget = 3e12
    size = 2                          # index into sizes, or a table of model keys

Finished runs (their name is in runs.jsonl) are skipped, so rerunning the command resumes the sweep.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lmstack.accounting import param_counts, training_step_flops
from lmstack.model.config import ModelConfig
from lmstack.scaling.runs import append_run, read_runs
from lmstack.tokenizer.token_file import read_sidecar
from lmstack.train import TrainConfig, Trainer, TrainingDiverged
from lmstack.utils import check_float, check_int

SHORT = {
    "d_model": "d",
    "n_layers": "L",
    "n_heads": "h",
    "n_kv_heads": "k",
    "d_ff": "f",
}  # run names
KNOWN = {
    "out_dir",
    "budgets",
    "min_steps",
    "warmup_fraction",
    "eval_points",
    "flops",
    "train",
    "model",
    "sizes",
    "holdout",
}
FLOP_COUNTS = ("6nd", "exact")


def _order(key: str) -> tuple[int, str]:
    return (list(SHORT).index(key) if key in SHORT else len(SHORT), key)


def compute_params(cfg: ModelConfig) -> int:
    """N for C = 6ND: the layers' parameters plus the V·D unembedding (tied or not), without the
    embedding lookup, which costs no FLOPs."""
    pc = param_counts(cfg)
    return pc.non_embedding + cfg.vocab_size * cfg.d_model


@dataclass
class RunSpec:
    name: str
    budget: float
    model: dict[str, Any]
    N: int
    steps: int
    tokens_per_step: int
    holdout: bool = False

    @property
    def D(self) -> int:
        return self.steps * self.tokens_per_step


@dataclass
class Sweep:
    path: Path
    out_dir: Path
    budgets: list[float]
    train: dict[str, Any]
    model: dict[str, Any]
    sizes: list[dict[str, Any]]
    min_steps: int = 20
    warmup_fraction: float = 0.05
    eval_points: int = 4
    holdout: dict[str, Any] | None = None
    flops: str = "6nd"
    _vocab: int | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Sweep:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"sweep config {str(p)!r} does not exist")
        try:
            d = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{p}: cannot parse TOML ({e})") from None
        unknown = sorted(set(d) - KNOWN)
        if unknown:
            raise ValueError(f"{p}: unknown key(s) {unknown}; known: {sorted(KNOWN)}")
        budgets = d.get("budgets")
        if not isinstance(budgets, list) or not budgets:
            raise ValueError(
                f"{p}: budgets must be a non-empty list of FLOP counts (e.g. [1e11, 3e11, 1e12])"
            )
        budgets = [check_float(f"{p}: budgets[{i}]", b) for i, b in enumerate(budgets)]
        if any(b <= 0 for b in budgets):
            raise ValueError(f"{p}: budgets {budgets} must all be > 0")
        sizes = d.get("sizes")
        if not isinstance(sizes, list) or not sizes or not all(isinstance(s, dict) for s in sizes):
            raise ValueError(
                f"{p}: [[sizes]] must be one or more tables of model keys (d_model, n_layers, ...)"
            )
        for k in ("train", "model"):
            if not isinstance(d.get(k, {}), dict):
                raise ValueError(f"{p}: [{k}] must be a table")
        train = dict(d.get("train", {}))  # paths in it are relative to the working directory
        if "train_data" not in train:
            raise ValueError(
                f"{p}: [train] needs train_data (a token file from `lmstack tokenizer encode`)"
            )
        for k in ("batch_size", "grad_accum", "seq_len"):  # sizes the plan divides by
            if k in train:
                check_int(f"{p}: [train] {k}", train[k], minimum=1)
        holdout = d.get("holdout")
        if holdout is not None:
            if not isinstance(holdout, dict) or "budget" not in holdout or "size" not in holdout:
                raise ValueError(
                    f"{p}: [holdout] needs budget (FLOPs) and size (an index into sizes or a table)"
                )
            check_float(f"{p}: holdout.budget", holdout["budget"])
            if isinstance(holdout["size"], int):
                check_int(f"{p}: holdout.size", holdout["size"], minimum=0, maximum=len(sizes) - 1)
            elif not isinstance(holdout["size"], dict):
                raise ValueError(
                    f"{p}: holdout.size={holdout['size']!r} must be an index into sizes or a table"
                )
        flops = d.get("flops", "6nd")
        if flops not in FLOP_COUNTS:
            raise ValueError(f"{p}: flops={flops!r}; expected one of {FLOP_COUNTS}")
        return cls(
            p,
            Path(d.get("out_dir", "runs/scaling")),
            sorted(budgets),
            train,
            dict(d.get("model", {})),
            sizes,
            check_int(f"{p}: min_steps", d.get("min_steps", 20), minimum=1),
            check_float(f"{p}: warmup_fraction", d.get("warmup_fraction", 0.05)),
            check_int(f"{p}: eval_points", d.get("eval_points", 4), minimum=1),
            holdout,
            flops,
        )

    @property
    def runs_path(self) -> Path:
        return self.out_dir / "runs.jsonl"

    def vocab_size(self) -> int | None:
        if self._vocab is None and "vocab_size" not in self.model:
            self._vocab = read_sidecar(self.train["train_data"]).vocab_size
        return self.model.get("vocab_size", self._vocab)

    def model_config(self, size: dict[str, Any]) -> ModelConfig:
        d = {**self.model, **size}
        d.setdefault("vocab_size", self.vocab_size())
        d.setdefault("max_seq_len", int(self.train.get("seq_len", 256)))
        return ModelConfig.from_dict(d)

    def tokens_per_step(self) -> int:
        t = self.train
        return (
            int(t.get("batch_size", 8)) * int(t.get("grad_accum", 1)) * int(t.get("seq_len", 256))
        )

    def _spec(self, budget: float, size: dict[str, Any], holdout: bool) -> RunSpec | None:
        cfg = self.model_config(size)
        N = compute_params(cfg)
        tps = self.tokens_per_step()
        if (
            self.flops == "exact"
        ):  # attention scores and all: accounting's count of one optimizer step
            t = self.train
            step_flops = training_step_flops(
                cfg,
                int(t.get("batch_size", 8)) * int(t.get("grad_accum", 1)),
                int(t.get("seq_len", 256)),
            )
            steps = round(budget / step_flops)
        else:
            steps = round(budget / (6.0 * N) / tps)
        if steps < self.min_steps:
            return None
        shape = "".join(
            f"{SHORT.get(k, '_' + k)}{v}"
            for k, v in sorted(size.items(), key=lambda kv: _order(kv[0]))
        )
        name = f"{'holdout_' if holdout else ''}C{budget:.2g}_{shape}"
        return RunSpec(name, budget, {**self.model, **size}, N, steps, tps, holdout)

    def plan(self) -> list[RunSpec]:
        """Every (budget, size) with at least ``min_steps`` steps, then the held-out run."""
        specs = [
            s for b in self.budgets for size in self.sizes if (s := self._spec(b, size, False))
        ]
        if self.holdout is not None:
            size = self.holdout["size"]
            size = self.sizes[size] if isinstance(size, int) else size
            s = self._spec(float(self.holdout["budget"]), size, True)
            if s is None:
                raise ValueError(
                    f"{self.path}: the held-out run (budget {self.holdout['budget']:.3g}) would take "
                    f"fewer than min_steps={self.min_steps} steps"
                )
            specs.append(s)
        return specs

    def train_config(self, spec: RunSpec) -> TrainConfig:
        t = dict(self.train)
        t["model"] = dict(spec.model)
        t["max_steps"] = spec.steps
        t["warmup_steps"] = min(spec.steps, max(1, round(self.warmup_fraction * spec.steps)))
        t["eval_interval"] = max(1, spec.steps // self.eval_points)
        t["log_interval"] = max(1, spec.steps // 10)
        t["out_dir"] = str(self.out_dir / spec.name)
        t.setdefault("keep_last", 1)
        t.setdefault("device", "cpu")
        if t.get("schedule", "cosine") == "wsd" and "decay_steps" not in self.train:
            t["decay_steps"] = max(1, spec.steps // 5)
        return TrainConfig.from_dict(t, where=f"{self.path} [train] for run {spec.name}")


def _curve(metrics: Path, tokens_per_step: int, N: int) -> list[list[float]]:
    """[(FLOPs 6·N·tokens, validation loss)] at each evaluation of the run."""
    out = []
    with open(metrics, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "eval" and row.get("step", 0) > 0:
                out.append([6.0 * N * row["step"] * tokens_per_step, row["val_loss"]])
    return out


def run_one(sweep: Sweep, spec: RunSpec) -> dict[str, Any]:
    """Train one run of the grid from scratch and return its row."""
    config = sweep.train_config(spec)
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's runtime line, once per run
        trainer = Trainer(config, progress=False, overwrite=True)
    t0 = time.perf_counter()
    try:
        summary = trainer.fit()
    except TrainingDiverged as e:  # recorded as diverged (left out of the fits); the sweep goes on
        return {
            "name": spec.name,
            "budget": spec.budget,
            "holdout": spec.holdout,
            "N": spec.N,
            "D": spec.D,  # as planned: the row stays in its budget's group
            "C": 6.0 * spec.N * spec.D,
            "loss": None,
            "diverged": f"{e} (of {spec.steps} planned steps)",
            "steps": trainer.step,
            "seconds": time.perf_counter() - t0,
            "lr": config.lr,
            "model": spec.model,
        }
    seconds = time.perf_counter() - t0
    D = trainer.tokens_seen
    return {
        "name": spec.name,
        "budget": spec.budget,
        "holdout": spec.holdout,
        "N": spec.N,
        "N_total": trainer.raw_model.num_params(),
        "D": D,
        "C": 6.0 * spec.N * D,
        "flops_exact": float(trainer.flops_per_step) * trainer.step,
        "steps": trainer.step,
        "loss": summary["val_loss"],
        "train_loss": summary["last_train"].get("loss", math.nan),
        "seconds": seconds,
        "tokens_per_param": D / spec.N,
        "lr": config.lr,
        "model": spec.model,
        "unique_tokens": len(trainer.train_tokens),  # U: D/U epochs of the training split
        "curve": _curve(trainer.metrics_path, spec.tokens_per_step, spec.N),
    }


def run_sweep(sweep: Sweep, progress: bool = True, limit: int | None = None) -> tuple[int, int]:
    """Train every planned run not yet in runs.jsonl (at most ``limit``); returns (trained, skipped).

    A run that diverges (``TrainingDiverged``: a non-finite loss or gradient) is recorded with
    ``diverged`` (the reason) and ``loss: null`` and counts as trained; the sweep goes on, a rerun does
    not retry it (delete its line to), and ``lmstack scaling fit`` leaves it out of the fits."""
    done = {r["name"] for r in read_runs(sweep.runs_path, missing_ok=True)}
    specs = sweep.plan()
    todo = [s for s in specs if s.name not in done]
    if limit is not None:
        todo = todo[:limit]
    total_flops = sum(6.0 * s.N * s.D for s in todo)
    bar = tqdm(
        total=total_flops,
        desc="sweep",
        unit="FLOP",
        unit_scale=True,
        dynamic_ncols=True,
        disable=not progress,
    )
    trained = 0
    try:
        for s in todo:
            bar.set_postfix_str(f"{s.name} ({s.steps} steps)")
            row = run_one(sweep, s)
            append_run(sweep.runs_path, row)
            trained += 1
            bar.update(6.0 * s.N * s.D)
            bar.write(
                f"{s.name}: diverged: {row['diverged']}; recorded, going on"
                if row.get("diverged")
                else f"{s.name}: N={s.N:,} D={row['D']:,} val_loss={row['loss']:.4f} "
                f"({row['seconds']:.0f} s)"
            )
    finally:
        bar.close()
    return trained, sum(s.name in done for s in specs)
