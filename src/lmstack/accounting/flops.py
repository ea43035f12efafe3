"""Forward/backward FLOPs and MFU (Book of LLMs §1.6 “forward and backward FLOPs”, §1.9; CS336 notes "可用资源盘点", "张量计算").

A (m, k) @ (k, n) product costs 2·m·k·n FLOPs (CS336 notes "张量计算"). Counting every matmul of
the forward pass (Book of LLMs §1.6 “forward and backward FLOPs”, prefill so T = S):

  attention per layer  Q 2BSD·NH, K and V 2BSD·KH each, QKᵀ 2BNS²H, A·V 2BNS²H, O 2BS·NH·D
                       = 8BSD² + 4BS²D for MHA with NH = D
  FFN per layer        6BSDF  (= 16BSD² at F = 8/3·D)
  unembedding          2BSDV
  forward              2LBSD(12D + 2S) + 2BSDV at K = N, F = 8/3·D
  backward             2 × forward;  one training step = 3 × forward

Norms, RoPE, softmax and the residual adds are O(BSD) and not counted (as in the seed).
The functions take T query tokens attending to S keys, so decoding (T = 1) uses them too; the
attention matrices are counted in full (B, N, T, S), the way a dense kernel computes them. Pass
``window`` for sliding-window attention (Book of LLMs §1.9 “sliding-window and sparse attention”): each query sees at most W keys, O(nW).
Layer by layer, each layer's token mixer counts itself (``lmstack.model.mixer_spec``: local attention's
own window, MLA, DSA, linear attention, Mamba-2, Gated DeltaNet) and its FFN costs its active weights
(none in a block without FFN), so a hybrid's count follows its ``layer_types``.
"""

from __future__ import annotations

from lmstack.accounting.params import active_params, layer_ffn_params
from lmstack.model.config import ModelConfig
from lmstack.model.mixer_spec import attended_keys, attention_kind, layer_specs, spec

__all__ = [
    "attended_keys"
]  # re-exported: Book of LLMs §1.9 “sliding-window and sparse attention”, min(S, W) keys


def attention_projection_flops(cfg: ModelConfig, B: int, T: int) -> int:
    """Book of LLMs §1.6 “forward and backward FLOPs”: Q, K, V and O projections of T tokens: 2BT·D·NH + 2·2BT·D·KH + 2BT·NH·D (MLA: every weight
    one multiply-add per token; the output gate's projection with ``attn_output_gate``) — the spec's count."""
    return spec(attention_kind(cfg)).flops(cfg, B, T, T, None)[0]


def attention_score_flops(
    cfg: ModelConfig, B: int, T: int, S: int, window: int | None = None
) -> int:
    """Book of LLMs §1.6 “forward and backward FLOPs”: QKᵀ (B,N,T,H)x(B,N,H,S) 2BNTSH plus A·V 2BNTSH = 4BNTSH (= 4BS²D at T = S); MLA's expanded
    form: QKᵀ over H_n + d_R, A·V over H_v."""
    return spec(attention_kind(cfg)).flops(cfg, B, T, S, window)[1]


def layer_ffn_flops(cfg: ModelConfig, layer_idx: int, B: int, T: int) -> int:
    """Layer ``layer_idx``'s FFN: dense 6BTDF; MoE 2BT × its active weights (``moe_ffn_flops``); none without FFN."""
    if not cfg.block_ffn:
        return 0
    if not cfg.is_moe_layer(layer_idx):
        return ffn_flops(cfg, B, T)
    skipped = (
        (cfg.n_experts - cfg.n_experts_per_token) * 3 * cfg.d_model * (cfg.d_ff_expert or cfg.d_ff)
    )
    bias = cfg.n_experts if cfg.router_aux_free_bias else 0
    return 2 * B * T * (layer_ffn_params(cfg, layer_idx) - skipped - bias)


def ffn_flops(cfg: ModelConfig, B: int, T: int) -> int:
    """Book of LLMs §1.6 “forward and backward FLOPs”: up, gate, down projections, 3 × 2BTDF = 6BTDF."""
    return 6 * B * T * cfg.d_model * cfg.d_ff


def unembedding_flops(cfg: ModelConfig, B: int, T: int) -> int:
    """Book of LLMs §1.6 “forward and backward FLOPs”: (B, T, D) x (D, V) -> 2BTDV."""
    return 2 * B * T * cfg.d_model * cfg.vocab_size


def layer_forward_flops(
    cfg: ModelConfig, B: int, T: int, S: int | None = None, window: int | None = None
) -> int:
    """Book of LLMs §1.6 "每层总计": attention + FFN of one layer; 2BSD(12D + 2S) at K = N, F = 8/3·D."""
    S = T if S is None else S
    return (
        attention_projection_flops(cfg, B, T)
        + attention_score_flops(cfg, B, T, S, window)
        + ffn_flops(cfg, B, T)
    )


def forward_flops(
    cfg: ModelConfig,
    B: int,
    S: int,
    T: int | None = None,
    window: int | None = None,
    logits: bool = True,
) -> int:
    """Book of LLMs §1.6 “forward and backward FLOPs”: forward FLOPs = L·layer + 2BTDV; 2LBSD(12D + 2S) + 2BSDV for prefill (T = S).

    ``T`` query tokens (default S: prefill) attend to ``S`` keys; T = 1 is one decoding step.
    ``logits=False`` drops the unembedding (a prefill that only needs the last position's logits
    would instead add ``unembedding_flops(cfg, B, 1)``).
    """
    T = S if T is None else T
    total = 0
    for i, s in enumerate(
        layer_specs(cfg)
    ):  # each layer's mixer (model.mixer_spec) and FFN (MoE: active weights)
        total += sum(s.flops(cfg, B, T, S, window)) + layer_ffn_flops(cfg, i, B, T)
    if logits:
        total += unembedding_flops(cfg, B, T)
    return total


def seed_forward_flops(B: int, S: int, D: int, L: int, V: int) -> int:
    """Book of LLMs §1.6 “forward and backward FLOPs” verbatim (MHA, F = 8/3·D, T = S): 2LBSD(12D + 2S) + 2BSDV."""
    return 2 * L * B * S * D * (12 * D + 2 * S) + 2 * B * S * D * V


def backward_flops(forward: float) -> float:
    """Book of LLMs §1.6 “forward and backward FLOPs”, CS336 notes "张量计算": backward ≈ 2 × forward (gradients w.r.t. inputs and weights)."""
    return 2 * forward


def training_step_flops(cfg: ModelConfig, B: int, S: int, recompute: bool = False) -> int:
    """Forward + backward = 3 × forward; activation checkpointing re-runs the forward once more (§1.8)."""
    f = forward_flops(cfg, B, S)
    return (4 if recompute else 3) * f


def six_nd(n_params: float, n_tokens: float) -> float:
    """The 6ND rule: training FLOPs ≈ 6 × parameters × tokens (2 forward + 4 backward per weight)."""
    return 6 * n_params * n_tokens


def six_nd_vs_exact(cfg: ModelConfig, B: int, S: int) -> dict[str, float]:
    """Compare 6·P·BS with the exact 3 × forward count; the gap is the S² attention term
    (not in 6ND) minus the embedding lookup (in P but costing no matmul)."""
    approx = six_nd(active_params(cfg), B * S)  # N_active: the total for a dense model
    exact = 3 * forward_flops(cfg, B, S)
    return {"six_nd": approx, "exact": exact, "ratio_exact_over_6nd": exact / approx}


def attention_share(cfg: ModelConfig, B: int, S: int, window: int | None = None) -> float:
    """Fraction of forward FLOPs in the S² terms (QKᵀ and A·V) of the layers that attend over keys (a hybrid's
    recurrent layers have none); it grows with S (Book of LLMs §1.6 “forward and backward FLOPs”)."""
    att = sum(s.flops(cfg, B, S, S, window)[1] for s in layer_specs(cfg) if s.cache != "state")
    return att / forward_flops(cfg, B, S, window=window)


def mfu(flops_per_step: float, step_time_s: float, peak_flops: float, n_devices: int = 1) -> float:
    """CS336 notes "可用资源盘点" MFU: model FLOPs achieved per second / peak FLOP/s of the devices."""
    if step_time_s <= 0:
        raise ValueError(f"step_time_s={step_time_s} must be > 0")
    return flops_per_step / step_time_s / (peak_flops * n_devices)


def moe_ffn_flops(cfg: ModelConfig, B: int, T: int) -> int:
    """All layers' FFN forward FLOPs with MoE: a dense layer 6BTDF; an MoE layer 2BT × (router E·D + k routed
    experts 3·D·F_e + shared experts), i.e. 2 FLOPs per *active* weight (CS336 notes "MoE")."""
    return sum(layer_ffn_flops(cfg, i, B, T) for i in range(cfg.n_layers))
