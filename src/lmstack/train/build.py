"""Building a training run from its ``TrainConfig``: the token splits, the model (runtime, QAT,
activation checkpointing), the parallel wrapping, the optimizer with its weight-decay groups and the
learning-rate schedule. Plain functions; ``Trainer.__init__`` calls them in this order.

Book: 训练 (data splits, AdamW's decay groups, the LR schedule), 混合精度 (the run's precision is
resolved before the model is built), 有损提速 (quantisation-aware training through the int4 rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lmstack.kernels.runtime import configure
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.parallel import get_parallelize
from lmstack.quant.qat import prepare_qat
from lmstack.tokenizer.token_file import check_token_ids, open_tokens, read_sidecar
from lmstack.train.config import TrainConfig, TrainConfigError
from lmstack.train.optim import SGD, AdamW
from lmstack.train.schedule import LRSchedule


# ---- data ---------------------------------------------------------------------------------
def load_token_splits(c: TrainConfig) -> tuple[np.ndarray, np.ndarray, int | None]:
    """(train tokens, validation tokens, the data's vocab size): ``val_data``, or the last
    ``val_fraction`` of ``train_data``; each split must hold at least ``seq_len + 1`` tokens."""
    tokens = open_tokens(c.train_data)
    data_vocab = read_sidecar(c.train_data).vocab_size
    if c.val_data:
        train, val = tokens, open_tokens(c.val_data)
    else:
        cut = int(len(tokens) * (1 - c.val_fraction))
        train, val = tokens[:cut], tokens[cut:]
    for name, arr in (("training", train), ("validation", val)):
        if len(arr) < c.seq_len + 1:
            raise TrainConfigError(
                f"the {name} split has {len(arr)} tokens, fewer than seq_len + 1 = "
                f"{c.seq_len + 1} (use a larger corpus, a smaller seq_len or val_fraction)"
            )
    return train, val, data_vocab


def check_vocab(
    c: TrainConfig, model_config: ModelConfig, data_vocab: int | None, val: np.ndarray
) -> None:
    """Every token id of the data must be a row of the model's embedding."""
    if isinstance(data_vocab, int) and data_vocab > model_config.vocab_size:
        raise TrainConfigError(
            f"the data's vocab_size={data_vocab} exceeds model.vocab_size="
            f"{model_config.vocab_size}; token ids would be out of range"
        )
    check_token_ids(
        open_tokens(c.train_data), model_config.vocab_size, f"train_data {c.train_data}"
    )
    if c.val_data:
        check_token_ids(val, model_config.vocab_size, f"val_data {c.val_data}")


# ---- model --------------------------------------------------------------------------------
def build_model(
    c: TrainConfig, model_config: ModelConfig, device: torch.device, runtime
) -> tuple[Transformer, str]:
    """The seeded model on ``device``, configured for training by ``runtime`` (attention/norm
    backends); with activation checkpointing and int4 QAT as the config asks. Returns the model
    and ``configure``'s line naming what it chose."""
    model = Transformer(model_config, device=device, seed=c.seed)
    line = configure(model, runtime, device, training=True, max_keys=c.seq_len)
    model.activation_checkpointing = c.activation_checkpointing
    if c.quant == "int4-qat":  # train through the int4 rounding (straight-through)
        prepare_qat(model, "int4")
    model.train()
    return model, line


def parallelize(
    trainer, model: torch.nn.Module, fn: Callable | None, world_size: int
) -> torch.nn.Module:
    """``fn(trainer, model)``, else the plan ``config.parallel`` names (``lmstack.parallel``; it sets
    ``trainer.parallel_model``), else the model itself — refused when torchrun started several ranks."""
    if fn is not None:
        return fn(trainer, model)
    plan = trainer.config.parallel
    if plan:
        try:
            wrap = get_parallelize(plan)
        except ValueError as e:
            raise TrainConfigError(str(e)) from None
        return wrap(trainer, model)
    if world_size > 1:
        raise TrainConfigError(
            f"WORLD_SIZE={world_size} but no parallel strategy is set; "
            "pass parallel=ddp (or another lmstack.parallel strategy)"
        )
    return model


# ---- optimizer and schedule ---------------------------------------------------------------
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
