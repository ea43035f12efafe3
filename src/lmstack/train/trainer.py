"""The training loop: data -> forward/loss -> backward -> clip -> AdamW step, with evaluation,
metrics, progress, checkpoints and a divergence stop.

Seed 000 §1.8 (weights, optimizer states, gradients, activations; activation checkpointing),
§5.1/§5.4 (mixed precision: fp32 master weights, bf16 autocast for the forward/backward,
gradients land in fp32 because the parameters are fp32), seed 001 "训练稳定性" (z-loss,
QK-norm, weight decay), "工程细节/基准测试" (timing with a monotonic clock, synchronising CUDA),
"模型规模定律" (tokens per step = B·grad_accum·S; the critical batch size is where more does not help).

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
import functools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from lmstack.accounting import measure_cpu, training_step_flops
from lmstack.cpu import choose_precision
from lmstack.kernels.runtime import configure
from lmstack.model.dsa import dsa_indexer_loss
from lmstack.model.io import save_pretrained
from lmstack.model.moe import moe_aux_loss, moe_metrics, update_router_biases
from lmstack.model.transformer import Transformer
from lmstack.parallel import get_parallelize
from lmstack.parallel.checkpoint import load_sharded, save_sharded
from lmstack.quant.qat import prepare_qat
from lmstack.tokenizer import load_tokenizer, save_hf
from lmstack.tokenizer.token_file import check_token_ids, open_tokens, read_sidecar
from lmstack.train import checkpoint as ckpt
from lmstack.train.config import TrainConfig, TrainConfigError
from lmstack.train.data import Batch, get_batch, resolve_device, sequential_batches
from lmstack.train.losses import cross_entropy, linear_cross_entropy
from lmstack.train.optim import SGD, AdamW, clip_grad_norm, global_grad_norm
from lmstack.train.plot import plot_loss_curve
from lmstack.train.run_dir import (
    check_run_paths,
    clear_run,
    existing_run,
    refuse_existing_run,
    truncate_metrics,
)
from lmstack.train.schedule import LRSchedule

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/inf; the last good state was saved first."""


def optimizer_groups(model: torch.nn.Module, config: TrainConfig) -> list[dict[str, Any]]:
    """Two parameter groups: matrices decay, 1-D tensors (norm gains, biases) do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def optimizer_class(config: TrainConfig) -> tuple[type, dict[str, Any]]:
    """The optimizer class and its keyword arguments (lr, betas/momentum, eps)."""
    if config.optimizer == "adamw":
        return AdamW, {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps}
    return SGD, {"lr": config.lr, "momentum": config.momentum}


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW/SGD with two groups: matrices decay, 1-D tensors (norm gains, biases) do not."""
    cls, kw = optimizer_class(config)
    return cls(optimizer_groups(model, config), **kw)


def build_schedule(config: TrainConfig) -> LRSchedule:
    return LRSchedule(
        config.schedule,
        config.lr,
        config.min_lr,
        config.warmup_steps,
        config.max_steps,
        config.decay_steps,
    )


@functools.lru_cache(maxsize=8)
def device_peak_flops(device_type: str, precision: str) -> float:
    """Measured dense matmul FLOP/s of this device in the run's compute dtype (for MFU)."""
    key = "bf16" if precision == "bf16" else ("fp16" if precision == "fp16" else "fp32")
    if device_type == "cpu":
        return measure_cpu(quick=False, dtypes=(key,)).flops(key)
    if device_type == "cuda":
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[key]
        n = 8192
        a, b = (
            torch.randn(n, n, device="cuda", dtype=dt),
            torch.randn(n, n, device="cuda", dtype=dt),
        )
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        return 10 * 2 * n**3 / (time.perf_counter() - t0)
    return float("nan")


def unigram_baseline(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of ``val`` under the add-one unigram distribution of ``train``:
    the loss a model reaches by learning token frequencies and nothing else."""
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(val)].mean())


def _barrier() -> None:
    """Wait for every rank (no-op for one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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

        # ---- data (seed 000 §5.3) ----
        tokens = open_tokens(c.train_data)
        data_vocab = read_sidecar(c.train_data).vocab_size
        if c.val_data:
            self.train_tokens, self.val_tokens = tokens, open_tokens(c.val_data)
        else:
            cut = int(len(tokens) * (1 - c.val_fraction))
            self.train_tokens, self.val_tokens = tokens[:cut], tokens[cut:]
        for name, arr in (("training", self.train_tokens), ("validation", self.val_tokens)):
            if len(arr) < c.seq_len + 1:
                raise TrainConfigError(
                    f"the {name} split has {len(arr)} tokens, fewer than seq_len + 1 = "
                    f"{c.seq_len + 1} (use a larger corpus, a smaller seq_len or val_fraction)"
                )

        # ---- model ----
        self.model_config = c.model_config(vocab_size=data_vocab)
        if isinstance(data_vocab, int) and data_vocab > self.model_config.vocab_size:
            raise TrainConfigError(
                f"the data's vocab_size={data_vocab} exceeds model.vocab_size="
                f"{self.model_config.vocab_size}; token ids would be out of range"
            )
        check_token_ids(tokens, self.model_config.vocab_size, f"train_data {c.train_data}")
        if c.val_data:
            check_token_ids(self.val_tokens, self.model_config.vocab_size, f"val_data {c.val_data}")
        if (
            self.is_main
        ):  # before any rank reads a checkpoint (parallelize below synchronises the ranks)
            for line in ckpt.recover(self.ckpt_dir):
                print(f"checkpoints: {line}")
        self.raw_model = Transformer(self.model_config, device=self.device, seed=c.seed)
        self.runtime = c.runtime()  # backends, precision, compile: how this run computes
        runtime_line = configure(
            self.raw_model, self.runtime, self.device, training=True, max_keys=c.seq_len
        )
        if self.is_main:
            print(f"{self.precision_choice.line()}\n{runtime_line}")
        self.raw_model.activation_checkpointing = c.activation_checkpointing
        if (
            c.quant == "int4-qat"
        ):  # seed 001 "有损提速": train through the int4 rounding (straight-through)
            prepare_qat(self.raw_model, "int4")
        self.raw_model.train()
        self._parallelize_fn = parallelize
        self.parallel_model = None  # a lmstack.parallel.ParallelWrapper when config.parallel is set
        self._full_state: dict[str, torch.Tensor] | None = (
            None  # last gathered full parameters (rank 0)
        )
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
        if self._parallelize_fn is not None:
            return self._parallelize_fn(self, model)
        if self.config.parallel:
            try:
                fn = get_parallelize(self.config.parallel)
            except ValueError as e:
                raise TrainConfigError(str(e)) from None
            return fn(self, model)
        if self.world_size > 1:
            raise TrainConfigError(
                f"WORLD_SIZE={self.world_size} but no parallel strategy is set; "
                "pass parallel=ddp (or another lmstack.parallel strategy)"
            )
        return model

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
        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return value
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        return float(t[0]) / dist.get_world_size()

    def pipeline_train_step(self) -> dict[str, float]:
        """``train_step`` under pipeline parallelism (pp > 1): the ``grad_accum`` micro-batches go
        through the pipeline schedule together (m = grad_accum micro-batches in flight, each loss
        scaled by 1/m), then ``optimizer_step`` as usual."""
        c = self.raw_model.config
        extra = [
            name
            for name, on in (
                (
                    "moe_aux_loss_coef / moe_device_loss_coef / moe_z_loss_coef",
                    c.moe_aux_loss_coef or c.moe_device_loss_coef or c.moe_z_loss_coef,
                ),
                ("dsa_indexer_loss", c.dsa_indexer_loss),
            )
            if on
        ]
        if extra:  # the pipeline schedule carries one loss per micro-batch: these terms would be silently dropped
            raise TrainConfigError(
                f"model.{extra[0]} > 0 with pipeline parallelism (pp > 1): the auxiliary loss is "
                "not carried through the pipeline schedule; set it to 0 or train without pp"
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
        """bf16/fp16 autocast (seed 000 §5.4): matmuls in low precision, weights stay fp32."""
        if self.runtime.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(
            device_type=self.device.type, dtype=AUTOCAST_DTYPES[self.runtime.dtype]
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

        fp16 (seed 000 §5.1, underflow): the loss was multiplied by the scaler's factor before
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
        """One optimizer step over ``grad_accum`` micro-batches (loss scaled by 1/grad_accum)."""
        if self.parallel_model is not None and self.parallel_model.pipelined:
            return self.pipeline_train_step()
        n = self.config.grad_accum
        ce_sum = z_sum = aux_sum = idx_sum = 0.0
        for i in range(n):
            batch = self.next_batch()
            with self.micro_step_context(i, n):
                ce, z = self.forward_loss(batch)
                loss = ce + z
                aux = moe_aux_loss(
                    self.raw_model
                )  # mixture of experts: the routers' balance terms (model/moe.py)
                if aux is not None:
                    loss = loss + aux
                    aux_sum += float(aux.detach())
                idx = dsa_indexer_loss(
                    self.raw_model
                )  # DSA: the indexer's KL towards the main attention
                if idx is not None:
                    loss = loss + idx
                    idx_sum += float(idx.detach())
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
        if (
            self.raw_model.config.dsa_indexer_loss > 0
            and "dsa" in self.raw_model.config.mixer_types
        ):
            m["dsa_indexer_loss"] = idx_sum / n
        moe = moe_metrics(
            self.raw_model
        )  # last micro-batch's expert loads, dropped tokens, balance terms
        if moe:
            rate = self.raw_model.config.moe_bias_update_rate
            if rate:
                update_router_biases(self.raw_model, rate)  # aux-loss-free balancing (DeepSeek-V3)
            m.update(moe_aux_loss=aux_sum / n, **moe)
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
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def peak_flops(self) -> float:
        if self._peak_flops is None:
            self._peak_flops = device_peak_flops(self.device.type, self.runtime.dtype)
        return self._peak_flops

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def fit(self, callback: Callable[[Trainer, dict], None] | None = None) -> dict[str, Any]:
        """Train until ``max_steps`` (or ``stop_after`` steps); returns a summary.

        ``callback(trainer, metrics)`` runs after each step (tests use it to interrupt a run).
        """
        c = self.config
        stop_at = None if c.stop_after is None else self.step + c.stop_after
        end = c.max_steps if stop_at is None else min(c.max_steps, stop_at)
        peak = self.peak_flops() if self.progress else None
        self._claim_out_dir()
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            c.save(self.out_dir / "config.json")
        bar = self._bar = tqdm(
            total=c.max_steps,
            initial=self.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not (self.progress and self.is_main),
        )
        t_start = time.perf_counter()
        t_last, tokens_last = t_start, self.tokens_seen
        last: dict[str, float] = {}
        history: list[dict] = []
        try:
            while self.step < end:
                m = self.train_step()
                last = m
                if self.step % c.log_interval == 0 or self.step == end:
                    self._sync()
                    now = time.perf_counter()
                    tps = (self.tokens_seen - tokens_last) / max(now - t_last, 1e-9)
                    steps = (self.tokens_seen - tokens_last) / self.tokens_per_step
                    row = {
                        "kind": "train",
                        "step": self.step,
                        **m,
                        "tokens": self.tokens_seen,
                        "tokens_per_s": tps,
                        "elapsed_s": now - t_start,
                    }
                    if peak:
                        row["mfu"] = self.flops_per_step * steps / max(now - t_last, 1e-9) / peak
                    self.log(row)
                    history.append(row)
                    t_last, tokens_last = now, self.tokens_seen
                    post = {"loss": f"{m['loss']:.3f}", "tok/s": f"{tps:,.0f}"}
                    if "mfu" in row:
                        post["MFU"] = f"{row['mfu']:.1%}"
                    if self.last_eval:
                        post["val"] = f"{self.last_eval['val_loss']:.3f}"
                    bar.set_postfix(post, refresh=False)
                if c.eval_interval and self.step % c.eval_interval == 0 and self.step < end:
                    ev = self.evaluate()
                    self.log({"kind": "eval", "step": self.step, **ev})
                if c.ckpt_interval and self.step % c.ckpt_interval == 0 and self.step < end:
                    self.save_checkpoint()
                bar.update(1)
                if callback is not None:
                    callback(self, m)
                    end = (
                        c.max_steps if stop_at is None else min(c.max_steps, stop_at)
                    )  # set_max_steps may move it
                if c.time_limit_s is not None and time.perf_counter() - t_start > c.time_limit_s:
                    if self.is_main:
                        bar.write(
                            f"time limit {c.time_limit_s:.0f}s reached at step {self.step}/{c.max_steps}"
                        )
                    break
        except TrainingDiverged as e:
            bar.close()
            path = self.save_checkpoint()
            raise TrainingDiverged(
                f"{e}; stopped. The last good state (step {self.step}) is saved in {path}. "
                "Try a lower lr, grad_clip, z_loss=1e-4 or qk_norm=true."
            ) from None
        bar.close()
        ev = self.evaluate()
        self.log({"kind": "eval", "step": self.step, **ev})
        path = self.save_checkpoint()
        summary = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "checkpoint": str(path) if path else None,
            "metrics": str(self.metrics_path),
            "seconds": time.perf_counter() - t_start,
            **ev,
            "last_train": last,
        }
        return summary

    def _claim_out_dir(self) -> None:
        """A fresh run (no ``resume``, step 0) refuses an ``out_dir`` holding another run's files, or
        deletes them with ``overwrite``; every rank looks before rank 0 writes anything."""
        if self._resumed or self.step > 0:
            return
        found = existing_run(self.out_dir)
        _barrier()
        if not self.overwrite:
            refuse_existing_run(self.out_dir, found)
        if found and self.is_main:
            clear_run(self.out_dir)
            print(f"--overwrite: removed the previous run's {', '.join(found)} from {self.out_dir}")

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
