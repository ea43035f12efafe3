"""Communication volumes and times (Book of LLMs §6.2 “collectives”, §6.4, §6.6; CS336 notes "张量并行").

Ring collectives over M devices on n bytes (each device talks only to its two neighbours):
  reduce-scatter  each device sends (M-1)/M · n bytes in M-1 steps
  all-gather      each device sends (M-1)/M · n bytes in M-1 steps
  all-reduce      = reduce-scatter + all-gather: 2(M-1)/M · n bytes in 2(M-1) steps
Time ≈ bytes sent / one-direction link bandwidth (+ a per-step latency α): Book of LLMs §6.2 “collectives”
estimates the cost from the volume and effective bandwidth first.

Per training step (§6.4) on P parameters: DDP all-reduces the gradients; ZeRO-1 and ZeRO-2
reduce-scatter the gradients and all-gather the updated parameters, the same volume as one
all-reduce ("free memory wins"); ZeRO-3 all-gathers the parameters before the forward and again
before the backward, plus the gradient reduce-scatter: 1.5× DDP.
"""

from __future__ import annotations

from lmstack.accounting.precision import bytes_per_element
from lmstack.model.config import ModelConfig


def _check_m(M: int) -> None:
    if M < 1:
        raise ValueError(f"M={M} devices must be >= 1")


def reduce_scatter_bytes(n_bytes: float, M: int) -> float:
    """Book of LLMs §6.2 “collectives”: bytes each device sends in a ring reduce-scatter of n bytes: (M-1)/M · n."""
    _check_m(M)
    return (M - 1) / M * n_bytes


def all_gather_bytes(n_bytes: float, M: int) -> float:
    """Book of LLMs §6.2 “collectives”: bytes each device sends in a ring all-gather producing n bytes: (M-1)/M · n."""
    _check_m(M)
    return (M - 1) / M * n_bytes


def all_reduce_bytes(n_bytes: float, M: int) -> float:
    """Book of LLMs §6.2 “collectives”: ring all-reduce = reduce-scatter + all-gather: 2(M-1)/M · n bytes."""
    return reduce_scatter_bytes(n_bytes, M) + all_gather_bytes(n_bytes, M)


def collective_time(
    sent_bytes: float, bandwidth: float, steps: int = 0, latency_s: float = 0.0
) -> float:
    """α-β estimate: sent bytes / one-direction bandwidth + steps × per-step latency."""
    return sent_bytes / bandwidth + steps * latency_s


def all_reduce_time(n_bytes: float, M: int, bandwidth: float, latency_s: float = 0.0) -> float:
    """Ring all-reduce time: 2(M-1)/M · n / bandwidth + 2(M-1)·α."""
    return collective_time(all_reduce_bytes(n_bytes, M), bandwidth, 2 * (M - 1), latency_s)


def data_parallel_step_bytes(
    n_params: float, M: int, strategy: str, dtype: object = "bf16"
) -> float:
    """Book of LLMs §6.4 “DDP and ZeRO”: bytes each device sends per training step under DDP or ZeRO-1/2/3."""
    n = n_params * bytes_per_element(dtype)
    if strategy in ("ddp", "zero1", "zero2"):
        # DDP: all-reduce grads. ZeRO-1/2: reduce-scatter grads + all-gather params (same volume).
        return reduce_scatter_bytes(n, M) + all_gather_bytes(n, M)
    if strategy == "zero3":
        # all-gather params for forward, again for backward, reduce-scatter grads.
        return 2 * all_gather_bytes(n, M) + reduce_scatter_bytes(n, M)
    raise ValueError(f"strategy={strategy!r}; expected ddp, zero1, zero2 or zero3")


def tp_compute_flops(b: int, s: int, h: int, tp: int) -> float:
    """CS336 notes "张量并行": per-device compute of a layer under TP, 16·b·s·h² / tp."""
    return 16 * b * s * h * h / tp


def tp_comm_volume(b: int, s: int, h: int) -> float:
    """CS336 notes "张量并行": per-device communication of a layer under TP, 4·b·s·h."""
    return 4 * b * s * h


def tp_compute_comm_ratio(h: int, tp: int) -> float:
    """CS336 notes "张量并行": Ratio = (16bsh²/tp) / (4bsh) = 4h/tp — independent of b and s, so a
    bigger batch cannot amortise TP's communication; it needs NVLink-class bandwidth."""
    return 4 * h / tp


def tp_layer_bytes(
    cfg: ModelConfig, B: int, S: int, M: int, dtype: object = "bf16", backward: bool = True
) -> float:
    """Book of LLMs §6.6 “Megatron tensor parallelism”: one all-reduce of the (B, S, D) activations after attention's row-parallel
    W_O and one after the FFN's W_down per layer forward; the backward mirrors them (§6.2: the
    all-reduce's backward is an all-reduce). Bytes each device sends for one layer."""
    n = B * S * cfg.d_model * bytes_per_element(dtype)
    count = 4 if backward else 2
    return count * all_reduce_bytes(n, M)


def moe_all_to_all_bytes(
    cfg: ModelConfig, tokens: int, ep: int, dtype: object = "bf16", backward: bool = True
) -> float:
    """Expert parallelism (CS336 notes "专家并行"): bytes one device sends per step for ``tokens`` local tokens.

    Each MoE layer dispatches every token's hidden state to each of its k experts and combines the k
    outputs back: 2 all-to-alls of tokens·k·D elements, of which (ep−1)/ep leave the device when experts are
    uniformly loaded (the rest are this device's own experts). The backward repeats both in reverse (×2).
    """
    _check_m(ep)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    per_layer = (
        2
        * tokens
        * cfg.n_experts_per_token
        * cfg.d_model
        * bytes_per_element(dtype)
        * (ep - 1)
        / ep
    )
    return moe_layers * per_layer * (2 if backward else 1)
