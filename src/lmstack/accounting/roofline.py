"""Roofline of decoding and prefill (CS336 notes "性能指标分析", Book of LLMs §2.1 “latency and throughput”).

Decoding is memory-bound (CS336 notes "计算强度分析"), so a step's time is the bytes it must read
divided by the memory bandwidth; only the weights and the KV cache are counted (fused kernels
make the rest a few per mille):

  Latency    = (Param·P + Memory_KV) / Mem_bandwidth          seconds per generated token
  Throughput = B / Latency                                    tokens/s over the batch

Book of LLMs §2.1 “latency and throughput” defines latency (time of one request's step) and throughput (tokens/s over all
requests). Growing B raises both: the trade-off the batch sweep shows. Time to first token
(CS336 notes "推理"): the prefill's time plus one decoding step; prefill time is the roofline
max(FLOPs / peak, bytes / bandwidth).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from lmstack.accounting.flops import forward_flops, unembedding_flops
from lmstack.accounting.hardware import Hardware
from lmstack.accounting.memory import kv_cache_bytes
from lmstack.accounting.params import decode_params
from lmstack.accounting.precision import bytes_per_element
from lmstack.model.config import ModelConfig
from lmstack.utils import pyplot, save_png


@dataclass(frozen=True)
class DecodePoint:
    B: int
    S: int
    num_params: (
        float  # CS336 notes Param (matrices read by the step; expected experts touched for an MoE)
    )
    memory_bytes: float  # Param·P + Memory_KV
    latency_s: float  # memory_bytes / bandwidth
    throughput_tok_s: float  # B / latency
    flops: float  # FLOPs of the step (T = 1)
    compute_s: float  # flops / peak
    intensity: float  # flops / memory_bytes
    fits: bool  # every weight matrix (all experts) + the KV cache <= HBM size

    @property
    def bound(self) -> str:
        return "compute-bound" if self.compute_s > self.latency_s else "memory-bound"

    @property
    def roofline_latency_s(self) -> float:
        """max(memory time, compute time): the seed's latency unless B is large enough to hit the ridge."""
        return max(self.latency_s, self.compute_s)

    def to_dict(self) -> dict:
        return {**asdict(self), "bound": self.bound, "roofline_latency_s": self.roofline_latency_s}


def decode_latency(weight_bytes: float, kv_bytes: float, bandwidth: float) -> float:
    """CS336 notes "性能指标分析": Latency = (Param + Memory_KV) / Mem_bandwidth."""
    return (weight_bytes + kv_bytes) / bandwidth


def decode_throughput(B: int, latency_s: float) -> float:
    """CS336 notes "性能指标分析": Throughput = B / Latency."""
    return B / latency_s


def decode_point(
    cfg: ModelConfig, hw: Hardware, B: int, S: int, dtype: object = "bf16"
) -> DecodePoint:
    """One decoding step of B sequences with S cached positions each (CS336 notes table row). A mixture of
    experts reads only the experts its B tokens touch (``params.decode_params``)."""
    params = decode_params(cfg, B)
    kv = kv_cache_bytes(cfg, B, S, dtype, cfg.sliding_window)
    memory = params * bytes_per_element(dtype) + kv
    lat = decode_latency(params * bytes_per_element(dtype), kv, hw.hbm_bandwidth)
    fl = forward_flops(cfg, B, S, T=1, window=cfg.sliding_window)
    comp = fl / hw.flops(dtype)
    return DecodePoint(
        B=B,
        S=S,
        num_params=params,
        memory_bytes=memory,
        latency_s=lat,
        throughput_tok_s=decode_throughput(B, lat),
        flops=fl,
        compute_s=comp,
        intensity=fl / memory,
        fits=decode_params(cfg, None) * bytes_per_element(dtype) + kv <= hw.hbm_bytes,
    )


def decode_sweep(
    cfg: ModelConfig, hw: Hardware, batches, S: int, dtype: object = "bf16"
) -> list[DecodePoint]:
    """The latency/throughput trade-off over batch sizes (CS336 notes Llama-2-13B table)."""
    return [decode_point(cfg, hw, int(b), S, dtype) for b in batches]


@dataclass(frozen=True)
class PrefillPoint:
    B: int
    S: int
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    prefill_s: float
    ttft_s: float
    intensity: float

    @property
    def bound(self) -> str:
        return "compute-bound" if self.compute_s >= self.memory_s else "memory-bound"

    def to_dict(self) -> dict:
        return {**asdict(self), "bound": self.bound}


def prefill_point(
    cfg: ModelConfig, hw: Hardware, B: int, S: int, dtype: object = "bf16"
) -> PrefillPoint:
    """Prefill of B prompts of S tokens: all-position forward without logits, plus the last
    position's logits; it reads the weights once and writes the KV cache. TTFT = prefill +
    one decoding step (CS336 notes "推理": 首 Token 延迟)."""
    P = bytes_per_element(dtype)
    fl = forward_flops(cfg, B, S, logits=False, window=cfg.sliding_window) + unembedding_flops(
        cfg, B, 1
    )
    moved = decode_params(cfg, B * S) * P + kv_cache_bytes(cfg, B, S, dtype, cfg.sliding_window)
    comp = fl / hw.flops(dtype)
    mem = moved / hw.hbm_bandwidth
    pre = max(comp, mem)
    ttft = pre + decode_point(cfg, hw, B, S, dtype).roofline_latency_s
    return PrefillPoint(
        B=B,
        S=S,
        flops=fl,
        bytes=moved,
        compute_s=comp,
        memory_s=mem,
        prefill_s=pre,
        ttft_s=ttft,
        intensity=fl / moved,
    )


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: min(peak, intensity × bandwidth)."""
    return min(peak_flops, intensity * bandwidth)


def plot_roofline(
    hw: Hardware,
    points: list[tuple[str, float]],
    path,
    dtype: object = "bf16",
    title: str | None = None,
) -> None:
    """Draw ``hw``'s roofline (log-log) with labelled (name, intensity) points; write a PNG atomically."""
    plt = pyplot()

    peak, bw = hw.flops(dtype), hw.hbm_bandwidth
    ridge = peak / bw
    lo = min([0.1] + [p[1] / 3 for p in points])
    hi = max([ridge * 30] + [p[1] * 3 for p in points])
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    y = np.minimum(peak, x * bw)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.loglog(x, y, color="black", lw=2, label=f"{hw.name} roofline ({dtype})")
    ax.axvline(ridge, color="gray", ls="--", lw=1)
    ax.text(ridge, peak * 0.5, f" ridge {ridge:.0f} FLOPs/B", color="gray", va="top")
    markers = "osD^v<>p*h"
    for i, (name, inten) in enumerate(points):
        ax.plot(
            [inten],
            [attainable_flops(inten, peak, bw)],
            markers[i % len(markers)],
            ms=7,
            alpha=0.85,
            label=f"{name} (I={inten:.3g})",
        )
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(title or f"roofline: {hw.name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
