"""RuntimeConfig: how a model runs (attention / RMSNorm backends), as opposed to what it is.

``ModelConfig`` is the architecture (what a checkpoint's config.json holds); the runtime choices
are given to whatever builds a model (trainer, engine, CLI) and resolved once by ``configure``,
which sets the implementations on the model and returns the line it logs, e.g.
``attention: matmul (auto: CPU, bf16 autocast, ≤512 keys); rmsnorm: torch (auto)``.
Seed 000 §2.7 (every attention backend computes the same function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmstack.kernels.backends import ATTENTION_BACKENDS, NORM_BACKENDS, attention_impl, choose_attention, choose_norm


@dataclass
class RuntimeConfig:
    """attn_backend: one of ``ATTENTION_BACKENDS`` ("auto": ``backends.choose_attention``);
    norm_backend: one of ``NORM_BACKENDS`` ("auto": triton on CUDA with Triton, else torch)."""

    attn_backend: str = "auto"
    norm_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attn_backend={self.attn_backend!r}; expected one of {ATTENTION_BACKENDS}")
        if self.norm_backend not in NORM_BACKENDS:
            raise ValueError(f"norm_backend={self.norm_backend!r}; expected one of {NORM_BACKENDS}")


def configure(model, runtime: RuntimeConfig | None = None, device: torch.device | str | None = None,
              training_autocast: str | None = None, compile: bool = False, max_keys: int | None = None) -> str:
    """Resolve ``runtime`` once for what the builder knows and set it on ``model`` (anything with
    ``set_attention``/``set_norm``, e.g. ``lmstack.model.transformer.Transformer``); returns the log line.

    device: where the model runs (default: its parameters'); training_autocast: "bf16"/"fp16" when it
    trains under autocast; compile: torch.compile'd; max_keys: the longest key sequence S it will see.
    """
    runtime = runtime or RuntimeConfig()
    if device is None:
        device = next(model.parameters()).device
    attn, why = choose_attention(runtime.attn_backend, device, training_autocast, compile, max_keys)
    norm, norm_impl = choose_norm(runtime.norm_backend, device)
    model.set_attention(attention_impl(attn))
    model.set_norm(norm_impl)
    norm_why = "auto" if runtime.norm_backend == "auto" else "configured"
    return f"attention: {attn} ({why}); rmsnorm: {norm} ({norm_why})"
