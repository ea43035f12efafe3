"""Supervised fine-tuning on prompt/response examples, on lmstack's ``Trainer``.

``ModelTrainer`` is the ``lmstack.train.Trainer`` loop (gradient accumulation, bf16 autocast, clipping, AdamW
with decay groups, LR schedule, checkpoints with exact resume, validation, metrics JSONL, loss PNG) around a
model you already have (an lmstack, HF or GGUF checkpoint) and batches you make, instead of a model built
from a config and windows of a token file: it overrides ``__init__``, ``next_batch``, ``forward_loss``,
``evaluate`` and ``export``; the loop itself is Trainer's. ``SFTTrainer`` feeds it completion-only batches
(``lmstack.align.data``), padded or packed. ``DPOTrainer`` (dpo.py) is the same base with another loss.

Single-process only (a parallel plan is refused).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from lmstack.accounting import training_step_flops
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
        c = self.config = config
        if c.parallel or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise TrainConfigError(
                "lmstack.align trainers run in one process; parallel plans are not supported"
            )
        self.progress, self.rank, self.world_size = progress, 0, 1
        self.device = resolve_device(c.device)
        torch.manual_seed(c.seed)
        self.out_dir = Path(c.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.overwrite, self._resumed = overwrite, False
        self.tokenizer = tokenizer
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
        if progress:
            print(line)
        self.raw_model.activation_checkpointing = c.activation_checkpointing
        self.raw_model.train()
        self._parallelize_fn, self.parallel_model, self._full_state = None, None, None
        self.model = self.raw_model
        self.dp_rank, self.dp_size = 0, 1
        self.optimizer = self.build_optimizer()
        self.schedule: LRSchedule = build_schedule(c)
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if self.runtime.dtype == "fp16" else None
        )
        self.data_generator = torch.Generator().manual_seed(c.seed * 1_000_003)
        self.step, self.tokens_seen, self.last_eval = 0, 0, {}
        self.tokens_per_step = c.batch_size * c.grad_accum * c.seq_len
        self.flops_per_step = training_step_flops(
            self.model_config,
            c.batch_size * c.grad_accum,
            c.seq_len,
            recompute=c.activation_checkpointing,
        )
        self._peak_flops = None

    def export(self, directory: str | os.PathLike | None = None) -> Path:
        """The weights as an lmstack model directory, with the tokenizer (and its chat template) beside them:
        what ``lmstack generate/serve/chat`` load."""
        return save_model_dir(
            self.raw_model,
            self.tokenizer,
            Path(directory) if directory is not None else self.out_dir / "model",
        )

    def sample_indices(self, n_items: int) -> list[int]:
        """B indices drawn with the trainer's data generator (saved in checkpoints: resume is exact)."""
        return torch.randint(
            0, n_items, (self.config.batch_size,), generator=self.data_generator
        ).tolist()


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
        return sft_loss(logp, mask, self.normalize), torch.zeros((), device=logp.device)

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """Token-mean NLL of the validation responses (every example once), and its perplexity."""
        exs = (
            self.val_examples
            or self.train_examples[: self.config.batch_size * self.config.eval_batches]
        )
        self.model.eval()
        total = count = 0.0
        try:
            B = self.config.batch_size
            for i in range(0, len(exs), B):
                batch = collate(exs[i : i + B], self.pad_id).to(self.device)
                with self.autocast():
                    logp, _ = batch_logprobs(self.model, batch)
                mask = batch.y != IGNORE_INDEX
                total += float(-(logp * mask).sum())
                count += float(mask.sum())
        finally:
            self.model.train()
        loss = total / max(count, 1.0)
        self.last_eval = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700))}
        return self.last_eval
