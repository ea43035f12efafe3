"""The registry of attention / RMSNorm implementations, and the one ``auto`` policy.

Book of LLMs §2.7 (FlashAttention is exact, so every backend computes the same function),
CS336 notes "优化技巧" (fusion, tiling). Backends:

attention  ``sdpa``           F.scaled_dot_product_attention (on CUDA its FlashAttention-2 kernel)
           ``reference``      softmax(QKᵀ/√H + mask) V, materialising the (T, S) matrix
           ``flash_pytorch``  lmstack.kernels.flash_pytorch (tiled PyTorch, O(S) memory)
           ``flash_triton``   lmstack.kernels.flash_triton (Triton; CUDA or TRITON_INTERPRET=1)
                              (both flash kernels cover the plain causal case; a call whose metadata
                              needs an explicit mask — cache slots, window, documents — runs sdpa)
           ``matmul``         lmstack.kernels.matmul_attention: bf16 matmuls, fp32 scores/softmax,
                              block-triangular for causal masks (row blocks skip the keys they
                              never see), P recomputed in backward (CPU training)
           ``onednn``         lmstack.kernels.onednn_attention: CPU fp32 inference, plain causal
                              self-attention of ≥ 192 tokens through oneDNN's GEMM, block-triangular;
                              every other call runs sdpa (the perplexity windows ask for it)
           ``auto``           the fastest available on the tensor's device (table below)
rmsnorm    ``torch``          the eager fp32 formula in lmstack.model.layers.RMSNorm (impl None)
           ``triton``         lmstack.kernels.triton_rmsnorm (one fused kernel each way)
           ``auto``           triton on CUDA when Triton is installed, else torch

``auto`` for attention resolves to ``sdpa`` on every device, with one exception: on CPU, when
autograd records (training) under bf16/fp16 autocast and nothing is being compiled, it resolves to
``matmul`` — there SDPA's CPU flash backward costs several times its forward, and the matmul path (SDPA's
forward + its own block-triangular backward) is faster up to T=S=512 and slower at 1024, so beyond
``CPU_TRAINING_MAX_KEYS`` = 512 keys ``auto`` stays on SDPA (the figures, and the CPU they were measured
on: docs/training.md).
In fp32, for inference and under torch.compile SDPA stays faster or fuses better.
The policy is applied once, by ``choose_attention`` when a model, engine or trainer is built (with
what the builder knows: device, training under autocast, longest key length, compile), never per
call. On CUDA SDPA dispatches to
FlashAttention-2 in CUDA, which the
Triton kernel aims to match (≥ 0.9x); it is not the default until a measurement on a GPU shows it does
(``FASTEST_ATTENTION``).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from lmstack.kernels.flash_pytorch import flash_attention_pytorch
from lmstack.kernels.matmul_attention import matmul_attention
from lmstack.kernels.onednn_attention import OneDNNAttention
from lmstack.model.seam import (
    AttentionImpl,
    AttentionMetadata,
    NormImpl,
    ReferenceAttention,
    SDPAAttention,
)

ATTENTION_BACKENDS = (
    "auto",
    "sdpa",
    "reference",
    "matmul",
    "flash_pytorch",
    "flash_triton",
    "onednn",
)
NORM_BACKENDS = (
    "auto",
    "torch",
    "triton",
)  # RMSNorm: eager fp32 formula or the fused Triton kernel
# device type -> attention backend that "auto" picks (see the module docstring for why)
FASTEST_ATTENTION = {"cpu": "sdpa", "cuda": "sdpa"}
# CPU training under low-precision autocast: the block-triangular matmul attention (module docstring)
CPU_TRAINING_ATTENTION = "matmul"
CPU_TRAINING_MAX_KEYS = (
    512  # longer key sequences: SDPA's own backward is faster (module docstring)
)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class MatmulAttentionImpl:
    """``lmstack.kernels.matmul_attention``: bf16 matmuls, fp32 softmax, block-triangular causal."""

    name = "matmul"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        mask = meta.mask()
        return matmul_attention(q, k, v, mask=mask, causal=mask is None)


class FlashAttentionImpl:
    """FlashAttention-2 (Book of LLMs §2.7 “FlashAttention tiling”), tiled PyTorch or Triton, for the plain causal case; a call
    whose metadata needs an explicit mask (KV-cache slots, window, packed documents) runs sdpa."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        if meta.mask() is not None:
            return ATTENTION["sdpa"](q, k, v, meta)
        return flash_attention(q, k, v, causal=True, backend=self.name)


#: name -> the stateless implementation object (``lmstack.model.seam.AttentionImpl``)
ATTENTION: dict[str, AttentionImpl] = {
    "sdpa": SDPAAttention(),
    "reference": ReferenceAttention(),
    "matmul": MatmulAttentionImpl(),
    "flash_pytorch": FlashAttentionImpl("flash_pytorch"),
    "flash_triton": FlashAttentionImpl("flash_triton"),
    "onednn": OneDNNAttention(),  # falls back to sdpa where it does not apply
}


@functools.cache
def triton_installed() -> bool:
    """True when the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device | str) -> bool:
    """Triton kernels can run on this device: CUDA with Triton, or any device under TRITON_INTERPRET=1."""
    device = torch.device(device)
    if not triton_installed():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def cpu_training_autocast(device: torch.device | str) -> bool:
    """True on CPU while autograd records under bf16/fp16 autocast and nothing is being compiled."""
    return (
        torch.device(device).type == "cpu"
        and torch.is_grad_enabled()
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") in (torch.bfloat16, torch.float16)
        and not torch.compiler.is_compiling()
    )


def choose_attention(
    name: str,
    device: torch.device | str,
    training_autocast: str | None = None,
    compile: bool = False,
    max_keys: int | None = None,
    needs: tuple[str, ...] = (),
) -> tuple[str, str]:
    """The one ``auto`` policy: (backend, reason). ``training_autocast``: the autocast dtype name
    ("bf16"/"fp16") when the built thing trains under autocast, else None; ``max_keys``: the longest
    key sequence S it will see (None: unknown); ``needs``: what the model's layers need of the implementation
    (``("softcap",)``: Gemma-2's soft-capped scores, which only ``reference`` applies — ``Transformer.attention_needs``).
    Other names are checked and returned as they are (the model refuses one that lacks what it needs)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend={name!r}; expected one of {ATTENTION_BACKENDS}")
    if name != "auto":
        return name, "configured"
    if "softcap" in needs:
        return "reference", "auto: soft-capped attention scores"
    kind = torch.device(device).type
    if (
        kind == "cpu"
        and training_autocast in ("bf16", "fp16")
        and not compile
        and (max_keys is None or max_keys <= CPU_TRAINING_MAX_KEYS)
    ):
        return (
            CPU_TRAINING_ATTENTION,
            f"auto: CPU, {training_autocast} autocast, ≤{CPU_TRAINING_MAX_KEYS} keys",
        )
    why = [kind.upper() if kind == "cpu" else kind]
    if training_autocast and kind == "cpu":
        why.append("compiled" if compile else f">{CPU_TRAINING_MAX_KEYS} keys")
    return FASTEST_ATTENTION.get(kind, "sdpa"), "auto: " + ", ".join(why)


def resolve_attn_backend(name: str, device: torch.device | str, key_len: int | None = None) -> str:
    """``choose_attention`` with the training/autocast state read from the current context."""
    training = torch.get_autocast_dtype("cpu") if cpu_training_autocast(device) else None
    autocast = (
        None if training is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(training)
    )
    return choose_attention(name, device, autocast, torch.compiler.is_compiling(), key_len)[0]


def attention_impl(name: str) -> AttentionImpl:
    """The registered implementation of a concrete backend name (not ``auto``)."""
    if name not in ATTENTION:
        raise ValueError(
            f"attention backend={name!r}; expected one of {sorted(ATTENTION)} (auto is resolved "
            "by choose_attention)"
        )
    return ATTENTION[name]


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    backend: str = "flash_pytorch",
    scale: float | None = None,
    return_lse: bool = False,
):
    """FlashAttention-2 through the PyTorch or the Triton implementation.

    q (B, N, T, H), k/v (B, K, S, H) -> O (B, N, T, H) [, L (B, N, T)]; causal is bottom-right aligned.
    """
    if backend == "flash_pytorch":
        return flash_attention_pytorch(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    if backend == "flash_triton":
        from lmstack.kernels.flash_triton import (
            flash_attention_triton,
        )  # imports triton on first use

        return flash_attention_triton(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    raise ValueError(f"flash backend={backend!r}; expected 'flash_pytorch' or 'flash_triton'")


def choose_norm(name: str, device: torch.device | str) -> tuple[str, NormImpl | None]:
    """``auto`` -> ``triton`` on CUDA when Triton is installed, else ``torch``; returns (name, impl),
    impl None for ``torch`` (the model's own eager formula)."""
    if name not in NORM_BACKENDS:
        raise ValueError(f"norm backend={name!r}; expected one of {NORM_BACKENDS}")
    if name == "auto":
        device = torch.device(device)
        name = "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    return name, (rms_norm_triton if name == "triton" else None)


def resolve_norm_backend(name: str, x: Tensor) -> str:
    """``choose_norm`` for a tensor: ``triton`` for fp32/fp16/bf16 CUDA tensors when Triton is installed."""
    chosen = choose_norm(name, x.device)[0]
    return (
        "torch"
        if chosen == "triton" and name == "auto" and x.dtype not in _TRITON_DTYPES
        else chosen
    )


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm (Book of LLMs §1.10 “RMSNorm”) through the fused Triton kernel (imports Triton on first use)."""
    from lmstack.kernels.triton_rmsnorm import rmsnorm_triton

    return rmsnorm_triton(x, weight, eps)
