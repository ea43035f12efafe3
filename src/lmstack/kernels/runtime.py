"""RuntimeConfig: how a model runs (backends, number format, compilation), as opposed to what it is.

``ModelConfig`` is the architecture (what a checkpoint's config.json holds); the runtime choices
are given to whatever builds a model — the trainer (``TrainConfig.runtime()``), the engine
(``LLM(model, runtime=...)``), the commands (``--attn-backend``, ``--dtype``, ``--compile``) — and
resolved once by ``configure``, which sets the implementations on the model and returns the line
it logs, e.g. ``attention: matmul (auto: CPU, bf16 autocast, ≤512 keys); rmsnorm: torch (auto)``.
Book of LLMs §2.7 (every attention backend computes the same function), §5 (number formats).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lmstack.kernels.backends import (
    ATTENTION_BACKENDS,
    NORM_BACKENDS,
    attention_impl,
    choose_attention,
    choose_norm,
)
from lmstack.ops.gemm import GEMM_BACKENDS, choose_gemm, set_gemm
from lmstack.utils import FLOAT_DTYPES

#: Floating formats: training autocasts to them (fp32 master weights; "fp32" = no autocast), inference
#: holds its weights in them.
PRECISIONS = FLOAT_DTYPES  # ("fp32", "bf16", "fp16"), the names in lmstack.utils
#: Inference also runs weight-only quantised linears (``lmstack.quant``) over fp32 weights; a format
#: registered later (``quant.register_format``) adds its name here.
WEIGHT_FORMATS = [*PRECISIONS, "int8", "int4"]


@dataclass
class RuntimeConfig:
    """attn_backend: one of ``ATTENTION_BACKENDS`` ("auto": ``backends.choose_attention``);
    norm_backend: one of ``NORM_BACKENDS`` ("auto": triton on CUDA with Triton, else torch);
    dtype: the number format, one of ``WEIGHT_FORMATS`` (training: ``PRECISIONS``, the autocast dtype);
    compile: ``torch.compile`` the model (training) or the decode step (``lmstack generate``);
    gemm: the CPU fp32 GEMM, one of ``ops.gemm.GEMM_BACKENDS`` ("auto": the measured policy of this CPU's
    vendor, ``ops.gemm.choose_gemm``; "onednn"; "blas": torch's own)."""

    attn_backend: str = "auto"
    norm_backend: str = "auto"
    dtype: str = "fp32"
    compile: bool = False
    gemm: str = "auto"

    def __post_init__(self) -> None:
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attn_backend={self.attn_backend!r}; expected one of {ATTENTION_BACKENDS}"
            )
        if self.norm_backend not in NORM_BACKENDS:
            raise ValueError(f"norm_backend={self.norm_backend!r}; expected one of {NORM_BACKENDS}")
        if self.dtype not in WEIGHT_FORMATS:
            raise ValueError(f"dtype={self.dtype!r}; expected one of {WEIGHT_FORMATS}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile={self.compile!r} must be true or false")
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"gemm={self.gemm!r}; expected one of {GEMM_BACKENDS}")


def configure(
    model,
    runtime: RuntimeConfig | None = None,
    device: torch.device | str | None = None,
    training: bool = False,
    max_keys: int | None = None,
) -> str:
    """Resolve ``runtime`` once for what the builder knows and set it on ``model`` (anything with
    ``set_attention``/``set_norm``, e.g. ``lmstack.model.transformer.Transformer``) and the GEMM policy of the
    process (``ops.gemm.set_gemm``: every lmstack ``Linear`` reads it); returns the log line. This module is the
    only place that swaps implementations (``use_attention`` for a block of code).

    device: where the model runs (default: its parameters'); training: it trains (under autocast when
    ``runtime.dtype`` is bf16/fp16); max_keys: the longest key sequence S it will see.
    """
    runtime = runtime or RuntimeConfig()
    if device is None:
        device = next(model.parameters()).device
    autocast = runtime.dtype if training and runtime.dtype in ("bf16", "fp16") else None
    needs: tuple[str, ...] = getattr(
        model, "attention_needs", tuple
    )()  # e.g. ("softcap",) for Gemma-2 (Transformer.attention_needs)
    attn, why = choose_attention(
        runtime.attn_backend, device, autocast, runtime.compile, max_keys, needs
    )
    norm, norm_impl = choose_norm(runtime.norm_backend, device)
    model.set_attention(attention_impl(attn))
    model.set_norm(norm_impl)
    norm_why = "auto" if runtime.norm_backend == "auto" else "configured"
    line = f"attention: {attn} ({why}); rmsnorm: {norm} ({norm_why})"
    if torch.device(device).type == "cpu":
        gemm = choose_gemm(runtime.gemm)
        set_gemm(gemm)
        line += "; " + gemm.line()
    return line


def install_attention(model, impl) -> None:
    """Set ``impl`` (anything with the attention implementation's call) as ``model``'s attention: the entry
    for an implementation a wrapper brings (context parallelism's ``RingAttention``), so that every swap of an
    implementation goes through this module. ``Transformer.set_attention`` refuses one a layer cannot use (a
    soft-capped layer under an implementation that does not apply the cap)."""
    model.set_attention(impl)


@contextmanager
def use_attention(model, name: str) -> Iterator[bool]:
    """Within the block, ``model`` runs attention backend ``name`` when it runs plain SDPA now (a backend chosen
    by ``configure`` — the reference for soft-capped scores, a user's choice — is kept); restored on exit,
    unless something else replaced it meanwhile. Yields whether it swapped."""
    saved = getattr(model, "attention", None)
    swap = saved is not None and getattr(saved, "name", None) == "sdpa"
    ours = attention_impl(name)
    if swap:
        model.set_attention(ours)
    try:
        yield swap
    finally:
        if swap and model.attention is ours:
            model.set_attention(saved)
