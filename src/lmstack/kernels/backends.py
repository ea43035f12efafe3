"""Which attention / RMSNorm implementation runs where, and one entry point for each.

Seed 000 §2.7 (FlashAttention is exact, so every backend computes the same function),
seed 001 "优化技巧" (fusion, tiling). Backends:

attention  ``sdpa``           F.scaled_dot_product_attention (on CUDA its FlashAttention-2 kernel)
           ``reference``      softmax(QKᵀ/√H + mask) V, materialising the (T, S) matrix
           ``flash_pytorch``  lmstack.kernels.flash_pytorch (tiled PyTorch, O(S) memory)
           ``flash_triton``   lmstack.kernels.flash_triton (Triton; CUDA or TRITON_INTERPRET=1)
           ``matmul``         lmstack.kernels.matmul_attention: bf16 matmuls, fp32 scores/softmax,
                              block-triangular for causal masks (row blocks skip the keys they
                              never see), P recomputed in backward (CPU training)
           ``auto``           the fastest available on the tensor's device (table below)
rmsnorm    ``torch``          the eager fp32 formula in lmstack.model.layers.RMSNorm
           ``triton``         lmstack.kernels.triton_rmsnorm (one fused kernel each way)
           ``auto``           triton on CUDA when Triton is installed, else torch

``auto`` for attention resolves to ``sdpa`` on every device, with one exception: on CPU, when
autograd records (training) under bf16/fp16 autocast and nothing is being compiled, it resolves to
``matmul`` — there SDPA's CPU flash backward costs ~6x its forward, and the matmul path (SDPA's
forward + its own block-triangular backward) measured 33 ms vs SDPA's 42 ms per layer (B=16, N=4,
K=2, T=S=256, H=64, one thread; docs/training.md) and 87–103 vs 95–116 ms at T=S=512; at T=S=1024
SDPA is faster (293 vs 329 ms), so beyond ``CPU_TRAINING_MAX_KEYS`` = 512 keys ``auto`` stays on
SDPA (512–1024 is not measured; the cut is at the last length where ``matmul`` was faster).
In fp32, for inference and under torch.compile SDPA stays faster or fuses better.
``model/attention.py`` runs every backend through ``attention()`` below. On CUDA SDPA dispatches to
FlashAttention-2 in CUDA, which the
Triton kernel aims to match (≥ 0.9x) but has not been measured against on this project's
machines, so it is not promoted to the default. Change ``FASTEST_ATTENTION`` once it has.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from lmstack.model.config import ATTN_BACKENDS as ATTENTION_BACKENDS  # noqa: E402 (one source of truth)
from lmstack.model.config import NORM_BACKENDS  # noqa: E402

# device type -> attention backend that "auto" picks (see the module docstring for why)
FASTEST_ATTENTION = {"cpu": "sdpa", "cuda": "sdpa"}
# CPU training under low-precision autocast: the block-triangular matmul attention (module docstring)
CPU_TRAINING_ATTENTION = "matmul"
CPU_TRAINING_MAX_KEYS = 512  # longer key sequences: SDPA's own backward is faster (module docstring)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
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
    return (torch.device(device).type == "cpu" and torch.is_grad_enabled() and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") in (torch.bfloat16, torch.float16)
            and not torch.compiler.is_compiling())


def resolve_attn_backend(name: str, device: torch.device | str, key_len: int | None = None) -> str:
    """Map ``auto`` to a concrete backend for ``device`` (and the autograd/autocast state, and the
    key length S when given); check other names."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend={name!r}; expected one of {ATTENTION_BACKENDS}")
    if name == "auto":
        if cpu_training_autocast(device) and (key_len is None or key_len <= CPU_TRAINING_MAX_KEYS):
            return CPU_TRAINING_ATTENTION
        return FASTEST_ATTENTION.get(torch.device(device).type, "sdpa")
    return name


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
              backend: str = "auto") -> Tensor:
    """softmax(QKᵀ/√H + mask) V through one backend (seed 000 §1.2, §1.3, §2.7).

    q (B, N, T, H), k/v (B, K, S, H); mask: bool, True = may attend, broadcastable to (B, 1, T, S),
    or ``causal=True`` (bottom-right aligned) -> (B, N, T, H). The flash backends take ``causal``
    only. ``model/attention.py`` calls it for every backend.
    """
    backend = resolve_attn_backend(backend, q.device, k.shape[2])
    if mask is not None and causal:
        raise ValueError("give either mask or causal=True, not both")
    if backend == "matmul":
        from lmstack.kernels.matmul_attention import matmul_attention

        return matmul_attention(q, k, v, mask=mask, causal=causal)
    if backend in ("flash_pytorch", "flash_triton"):
        if mask is not None:
            raise ValueError(f"backend={backend!r} takes causal=True, not an explicit mask")
        return flash_attention(q, k, v, causal=causal, backend=backend)
    if backend == "reference":
        from lmstack.model.attention import attention_mask, reference_attention

        if causal:
            T, S = q.shape[2], k.shape[2]
            mask = attention_mask(torch.arange(S - T, S, device=q.device), torch.arange(S, device=q.device))
        return reference_attention(q, k, v, mask)
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


def resolve_norm_backend(name: str, x: Tensor) -> str:
    """Map ``auto`` to ``triton`` for fp32/fp16/bf16 CUDA tensors when Triton is installed, else ``torch``."""
    if name not in NORM_BACKENDS:
        raise ValueError(f"norm backend={name!r}; expected one of {NORM_BACKENDS}")
    if name == "auto":
        ok = x.device.type == "cuda" and x.dtype in _TRITON_DTYPES and triton_usable(x.device)
        return "triton" if ok else "torch"
    return name


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, backend: str = "flash_pytorch",
                    scale: float | None = None, return_lse: bool = False):
    """FlashAttention-2 through the PyTorch or the Triton implementation.

    q (B, N, T, H), k/v (B, K, S, H) -> O (B, N, T, H) [, L (B, N, T)]; causal is bottom-right aligned.
    """
    if backend == "flash_pytorch":
        from lmstack.kernels.flash_pytorch import flash_attention_pytorch

        return flash_attention_pytorch(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    if backend == "flash_triton":
        from lmstack.kernels.flash_triton import flash_attention_triton  # imports triton on first use

        return flash_attention_triton(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    raise ValueError(f"flash backend={backend!r}; expected 'flash_pytorch' or 'flash_triton'")


def rms_norm(x: Tensor, weight: Tensor, eps: float, backend: str = "auto") -> Tensor:
    """RMSNorm (seed 000 §1.10) through the chosen backend; ``torch`` is the model's eager formula."""
    backend = resolve_norm_backend(backend, x)
    if backend == "triton":
        from lmstack.kernels.triton_rmsnorm import rmsnorm_triton

        return rmsnorm_triton(x, weight, eps)
    from lmstack.model.layers import rms_norm as rms_norm_eager

    return rms_norm_eager(x, weight, eps)
