"""Arithmetic intensity and the memory- vs compute-bound verdict (CS336 notes "计算强度分析",
"推理时注意力开销").

Arithmetic intensity I = FLOPs / bytes moved between HBM and the chip. A kernel whose I is
below the device's ridge point (peak FLOP/s / bandwidth; H100 ≈ 295) is memory-bound.

FFN (CS336 notes): reads X (B,T,D) and W_u, W_g, W_d; writes U and G (B,T,F); writes the output
(B,T,D) — the re-read of U and G is fused away. Bytes P·(2BTD + 2BTF + 3DF), FLOPs 6BTDF;
at F = 4D and bf16 (P = 2) that is 24BTD² / (20BTD + 24D²) = 6BTD / (5BT + 6D).

Attention with FlashAttention (CS336 notes): reads X and W_Q, W_K, W_V; writes the new K, V
to the cache and the output O; reads the whole cache K_all, V_all of S positions.
Bytes P·(BTD + D(NH + 2KH) + 2BT·KH + BT·NH + 2BS·KH), FLOPs 2BTD(NH + 2KH) + 4BTS·NH;
at K = N, NH = D, P = 2 that is (6BTD² + 4BTSD) / (8BTD + 6D² + 4BSD)
= (3D/S + 2) / (4/S + 3D/(BTS) + 2/T).
"""

from __future__ import annotations

from lmstack.accounting.hardware import Hardware
from lmstack.accounting.params import expected_experts_touched
from lmstack.accounting.precision import bytes_per_element
from lmstack.model.config import ModelConfig


def ffn_flops_bytes(
    cfg: ModelConfig, B: int, T: int, dtype: object = "bf16"
) -> tuple[float, float]:
    """CS336 notes "计算强度分析": (FLOPs, bytes) of one SwiGLU FFN on T tokens.

    A mixture of experts (``cfg.n_experts``): the routed experts of one MoE layer — the B·T·k assignments each
    read their row and write U, G and the output (2·BTk·D + 2·BTk·F_e), and only the experts the batch touches
    are read (``expected_experts_touched``·3·D·F_e): FLOPs 6·BTk·D·F_e; shared experts add a dense FFN of width
    F_s. At decode the expert weights dominate the
    bytes, so I ≈ 2·B·k / (P·touched): 1 FLOP/byte at B = 1 in bf16 like a dense FFN, but k/E of the dense FFN's
    intensity once the batch touches every expert."""
    P = bytes_per_element(dtype)
    D = cfg.d_model
    if cfg.n_experts:
        k, Fe = cfg.n_experts_per_token, cfg.d_ff_expert or cfg.d_ff
        a = B * T * k  # assignments
        touched = expected_experts_touched(cfg.n_experts, k, B * T)
        flops, nbytes = 6 * a * D * Fe, P * (2 * a * D + 2 * a * Fe + touched * 3 * D * Fe)
        if cfg.n_shared_experts:  # always-on experts: a dense FFN of width F_s on every token
            Fs = cfg.d_ff_shared or cfg.n_shared_experts * Fe
            flops += 6 * B * T * D * Fs
            nbytes += P * (2 * B * T * D + 2 * B * T * Fs + 3 * D * Fs)
        return flops, nbytes
    F = cfg.d_ff
    return 6 * B * T * D * F, P * (2 * B * T * D + 2 * B * T * F + 3 * D * F)


def ffn_intensity(cfg: ModelConfig, B: int, T: int, dtype: object = "bf16") -> float:
    """CS336 notes "计算强度分析": FFN intensity, 6BTD/(5BT + 6D) at F = 4D in bf16."""
    f, b = ffn_flops_bytes(cfg, B, T, dtype)
    return f / b


def seed_ffn_intensity(B: int, T: int, D: int) -> float:
    """CS336 notes verbatim: I = 6BTD / (5BT + 6D) FLOPs/byte (F = 4D, bf16)."""
    return 6 * B * T * D / (5 * B * T + 6 * D)


def attention_flops_bytes(
    cfg: ModelConfig, B: int, T: int, S: int, dtype: object = "bf16"
) -> tuple[float, float]:
    """CS336 notes "计算强度分析": (FLOPs, bytes) of the QKV projections + FlashAttention over S keys."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    P = bytes_per_element(dtype)
    flops = 2 * B * T * D * (N * H + 2 * K * H) + 4 * B * T * S * N * H
    moved = (
        B * T * D + D * (N * H + 2 * K * H) + 2 * B * T * K * H + B * T * N * H + 2 * B * S * K * H
    )
    return flops, P * moved


def attention_intensity(cfg: ModelConfig, B: int, T: int, S: int, dtype: object = "bf16") -> float:
    """CS336 notes "计算强度分析": attention intensity, generalised to GQA (K < N) and any P."""
    f, b = attention_flops_bytes(cfg, B, T, S, dtype)
    return f / b


def seed_attention_intensity(B: int, T: int, S: int, D: int) -> float:
    """CS336 notes verbatim: I = (3D/S + 2) / (4/S + 3D/(BTS) + 2/T) (MHA, bf16)."""
    return (3 * D / S + 2) / (4 / S + 3 * D / (B * T * S) + 2 / T)


def verdict(intensity: float, ridge: float) -> str:
    """Below the ridge point a kernel waits on memory; above it, on the ALUs."""
    return "compute-bound" if intensity >= ridge else "memory-bound"


def phase_verdicts(
    cfg: ModelConfig, hw: Hardware, B: int, S: int, dtype: object = "bf16"
) -> dict[str, dict]:
    """Prefill (T = S, a context of S) and decode (T = 1 against S cached keys): FFN and
    attention intensities against ``hw``'s ridge point (CS336 notes "计算强度分析")."""
    ridge = hw.ridge_point(dtype)
    out: dict[str, dict] = {"ridge_point": {"value": ridge}}
    for phase, T in (("prefill", S), ("decode", 1)):
        fi = ffn_intensity(cfg, B, T, dtype)
        ai = attention_intensity(cfg, B, T, S, dtype)
        out[phase] = {
            "T": T,
            "ffn_intensity": fi,
            "ffn": verdict(fi, ridge),
            "attention_intensity": ai,
            "attention": verdict(ai, ridge),
        }
    return out
