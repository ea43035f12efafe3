"""Kernels: the attention/RMSNorm registry and runtime config, FlashAttention-2 (tiled PyTorch and
Triton), fused RMSNorm (Triton), benchmarking.

Book of LLMs §2.7 (FlashAttention: tiling + online softmax, exact, O(S) memory), §4.1 (HBM vs SRAM);
CS336 notes "GPU 架构", "优化技巧", "工程细节 / 基准测试", "Triton Kernel", "FlashAttention".

Triton is never imported by ``import lmstack.kernels``: the Triton modules
(``flash_triton``, ``triton_rmsnorm``) load on first use, and every feature has a CPU path.
"""

from lmstack.kernels.backends import (
    ATTENTION,
    ATTENTION_BACKENDS,
    NORM_BACKENDS,
    attention_impl,
    choose_attention,
    choose_norm,
    flash_attention,
    resolve_attn_backend,
    resolve_norm_backend,
    triton_usable,
)
from lmstack.kernels.flash_pytorch import FlashAttentionPyTorch, flash_attention_pytorch
from lmstack.kernels.runtime import RuntimeConfig, configure


def flash_attention_triton(*args, **kwargs):
    """Lazy alias of ``lmstack.kernels.flash_triton.flash_attention_triton`` (imports Triton)."""
    from lmstack.kernels.flash_triton import flash_attention_triton as fn

    return fn(*args, **kwargs)


def rmsnorm_triton(*args, **kwargs):
    """Lazy alias of ``lmstack.kernels.triton_rmsnorm.rmsnorm_triton`` (imports Triton)."""
    from lmstack.kernels.triton_rmsnorm import rmsnorm_triton as fn

    return fn(*args, **kwargs)


__all__ = [
    "ATTENTION",
    "ATTENTION_BACKENDS",
    "NORM_BACKENDS",
    "FlashAttentionPyTorch",
    "RuntimeConfig",
    "attention_impl",
    "choose_attention",
    "choose_norm",
    "configure",
    "flash_attention",
    "flash_attention_pytorch",
    "flash_attention_triton",
    "resolve_attn_backend",
    "resolve_norm_backend",
    "rmsnorm_triton",
    "triton_usable",
]
