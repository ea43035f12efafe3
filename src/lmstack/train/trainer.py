"""The Trainer: one training run's state and its step — data -> forward/loss (+ the model's auxiliary
losses) -> backward -> clip -> AdamW step — with evaluation, checkpoints and export.

Book: 训练 (weights, optimizer states, gradients, activations; activation checkpointing), 混合精度 (fp32
master weights, bf16 autocast for the forward/backward, gradients land in fp32 because the parameters are
fp32), 训练稳定性 (z-loss, QK-norm, weight decay), 模型规模定律 (tokens per step = B·grad_accum·S).

Around it: ``train.build`` makes the pieces (token splits, model, parallel wrapping, optimizer, schedule),
``train.loop.fit`` decides when to step, log, evaluate and checkpoint, ``train.metrics`` measures
(throughput, MFU, the JSONL, means over ranks). The trainer knows no kind of layer: the model names its
auxiliary loss terms (``Transformer.aux_losses``: MoE balance, DSA indexer KL), which are added to the loss
and logged each by name, its per-step statistics (``training_metrics``) and its post-step updates
(``after_optimizer_step``).

The step is factored so a distributed wrapper can plug in without touching this file:

- ``parallelize(model) -> model`` runs once after the model is built (identity here; a DDP/FSDP
  wrapper returns the wrapped model). Pass ``parallelize=`` or set ``config.parallel`` to a plan
  ``lmstack.parallel`` knows (a table ``{dp = 2, tp = 2, zero = 1}`` or a string ``"ddp"``,
  ``"dp=2,zero=1"``); the plan's ``ParallelModel`` is kept as ``self.parallel_model``.
  ``self.raw_model`` stays the unwrapped model (export); ``self.model`` is what the forward calls.
- ``rank``/``world_size`` come from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); the
  sampler is seeded by the data-parallel rank (tp ranks of one replica read the same rows); only
  rank 0 writes files.
- ``build_optimizer()`` keeps the weight-decay groups and goes through the plan (ZeRO-1/2 shard
  the states); ``optimizer_step`` clips by the norm over every shard (``pm.clip_grad_norm_``);
  ``save_checkpoint`` gathers the full parameters and writes per-rank shard files (optimizer
  states as sharded), ``resume`` reads them back (``lmstack.parallel.checkpoint``).
- ``next_batch`` hands the sampled batch to ``pm.local_batch`` (context parallelism: this rank's
  targets); under pipeline parallelism ``train_step`` is ``pipeline_train_step`` (the grad_accum
  micro-batches go through the pipeline schedule together).
- ``micro_step_context(i, n)`` wraps each micro-batch's forward+backward (the model's ``no_sync``
  for all but the last); ``reduce_metric(x)`` averages a scalar over ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmstack.accounting import training_step_flops
from lmstack.cpu import choose_precision
from lmstack.model.io import save_pretrained
from lmstack.model.transformer import Transformer, aux_loss_coefs
from lmstack.parallel.checkpoint import load_sharded, save_sharded
from lmstack.tokenizer import load_tokenizer, save_hf
from lmstack.train import build, loop
from lmstack.train import checkpoint as ckpt
from lmstack.train.build import (  # noqa: F401  (importable from here too)
    build_optimizer,
    build_schedule,
    optimizer_class,
    optimizer_groups,
)
from lmstack.train.config import TrainConfig, TrainConfigError
from lmstack.train.data import Batch, get_batch, resolve_device, sequential_batches
from lmstack.train.loop import TrainingDiverged
from lmstack.train.losses import cross_entropy, linear_cross_entropy
from lmstack.train.metrics import (  # noqa: F401  (device_peak_flops: importable from here)
    append_jsonl,
    device_peak_flops,
    mean_over_ranks,
    unigram_baseline,
)
from lmstack.train.optim import clip_grad_norm, global_grad_norm
from lmstack.train.plot import plot_loss_curve
from lmstack.train.run_dir import check_run_paths, truncate_metrics
from lmstack.utils import torch_dtype


def model_aux_losses(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's named auxiliary loss terms of its last forward ({} for a model that declares none)."""
    fn = getattr(model, "aux_losses", None)
    return fn() if callable(fn) else {}


class _StateDictOnly:
    """What ``checkpoint.save_checkpoint`` needs of a model: its ``state_dict()``."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self._state.items()}


class Trainer:
    """One training run: ``Trainer(TrainConfig(...)).fit()``.

    ``train_step()`` = ``grad_accum`` × (``next_batch`` -> ``forward_loss`` -> backward) then
    ``optimizer_step()`` (clip, lr(t), AdamW); ``evaluate()``; ``save_checkpoint()`` / ``resume()``;
    ``export()`` (an lmstack model directory); ``plot()`` (loss-curve PNG). Each piece is a method
    so a subclass or a distributed wrapper can replace one without copying the loop.
    """

    def __init__(
        self,
        config: TrainConfig,
        parallelize: Callable[[Trainer, torch.nn.Module], torch.nn.Module] | None = None,
        progress: bool = True,
        peak_flops: float | None = None,
        overwrite: bool = False,
    ):
        """``overwrite``: a fresh run may replace a previous run in ``out_dir`` (its files are deleted
        when ``fit`` starts); without it a fresh run into a folder holding a run is refused."""
        self.config = c = config
        self.progress = progress
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.device = resolve_device(c.device)
        if self.device.type == "cuda" and self.world_size > 1 and self.device.index is None:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # precision="auto": bf16 only where this CPU/GPU multiplies it natively and faster (lmstack.cpu); the
        # resolved precision is what the run's config (and so its checkpoints) records
        self.precision_choice = choose_precision(c.precision, self.device)
        if self.precision_choice.precision != c.precision:
            self.config = c = dataclasses.replace(c, precision=self.precision_choice.precision)
        torch.manual_seed(c.seed)
        self.out_dir = Path(c.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.overwrite = overwrite
        self._resumed = False
        check_run_paths(c)

        self.train_tokens, self.val_tokens, data_vocab = build.load_token_splits(c)
        self.model_config = c.model_config(vocab_size=data_vocab)
        build.check_vocab(c, self.model_config, data_vocab, self.val_tokens)
        if self.is_main:  # before any rank reads a checkpoint (parallelize synchronises the ranks)
            for line in ckpt.recover(self.ckpt_dir):
                print(f"checkpoints: {line}")
        self.runtime = c.runtime()  # backends, precision, compile: how this run computes
        self.raw_model, runtime_line = build.build_model(
            c, self.model_config, self.device, self.runtime
        )
        if self.is_main:
            print(f"{self.precision_choice.line()}\n{runtime_line}")
        self._parallelize_fn = parallelize
        self.parallel_model = None  # a lmstack.parallel.ParallelWrapper when config.parallel is set
        self._full_state: dict[str, torch.Tensor] | None = None  # last gathered full parameters
        self.model = self.parallelize(self.raw_model)
        pm = self.parallel_model
        # data-parallel coordinates: the tp/pp/cp ranks of one replica read the same rows
        self.dp_rank = pm.mesh.rank("dp") if pm is not None else self.rank
        self.dp_size = pm.mesh.dp if pm is not None else self.world_size
        if self.runtime.compile:
            self.model = torch.compile(self.model)
        self.optimizer = self.build_optimizer()
        self.schedule = build_schedule(c)
        # fp16 has a narrow exponent range: scale the loss so small gradients do not underflow
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if self.runtime.dtype == "fp16" else None
        )
        if self.scaler is not None and pm is not None and not pm.fp16_scaler_ok:
            raise TrainConfigError(
                f"precision='fp16' with parallel={c.parallel!r}: the fp16 loss scaler checks "
                "for overflow per rank, which sharded plans (tp, pp, ZeRO) would let diverge; "
                "use precision='bf16' or 'fp32'"
            )
        self.data_generator = torch.Generator().manual_seed(c.seed * 1_000_003 + self.dp_rank)
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0
        self.last_eval: dict[str, float] = {}
        self.tokens_per_step = c.batch_size * c.grad_accum * c.seq_len * self.dp_size
        self.flops_per_step = training_step_flops(
            self.model_config,
            c.batch_size * c.grad_accum * self.dp_size,
            c.seq_len,
            recompute=c.activation_checkpointing,
        )
        self._peak_flops = peak_flops

    # ---- seams for distributed training ----------------------------------------------------
    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap the model for data/tensor/... parallelism; the identity for one process."""
        return build.parallelize(self, model, self._parallelize_fn, self.world_size)

    def build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW/SGD with weight-decay groups; under a parallel plan through
        ``ParallelModel.build_optimizer`` (ZeRO-1/2 shard the states, keeping the groups)."""
        cls, kw = optimizer_class(self.config)
        groups = optimizer_groups(self.model, self.config)
        if self.parallel_model is not None:
            return self.parallel_model.build_optimizer(cls, groups, **kw)
        return cls(groups, **kw)

    def micro_step_context(self, index: int, count: int):
        """Context for micro-batch ``index`` of ``count``: the wrapped model's ``no_sync()`` (DDP)
        for every micro-batch but the last, so gradients are communicated once per step."""
        no_sync = getattr(self.model, "no_sync", None)
        if callable(no_sync) and index < count - 1:
            return no_sync()
        return contextlib.nullcontext()

    def reduce_metric(self, value: float) -> float:
        """Average a scalar over all ranks (identity for one process)."""
        return value if self.world_size == 1 else mean_over_ranks(value, self.device)

    def pipeline_train_step(self) -> dict[str, float]:
        """``train_step`` under pipeline parallelism (pp > 1): the ``grad_accum`` micro-batches go
        through the pipeline schedule together (m = grad_accum micro-batches in flight, each loss
        scaled by 1/m), then ``optimizer_step`` as usual."""
        extra = [f"{k}={v}" for k, v in aux_loss_coefs(self.raw_model.config).items() if v]
        if extra:  # the pipeline schedule carries one loss per micro-batch: these terms would be silently dropped
            raise TrainConfigError(
                f"model.{' / '.join(extra)} > 0 with pipeline parallelism (pp > 1): the auxiliary "
                "loss is not carried through the pipeline schedule; set it to 0 or train without pp"
            )
        n = self.config.grad_accum
        batches = [self.next_batch() for _ in range(n)]
        x, y = torch.cat([b.x for b in batches]), torch.cat([b.y for b in batches])  # (n·B, S)
        with self.autocast():
            ce, z = self.parallel_model.pipeline_step(
                x, y, lambda logits, t: cross_entropy(logits, t, z_loss=self.config.z_loss)
            ).tolist()
        return self._finish_step(ce, z)

    def _finish_step(self, ce: float, z: float) -> dict[str, float]:
        """Average this rank's (cross-entropy, z-loss) over ranks, stop on a non-finite loss (every
        rank sees the same mean, so all stop together), else take the optimizer step."""
        ce, z = self.reduce_metric(ce), self.reduce_metric(z)
        if not math.isfinite(ce + z):
            self.optimizer.zero_grad(set_to_none=True)
            where = " (mean over ranks)" if self.world_size > 1 else ""
            raise TrainingDiverged(f"loss is {ce + z} at step {self.step}{where}")
        norm, lr = self.optimizer_step()
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return {"loss": ce, "z_loss": z, "grad_norm": norm, "lr": lr}

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- one step -------------------------------------------------------------------------
    def autocast(self):
        """bf16/fp16 autocast (Book of LLMs §5.4 “autocast and bitsandbytes”): matmuls in low precision, weights stay fp32."""
        if self.runtime.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(
            device_type=self.device.type,
            dtype=torch_dtype(self.runtime.dtype, allowed=("bf16", "fp16")),
        )

    def next_batch(self) -> Batch:
        c = self.config
        batch = get_batch(
            self.train_tokens,
            c.batch_size,
            c.seq_len,
            self.device,
            self.data_generator,
            c.sep_id if c.packing else None,
        )
        return (
            batch if self.parallel_model is None else self.parallel_model.local_batch(batch)
        )  # cp: its targets

    def forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, z-loss) of one micro-batch; logits (B, S, V).

        With ``config.fused_loss`` (single process) the model returns its final hidden states and
        ``linear_cross_entropy`` applies the unembedding block by block: the same loss and
        gradients without the (B·S, V) logits. A soft-capped output (Gemma-2's ``final_softcap``) is not a
        plain linear map, so such a model takes the unfused path.
        """
        if (
            self.config.fused_loss
            and self.parallel_model is None
            and self._parallelize_fn is None
            and self.raw_model.config.final_softcap is None
        ):
            with self.autocast():
                h = self.model(
                    batch.x,
                    positions=batch.positions,
                    document_ids=batch.document_ids,
                    return_hidden=True,
                )  # (B, S, D)
                return linear_cross_entropy(
                    h, self.raw_model.unembedding, batch.y, z_loss=self.config.z_loss
                )
        with self.autocast():
            logits = self.model(batch.x, positions=batch.positions, document_ids=batch.document_ids)
        return cross_entropy(logits, batch.y, z_loss=self.config.z_loss)

    def optimizer_step(self) -> tuple[float, float]:
        """Clip, set lr(step), update, zero grads; returns (grad norm before clipping, lr).

        fp16 (Book of LLMs §5.1 “mixed precision and underflow”, underflow): the loss was multiplied by the scaler's factor before
        backward; the grads are unscaled here, and a step whose grads overflowed is skipped
        (the scaler lowers its factor) instead of stopping the run.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        pm = self.parallel_model
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if pm is not None:  # the norm over every shard (tp, ZeRO), squares summed across ranks
            norm = (
                pm.clip_grad_norm_(self.config.grad_clip)
                if self.config.grad_clip > 0
                else pm.grad_norm()
            )
        elif self.config.grad_clip > 0:
            norm = clip_grad_norm(params, self.config.grad_clip)
        else:
            norm = global_grad_norm(params)
        norm_f = float(norm)
        lr = self.schedule.apply(self.optimizer, self.step)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update when norm_f is inf/nan
            self.scaler.update()
        else:
            if not math.isfinite(norm_f):
                raise TrainingDiverged(f"gradient norm is {norm_f} at step {self.step}")
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm_f, lr

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches (loss scaled by 1/grad_accum).

        Each micro-batch's loss is cross-entropy + z-loss + every auxiliary term the model reports
        (``Transformer.aux_losses``, already weighted); each term is logged by its name, averaged
        over the micro-batches, followed by the model's own statistics (``training_metrics``)."""
        if self.parallel_model is not None and self.parallel_model.pipelined:
            return self.pipeline_train_step()
        n = self.config.grad_accum
        ce_sum = z_sum = 0.0
        aux_sums: dict[str, float] = {}
        for i in range(n):
            batch = self.next_batch()
            with self.micro_step_context(i, n):
                ce, z = self.forward_loss(batch)
                loss = ce + z
                for name, term in model_aux_losses(self.raw_model).items():
                    loss = loss + term
                    aux_sums[name] = aux_sums.get(name, 0.0) + float(term.detach())
                value = float(loss.detach())
                if not math.isfinite(value) and self.world_size == 1:
                    self.optimizer.zero_grad(set_to_none=True)
                    raise TrainingDiverged(f"loss is {value} at step {self.step} (micro-batch {i})")
                # several ranks: backward runs anyway (its collectives need every rank) and the
                # check below sees the loss averaged over ranks, so all ranks stop together
                scaled = loss / n
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            ce_sum += float(ce.detach())
            z_sum += float(z.detach())
        m = self._finish_step(ce_sum / n, z_sum / n)
        m.update({name: total / n for name, total in aux_sums.items()})
        hooks = self.raw_model
        if callable(getattr(hooks, "training_metrics", None)):
            m.update(hooks.training_metrics())  # the last micro-batch's (MoE: expert loads)
            hooks.after_optimizer_step()  # e.g. aux-loss-free router biases (DeepSeek-V3)
        return m

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """Mean cross-entropy over sequential validation windows, and perplexity = exp(loss).

        Through ``forward_loss``, so with ``fused_loss`` the (B·S, V) logits are never formed here
        either (at V = 49 152, B·S = 4096 they would take 0.8 GB in fp32)."""
        c = self.config
        self.model.eval()
        total = count = 0.0
        try:
            for batch in sequential_batches(
                self.val_tokens,
                c.batch_size,
                c.seq_len,
                self.device,
                max_batches or c.eval_batches,
                c.sep_id if c.packing else None,
            ):
                ce, _ = self.forward_loss(batch)  # under evaluate's no_grad
                k = int((batch.y != -100).sum())
                total += float(ce) * k
                count += k
        finally:
            self.model.train()
        loss = self.reduce_metric(total / max(count, 1))
        self.last_eval = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700))}
        return self.last_eval

    # ---- checkpoints ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "model_config": self.model_config.to_dict(),
            "schedule": self.schedule.state_dict(),
            "tokens_seen": self.tokens_seen,
            "tokenizer": self.config.tokenizer,
            "last_eval": self.last_eval,
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def save_checkpoint(self) -> Path | None:
        """Rank 0 writes the checkpoint. Under a parallel plan every rank joins: the full
        parameters are gathered (single-process names) into rank 0's ``model.safetensors``, and
        each rank writes its own shard file (its parameters and optimizer states as sharded, its
        RNG states) into ``step_N.shards/`` (``lmstack.parallel.checkpoint``)."""
        pm = self.parallel_model
        if pm is not None:
            full = pm.full_state_dict(all_stages=True)  # a collective: all ranks
            if self.is_main and pm.sharded:
                self._full_state = full  # export() writes these, not raw_model's shards
            return save_sharded(
                self.ckpt_dir,
                self.step,
                pm,
                self.optimizer,
                self.data_generator,
                lambda: ckpt.save_checkpoint(
                    self.ckpt_dir,
                    self.step,
                    _StateDictOnly(full),
                    None,
                    self.state(),
                    self.data_generator,
                    keep_last=self.config.keep_last,
                ),
            )
        if not self.is_main:
            return None
        return ckpt.save_checkpoint(
            self.ckpt_dir,
            self.step,
            self.raw_model,
            self.optimizer,
            self.state(),
            self.data_generator,
            keep_last=self.config.keep_last,
        )

    def resume(self, path: str | os.PathLike | None = None) -> int:
        """Restore from ``path`` (default: the run's latest checkpoint); returns the step reached."""
        p = Path(path) if path is not None else ckpt.latest_checkpoint(self.ckpt_dir)
        if p is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.ckpt_dir}")
        if not p.is_dir():
            raise ckpt.CheckpointError(f"{p}: no such checkpoint directory")
        if self.parallel_model is not None:  # every rank reads its own shard file
            meta = load_sharded(p, self.parallel_model, self.optimizer, self.data_generator)
        else:
            meta = ckpt.load_checkpoint(p, self.raw_model, self.optimizer, self.data_generator)
        self.step = int(meta["step"])
        if self.step > self.config.max_steps:
            raise TrainConfigError(
                f"checkpoint {p} is at step {self.step}, past max_steps={self.config.max_steps}; "
                "raise max_steps to continue it"
            )
        self._resumed = True
        if self.is_main:  # the steps after this checkpoint will be trained (and logged) again
            truncate_metrics(self.metrics_path, self.step)
        self.tokens_seen = int(meta.get("tokens_seen", 0))
        self.last_eval = meta.get("last_eval") or {}
        if self.scaler is not None and meta.get("grad_scaler"):
            self.scaler.load_state_dict(meta["grad_scaler"])
        return self.step

    def export(self, directory: str | os.PathLike | None = None) -> Path:
        """The trained weights as an lmstack model directory (config.json + model.safetensors)."""
        d = Path(directory) if directory is not None else self.out_dir / "model"
        save_pretrained(self._unsharded_model(), d)
        if self.config.tokenizer and Path(self.config.tokenizer).exists():
            save_hf(
                load_tokenizer(self.config.tokenizer), d / "tokenizer.json"
            )  # HF format, beside the weights
        return d

    def _unsharded_model(self) -> torch.nn.Module:
        """``raw_model``, or for sharded plans a single-process model holding the full parameters
        gathered by the last ``save_checkpoint`` (every rank takes part in that gather)."""
        pm = self.parallel_model
        if pm is None or not pm.sharded:
            return self.raw_model
        if self._full_state is None:
            raise RuntimeError(
                "export() of a sharded run needs the full parameters: call save_checkpoint() on "
                "every rank first (fit() does at the end)"
            )
        model = Transformer(self.model_config, device="cpu", seed=self.config.seed)
        missing, unexpected = model.load_state_dict(self._full_state, strict=False)
        loaded = {
            id(p)
            for n, p in model.named_parameters(remove_duplicate=False)
            if n in self._full_state
        }
        params = dict(model.named_parameters(remove_duplicate=False))
        bad = [k for k in missing if k not in params or id(params[k]) not in loaded]
        if unexpected or bad:
            raise RuntimeError(
                f"gathered state dict does not fit the model: missing {bad}, unexpected {unexpected}"
            )
        return model

    # ---- the loop -------------------------------------------------------------------------
    def log(self, row: dict[str, Any]) -> None:
        if self.is_main:
            append_jsonl(self.metrics_path, row)

    def peak_flops(self) -> float:
        if self._peak_flops is None:
            self._peak_flops = device_peak_flops(self.device.type, self.runtime.dtype)
        return self._peak_flops

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def fit(self, callback: Callable[[Trainer, dict], None] | None = None) -> dict[str, Any]:
        """Train until ``max_steps`` (or ``stop_after`` steps); returns a summary (``loop.fit``).

        ``callback(trainer, metrics)`` runs after each step (tests use it to interrupt a run).
        """
        return loop.fit(self, callback)

    def _claim_out_dir(self) -> None:
        loop.claim_out_dir(self)

    def set_max_steps(self, max_steps: int) -> None:
        """Move the end of the run (and of the LR schedule) — e.g. from a callback that measured the
        step time and wants to finish within a time budget. Steps already taken are unchanged."""
        if max_steps <= self.step:
            raise ValueError(f"max_steps={max_steps} must be > the current step {self.step}")
        self.config.max_steps = max_steps
        self.schedule.total_steps = max_steps
        if self.schedule.warmup_steps > max_steps:
            self.schedule.warmup_steps = max_steps
        bar = getattr(self, "_bar", None)
        if bar is not None:
            bar.total = max_steps
            bar.refresh()

    def plot(self, baseline: float | None = None) -> Path | None:
        if not self.is_main:
            return None
        return plot_loss_curve(
            self.metrics_path,
            self.out_dir / "loss_curve.png",
            baseline,
            title=f"{self.model_config.name}: {self.raw_model.num_params():,} params, "
            f"B={self.config.batch_size}x{self.config.grad_accum}, S={self.config.seq_len}",
        )

    def unigram_baseline(self) -> float:
        return unigram_baseline(self.train_tokens, self.val_tokens, self.model_config.vocab_size)
