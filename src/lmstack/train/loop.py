"""The training loop around a ``Trainer``: steps until ``max_steps`` (or ``stop_after`` steps, or the
time limit), a metrics row every ``log_interval`` steps, evaluation and checkpoints at their intervals,
a progress bar, and on divergence the last good state saved before stopping.

What one step does is the trainer's (``Trainer.train_step``, which subclasses replace); this module only
decides when things happen. Book: 训练 (the loop), 训练稳定性 (stop on a NaN/inf loss, keep the last
good state), 工程细节/基准测试 (throughput timed between log rows: ``metrics.Throughput``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

from lmstack.train.metrics import Throughput, progress_postfix
from lmstack.train.run_dir import clear_run, existing_run, refuse_existing_run


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/inf; the last good state was saved first."""


def barrier() -> None:
    """Wait for every rank (no-op for one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def claim_out_dir(trainer) -> None:
    """A fresh run (no ``resume``, step 0) refuses an ``out_dir`` holding another run's files, or
    deletes them with ``overwrite``; every rank looks before rank 0 writes anything."""
    if trainer._resumed or trainer.step > 0:
        return
    found = existing_run(trainer.out_dir)
    barrier()
    if not trainer.overwrite:
        refuse_existing_run(trainer.out_dir, found)
    if found and trainer.is_main:
        clear_run(trainer.out_dir)
        print(f"--overwrite: removed the previous run's {', '.join(found)} from {trainer.out_dir}")


def fit(trainer, callback: Callable[[Any, dict], None] | None = None) -> dict[str, Any]:
    """Train until ``max_steps`` (or ``stop_after`` steps); returns a summary.

    ``callback(trainer, metrics)`` runs after each step (tests use it to interrupt a run; it may
    move the end with ``trainer.set_max_steps``)."""
    t, c = trainer, trainer.config
    stop_at = None if c.stop_after is None else t.step + c.stop_after
    end = c.max_steps if stop_at is None else min(c.max_steps, stop_at)
    peak = t.peak_flops() if t.progress else None
    t._claim_out_dir()
    if t.is_main:
        t.out_dir.mkdir(parents=True, exist_ok=True)
        c.save(t.out_dir / "config.json")
    bar = t._bar = tqdm(
        total=c.max_steps,
        initial=t.step,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=not (t.progress and t.is_main),
    )
    meter = Throughput(t.tokens_seen, t.tokens_per_step, t.flops_per_step, peak, t._sync)
    last: dict[str, float] = {}
    try:
        while t.step < end:
            m = last = t.train_step()
            if t.step % c.log_interval == 0 or t.step == end:
                row = {"kind": "train", "step": t.step, **m, **meter.row(t.tokens_seen)}
                t.log(row)
                bar.set_postfix(progress_postfix(row, t.last_eval), refresh=False)
            if c.eval_interval and t.step % c.eval_interval == 0 and t.step < end:
                t.log({"kind": "eval", "step": t.step, **t.evaluate()})
            if c.ckpt_interval and t.step % c.ckpt_interval == 0 and t.step < end:
                t.save_checkpoint()
            bar.update(1)
            if callback is not None:
                callback(t, m)
                end = c.max_steps if stop_at is None else min(c.max_steps, stop_at)
            if c.time_limit_s is not None and meter.elapsed() > c.time_limit_s:
                if t.is_main:
                    bar.write(
                        f"time limit {c.time_limit_s:.0f}s reached at step {t.step}/{c.max_steps}"
                    )
                break
    except TrainingDiverged as e:
        bar.close()
        path = t.save_checkpoint()
        raise TrainingDiverged(
            f"{e}; stopped. The last good state (step {t.step}) is saved in {path}. "
            "Try a lower lr, grad_clip, z_loss=1e-4 or qk_norm=true."
        ) from None
    bar.close()
    ev = t.evaluate()
    t.log({"kind": "eval", "step": t.step, **ev})
    path = t.save_checkpoint()
    return {
        "step": t.step,
        "tokens_seen": t.tokens_seen,
        "checkpoint": str(path) if path else None,
        "metrics": str(t.metrics_path),
        "seconds": time.perf_counter() - meter.t_start,
        **ev,
        "last_train": last,
    }
