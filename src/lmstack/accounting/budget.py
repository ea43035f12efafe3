"""Resource budgets (CS336 notes "可用资源盘点"): from FLOP/s, time, data and memory to what can be trained.

CS336 notes frames accounting as estimating the training time from the resources at hand, or the
largest model they can train. With training FLOPs ≈ 6ND (Book of LLMs §1.6 “forward and backward FLOPs”: forward 2ND, backward
4ND) and an achieved fraction MFU of the devices' peak:

  time        = 6·N·D_tokens / (MFU · peak · devices)
  tokens      = time · MFU · peak · devices / (6N)
  max params  = memory / bytes per parameter  (18 for mixed-precision AdamW, Book of LLMs §1.8 “training memory”)
"""

from __future__ import annotations


def training_time_s(
    n_params: float, n_tokens: float, peak_flops: float, n_devices: int = 1, mfu: float = 0.4
) -> float:
    """CS336 notes "可用资源盘点": seconds to train N parameters on D tokens at a given MFU."""
    if not (0 < mfu <= 1):
        raise ValueError(f"mfu={mfu} must be in (0, 1]")
    return 6 * n_params * n_tokens / (mfu * peak_flops * n_devices)


def trainable_tokens(
    n_params: float, seconds: float, peak_flops: float, n_devices: int = 1, mfu: float = 0.4
) -> float:
    """CS336 notes "可用资源盘点": tokens a time budget buys for an N-parameter model."""
    if not (0 < mfu <= 1):
        raise ValueError(f"mfu={mfu} must be in (0, 1]")
    return seconds * mfu * peak_flops * n_devices / (6 * n_params)


def max_params_for_memory(memory_bytes: float, bytes_per_param: float = 18.0) -> float:
    """CS336 notes "可用资源盘点" / Book of LLMs §1.8 “training memory”: the largest model whose weights, gradients and
    optimizer states fit (activations not included): 18 bytes per parameter for mixed-precision
    AdamW (4 master + 2 bf16 copy + 8 moments + 4 gradients), 2 for bf16 inference."""
    return memory_bytes / bytes_per_param
