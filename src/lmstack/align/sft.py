"""Supervised fine-tuning on prompt/response examples, on lmstack's ``Trainer``.

``ModelTrainer`` is the ``lmstack.train.Trainer`` loop (gradient accumulation, bf16 autocast, clipping, AdamW
with decay groups, LR schedule, checkpoints with exact resume, validation, metrics JSONL, loss PNG) around a
model you already have (an lmstack, HF or GGUF checkpoint) and batches you make, instead of a model built
from a config and windows of a token file: it overrides ``__init__``, ``next_batch``, ``forward_loss``,
``evaluate`` and ``export``; the loop itself is Trainer's. ``SFTTrainer`` feeds it completion-only batches
(``lmstack.align.data``), padded or packed. ``DPOTrainer`` (dpo.py) is the same base with another loss.

Under torchrun (WORLD_SIZE > 1) the learner is data parallel (``lmstack.parallel``'s DDP through Trainer's plan
seam; ``align.distributed``): every rank draws the same global batch of B·M example indices and trains its
slice of B, token-normalised losses divide by the token count of the whole global batch, evaluation is split
over the ranks and summed — so M ranks of B give the losses and gradients of one process of M·B.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from lmstack.accounting import training_step_flops
from lmstack.align import distributed as D
from lmstack.align.data import Example, collate, pack
from lmstack.align.logprobs import batch_logprobs
from lmstack.align.losses import sft_loss
from lmstack.kernels.runtime import configure
from lmstack.model.io import save_pretrained
from lmstack.tokenizer import save_hf, save_hf_config
from lmstack.train import checkpoint as ckpt
from lmstack.train.config import TrainConfig, TrainConfigError
from lmstack.train.data import Batch, resolve_device
from lmstack.train.losses import IGNORE_INDEX
from lmstack.train.schedule import LRSchedule
from lmstack.train.trainer import Trainer, build_schedule


def save_model_dir(model, tokenizer, directory: str | os.PathLike) -> Path:
    """An lmstack model directory (config.json + model.safetensors) with the tokenizer beside it in HF's two
    files (tokenizer.json; tokenizer_config.json: the chat template and special tokens)."""
    d = Path(directory)
    save_pretrained(model, d)
    if tokenizer is not None:
        save_hf(tokenizer, d / "tokenizer.json")
        save_hf_config(tokenizer, d / "tokenizer_config.json")
    return d


class ModelTrainer(Trainer):
    """Trainer's loop on a given ``model`` (trained in place) and ``tokenizer`` (saved beside exports)."""

    def __init__(
        self,
        config: TrainConfig,
        model: torch.nn.Module,
        tokenizer=None,
        progress: bool = True,
        overwrite: bool = False,
    ):
        c = config
        try:
            plan = D.data_parallel_plan(c.parallel, D.env_world_size())
        except ValueError as e:
            raise TrainConfigError(str(e)) from None
        if plan != c.parallel:
            c = dataclasses.replace(c, parallel=plan)
        self.config = c
        self.progress = progress
        self.rank, self.world_size = int(os.environ.get("RANK", "0")), D.env_world_size()
        self.device = resolve_device(c.device)
        torch.manual_seed(c.seed)
        self.out_dir = Path(c.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.overwrite, self._resumed = overwrite, False
        self.tokenizer = tokenizer
        if self.is_main:
            for line in ckpt.recover(self.ckpt_dir):
                print(f"checkpoints: {line}")
        self.raw_model = model.to(self.device)
        self.model_config = model.config
        if c.seq_len > model.config.max_seq_len:
            raise TrainConfigError(
                f"seq_len={c.seq_len} exceeds the model's max_seq_len={model.config.max_seq_len}"
            )
        self.runtime = c.runtime()
        line = configure(
            self.raw_model, self.runtime, self.device, training=True, max_keys=c.seq_len
        )
        if progress and self.is_main:
            print(line)
        self.raw_model.activation_checkpointing = c.activation_checkpointing
        self.raw_model.train()
        self._parallelize_fn, self.parallel_model, self._full_state = None, None, None
        self.model = self.parallelize(self.raw_model)  # DDP under torchrun (config.parallel)
        pm = self.parallel_model
        self.dp_rank, self.dp_size = (pm.mesh.rank("dp"), pm.mesh.dp) if pm is not None else (0, 1)
        self.optimizer = self.build_optimizer()
        self.schedule: LRSchedule = build_schedule(c)
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if self.runtime.dtype == "fp16" else None
        )
        # the same generator on every rank: all draw the global batch, each trains its slice
        self.data_generator = torch.Generator().manual_seed(c.seed * 1_000_003)
        self.step, self.tokens_seen, self.last_eval = 0, 0, {}
        self.tokens_per_step = c.batch_size * c.grad_accum * c.seq_len * self.dp_size
        self.flops_per_step = training_step_flops(
            self.model_config,
            c.batch_size * c.grad_accum * self.dp_size,
            c.seq_len,
            recompute=c.activation_checkpointing,
        )
        self._peak_flops = None

    def export(self, directory: str | os.PathLike | None = None) -> Path:
        """The weights as an lmstack model directory, with the tokenizer (and its chat template) beside them:
        what ``lmstack generate/serve/chat`` load. Rank 0 writes it (every replica holds the same weights)."""
        d = Path(directory) if directory is not None else self.out_dir / "model"
        if self.is_main:
            save_model_dir(self.raw_model, self.tokenizer, d)
        D.barrier()
        return d

    def sample_indices(self, n_items: int) -> list[int]:
        """This rank's B indices: B·M drawn with the trainer's data generator (the same on every rank, saved
        in checkpoints: resume is exact), of which rank r keeps the r-th slice of B."""
        B = self.config.batch_size
        drawn = torch.randint(0, n_items, (B * self.dp_size,), generator=self.data_generator)
        return drawn[self.dp_rank * B : (self.dp_rank + 1) * B].tolist()

    def token_normaliser(self, mask: torch.Tensor) -> float | None:
        """Under data parallelism, the response-token count of the whole global micro-batch divided by M: a
        token mean over all ranks' rows once DDP averages the gradients. None for one process."""
        if self.dp_size == 1:
            return None
        return float(D.all_sum(mask.sum().reshape(1))[0]) / self.dp_size

    def eval_share(self, items: Sequence) -> list:
        """This rank's share of an evaluation set (every M-th item from its rank): each item is scored once
        over all ranks and the sums are added with ``align.distributed.all_sum``."""
        return list(items)[self.dp_rank :: self.dp_size]


class SFTTrainer(ModelTrainer):
    """Completion-only SFT: loss = masked token NLL of the responses (``normalize`` "token" or "sequence");
    ``config.packing`` packs each micro-batch's examples into rows of ``seq_len`` with per-document attention."""

    def __init__(
        self,
        config: TrainConfig,
        model,
        train: Sequence[Example],
        val: Sequence[Example] = (),
        tokenizer=None,
        normalize: str = "token",
        pad_id: int = 0,
        **kw,
    ):
        if not train:
            raise TrainConfigError("no training examples")
        too_long = [
            i for i, ex in enumerate(list(train) + list(val)) if len(ex) - 1 > config.seq_len
        ]
        if too_long:
            raise TrainConfigError(
                f"example {too_long[0]} needs more than seq_len={config.seq_len} positions; "
                "encode the examples with max_len=seq_len + 1"
            )
        super().__init__(config, model, tokenizer, **kw)
        self.train_examples, self.val_examples = list(train), list(val)
        self.normalize, self.pad_id = normalize, pad_id

    def make_batch(self, examples: Sequence[Example]) -> Batch:
        if self.config.packing:
            return pack(examples, self.config.seq_len, self.pad_id)[0].to(self.device)
        return collate(examples, self.pad_id).to(self.device)

    def next_batch(self) -> Batch:
        return self.make_batch(
            [self.train_examples[i] for i in self.sample_indices(len(self.train_examples))]
        )

    def forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with self.autocast():
            logp, _ = batch_logprobs(self.model, batch)
        mask = batch.y != IGNORE_INDEX
        if self.normalize == "sequence" and batch.document_ids is not None:
            raise TrainConfigError(
                "normalize='sequence' with packing: a row holds several sequences; use 'token'"
            )
        num = self.token_normaliser(mask) if self.normalize == "token" else None
        return sft_loss(logp, mask, self.normalize, num), torch.zeros((), device=logp.device)

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """Token-mean NLL of the validation responses (every example once), and its perplexity."""
        exs = (
            self.val_examples
            or self.train_examples[: self.config.batch_size * self.config.eval_batches]
        )
        exs = self.eval_share(exs)
        self.model.eval()
        total = count = 0.0
        try:
            B = self.config.batch_size
            for i in range(0, len(exs), B):
                batch = collate(exs[i : i + B], self.pad_id).to(self.device)
                with self.autocast():
                    logp, _ = batch_logprobs(self.raw_model, batch)
                mask = batch.y != IGNORE_INDEX
                total += float(-(logp * mask).sum())
                count += float(mask.sum())
        finally:
            self.model.train()
        total, count = D.all_sum(torch.tensor([total, count])).tolist()
        loss = total / max(count, 1.0)
        self.last_eval = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700))}
        return self.last_eval
