"""Parameter counts (Book of LLMs §1.4 “parameter count”; CS336 notes "性能指标分析" Param formula).

Book of LLMs §1.4 “parameter count”, per component of the dense decoder (symbols of §1.1):
  embedding V·D; attention D·NH (W_Q) + 2·D·KH (W_K, W_V) + NH·D (W_O) = 2D² + 2DKH when NH = D;
  FFN 3·D·F (gate, up, down); RMSNorm gammas 2D per layer plus the final D; unembedding V·D.
  Total 2VD + L(4D² + 2D + 3DF) for MHA (K = N) with untied embeddings.
This module generalises it to GQA/MQA (K < N), H ≠ D/N, tied embeddings, q/k/v biases
(Qwen2), QK-norm gammas (H each for q and k), and layer by layer to every token mixer and block variant:
each layer's mixer counts itself (``lmstack.model.mixer_spec``: MLA, local / linear attention, Mamba-2,
Gated DeltaNet, DSA, the output gate), a block without FFN (Mamba-2) or with one shared norm (GPT-J's
parallel block) or Gemma's sandwich norms counts what it holds, so that ``total_params`` equals
``sum(p.numel())`` of the built model (tests/model/test_mixer_spec.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lmstack.model.config import ModelConfig
from lmstack.model.mixer_spec import (
    attention_kind,
    attention_params,
    layer_kinds,
    layer_specs,
    mla_params,
    spec,
)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters per component, summed over all L layers (Book of LLMs §1.4 “parameter count”)."""

    embedding: int  # V·D
    attention: int  # every layer's token mixer: L·(D·NH + 2·D·KH + NH·D [+ NH + 2KH biases]) for softmax attention
    ffn: int  # L·3DF (0 in a layer without FFN)
    norms: int  # L·2D + D [+ L·2H for QK-norm]; per layer what the block holds
    unembedding: int  # V·D, or 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.ffn + self.norms + self.unembedding

    @property
    def non_embedding(self) -> int:
        """Parameters outside the embedding and unembedding tables."""
        return self.attention + self.ffn + self.norms

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total, "non_embedding": self.non_embedding}


def embedding_params(cfg: ModelConfig) -> int:
    """Book of LLMs §1.4 “parameter count”: W_e is (V, D), V·D parameters."""
    return cfg.vocab_size * cfg.d_model


def unembedding_params(cfg: ModelConfig) -> int:
    """Book of LLMs §1.4 “parameter count”: W_u is (D, V), V·D parameters; none of its own when tied to W_e."""
    return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model


def attention_params_per_layer(cfg: ModelConfig) -> int:
    """Book of LLMs §1.4 “parameter count”: W_Q (D, NH), W_K (D, KH), W_V (D, KH), W_O (NH, D) = 2D² + 2DKH when NH = D.

    CS336 notes "性能指标分析" writes the same as DNH + 2DKH + DNH. With ``qkv_bias`` the q, k, v
    projections carry NH + 2KH biases.
    """
    return spec(attention_kind(cfg)).params(
        cfg
    )  # model.mixer_spec: softmax attention's or MLA's count


def ffn_params_per_layer(cfg: ModelConfig) -> int:
    """Book of LLMs §1.4 “parameter count”: W_up (D, F), W_gate (D, F), W_down (F, D) = 3DF."""
    return 3 * cfg.d_model * cfg.d_ff


def norm_params_per_layer(cfg: ModelConfig) -> int:
    """Book of LLMs §1.4 “parameter count”: two RMSNorm gammas of D per layer (pre-attention, pre-FFN), plus 2H for QK-norm
    (a softmax-attention layer of the Llama block; ``layer_norm_params`` counts any layer)."""
    return 2 * cfg.d_model + spec(attention_kind(cfg)).norm_params(
        cfg
    )  # QK-norm, or MLA's latent norms


def layer_norm_params(cfg: ModelConfig, layer_idx: int) -> int:
    """Layer ``layer_idx``'s RMSNorm gammas: D before the mixer; D before the FFN (none in GPT-J's parallel block,
    which shares the first, or in a block without FFN); Gemma's sandwich norms D after each branch; and the
    mixer's own (QK-norm, MLA's latent norms: ``MixerSpec.norm_params``)."""
    D = cfg.d_model
    ffn = cfg.block_ffn
    block = (
        D
        + (D if ffn and not cfg.parallel_block else 0)
        + ((D + (D if ffn else 0)) if cfg.sandwich_norm else 0)
    )
    return block + layer_specs(cfg)[layer_idx].norm_params(cfg)


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Exact parameter count of the lmstack Transformer for ``cfg``, by component (Book of LLMs §1.4 “parameter count”), layer by layer."""
    L = cfg.n_layers
    return ParamCounts(
        embedding=embedding_params(cfg),
        attention=sum(s.params(cfg) for s in layer_specs(cfg)),
        ffn=sum(layer_ffn_params(cfg, i) for i in range(L)),
        norms=sum(layer_norm_params(cfg, i) for i in range(L)) + cfg.d_model,  # + final norm D
        unembedding=unembedding_params(cfg),
    )


def total_params(cfg: ModelConfig) -> int:
    """Book of LLMs §1.4 “parameter count” P_total, generalised; equals sum(p.numel()) of the model."""
    return param_counts(cfg).total


def seed_total_params(V: int, D: int, L: int, F: int) -> int:
    """Book of LLMs §1.4 “parameter count” verbatim: P_total = 2VD + L(4D² + 2D + 3DF) (MHA, untied, H = D/N)."""
    return 2 * V * D + L * (4 * D * D + 2 * D + 3 * D * F)


def matmul_params(cfg: ModelConfig) -> int:
    """CS336 notes "性能指标分析": Param = 2VD + 3DFL + (DNH + 2DKH + DNH)L.

    The weights a decoding step streams from HBM: embedding and LM head (V·D once when tied),
    MLP and attention matrices; norms and biases are left out as the seed does (they are
    0.003 % of Llama-2-13B). For Llama-2-13B this is 13,015,449,600.
    """
    D, F, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    vocab = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * D
    return vocab + 3 * D * F * L + (D * N * H + 2 * D * K * H + D * N * H) * L


@dataclass(frozen=True)
class MoEParams:
    total: int  # every expert counted
    active: int  # what one token uses: shared experts + top_k routed experts + the rest


def moe_params(
    cfg: ModelConfig,
    n_experts: int,
    top_k: int,
    n_shared_experts: int = 0,
    expert_d_ff: int | None = None,
    moe_layers: int | None = None,
) -> MoEParams:
    """Total vs active parameters when each FFN becomes a mixture of experts (CS336 notes "MoE").

    Each MoE layer holds ``n_experts`` routed SwiGLU experts of hidden size F_e (3·D·F_e each),
    ``n_shared_experts`` always-on experts of the same size, and a router (D, n_experts).
    A token runs the shared experts and its ``top_k`` routed experts, so
    active = total - (n_experts - top_k)·3·D·F_e per MoE layer.
    """
    if not (0 < top_k <= n_experts):
        raise ValueError(f"top_k={top_k} must be in 1..n_experts={n_experts}")
    D = cfg.d_model
    Fe = expert_d_ff or cfg.d_ff
    n_moe = cfg.n_layers if moe_layers is None else moe_layers
    if not (0 <= n_moe <= cfg.n_layers):
        raise ValueError(f"moe_layers={moe_layers} must be in 0..n_layers={cfg.n_layers}")
    dense = param_counts(cfg)
    expert = 3 * D * Fe
    per_moe_layer = (n_experts + n_shared_experts) * expert + D * n_experts
    total = dense.total - n_moe * ffn_params_per_layer(cfg) + n_moe * per_moe_layer
    active = total - n_moe * (n_experts - top_k) * expert
    return MoEParams(total=total, active=active)


# ---- mixture of experts / MLA (model/moe.py, model/mla.py) ------------------------------------------
def mla_params_per_layer(cfg: ModelConfig) -> int:
    """MLA projections (CS336 notes "有损提速"): q = D·N(H_n+d_R) (or D·d_c' + d_c'·N(H_n+d_R) compressed),
    [W_DKV; W_KR] D·(d_c + d_R), [W_UK; W_UV] d_c·N(H_n + H_v), W_O N·H_v·D (norm gammas: ``norms``);
    the formula is ``model.mixer_spec.mla_params``, the MLA spec's count."""
    return mla_params(cfg)


def expert_params(cfg: ModelConfig) -> int:
    """One routed expert: a SwiGLU of hidden size F_e, 3·D·F_e."""
    return 3 * cfg.d_model * (cfg.d_ff_expert or cfg.d_ff)


def layer_ffn_params(cfg: ModelConfig, layer_idx: int) -> int:
    """Layer ``layer_idx``'s FFN: dense 3DF, or E routed experts + router (E·D, + E aux-free biases)
    + shared experts 3·D·F_shared (+ D for Qwen-MoE's shared-expert gate); 0 in a block without FFN (Mamba-2)."""
    if not cfg.block_ffn:
        return 0
    if not cfg.is_moe_layer(layer_idx):
        return ffn_params_per_layer(cfg)
    D, E = cfg.d_model, cfg.n_experts
    p = E * expert_params(cfg) + E * D + (E if cfg.router_aux_free_bias else 0)
    if cfg.n_shared_experts:
        p += 3 * D * (cfg.d_ff_shared or cfg.n_shared_experts * (cfg.d_ff_expert or cfg.d_ff))
        p += D if cfg.shared_expert_gate else 0
    return p


def moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses (CS336 notes "MoE", the routed/active/shared table): the total minus the
    (E − k) routed experts it skips in every MoE layer. Equals ``total_params`` for a dense model."""
    return total_params(cfg) - moe_layers(cfg) * (
        cfg.n_experts - cfg.n_experts_per_token
    ) * expert_params(cfg)


def moe_summary(cfg: ModelConfig) -> dict[str, int | float]:
    """The seed's routed / active / shared table row for ``cfg``, with total and active parameters."""
    Fe = cfg.d_ff_expert or cfg.d_ff
    return {
        "routed": cfg.n_experts,
        "active": cfg.n_experts_per_token,
        "shared": cfg.n_shared_experts,
        "fine_grained_ratio": Fe / cfg.d_ff if cfg.n_experts else 1.0,
        "moe_layers": moe_layers(cfg),
        "total_params": total_params(cfg),
        "active_params": active_params(cfg),
    }


def expected_experts_touched(n_experts: int, k: int, tokens: int) -> float:
    """Expected number of distinct routed experts a batch of ``tokens`` tokens uses in one MoE layer when
    each token picks k of E uniformly (a given expert is missed by one token with probability 1 − k/E):
    E·(1 − (1 − k/E)^tokens). 1 token: k; many tokens: → E."""
    if not 1 <= k <= n_experts:
        raise ValueError(f"experts per token k={k} must be between 1 and n_experts={n_experts}")
    if tokens < 0:
        raise ValueError(f"tokens={tokens} must be >= 0")
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


def decode_params(cfg: ModelConfig, tokens: int | None = 1) -> float:
    """The matrix weights one forward step over ``tokens`` tokens streams (the decode roofline's Param).

    A dense model of softmax-attention layers: ``matmul_params`` (the seed's formula, unchanged). Otherwise the
    same convention (embedding and LM head, mixer and FFN matrices; norms and biases left out) counted from the
    real layer shapes: each layer's mixer as its spec counts it (``model.mixer_spec``: MLA projections, a
    recurrent mixer's projections with its few per-head vectors, the output gate); no FFN in a block without
    one; per MoE layer the router E·D, the shared
    experts 3·D·F_shared (+ D for Qwen's shared gate), and only the routed experts the batch touches —
    ``expected_experts_touched(E, k, tokens)``·3·D·F_e, k experts for B = 1, all E for a large batch.
    ``tokens=None``: every expert (the matrices that must be resident).
    """
    plain = set(layer_kinds(cfg)) == {"attention"} and cfg.block_ffn and not cfg.attn_output_gate
    if not cfg.n_experts and plain:
        return float(matmul_params(cfg))
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    vocab = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * D
    bias = (N * H * (2 if cfg.attn_output_gate else 1) + 2 * K * H) if cfg.qkv_bias else 0
    total: float = vocab + sum(
        s.params(cfg) - (bias if s.params is attention_params else 0) for s in layer_specs(cfg)
    )
    E = cfg.n_experts
    touched = (
        E
        if tokens is None or not E
        else expected_experts_touched(E, cfg.n_experts_per_token, tokens)
    )
    for i in range(cfg.n_layers):
        if not cfg.block_ffn:
            continue
        if not cfg.is_moe_layer(i):
            total += 3 * D * cfg.d_ff
            continue
        total += cfg.n_experts * D + touched * expert_params(cfg)
        if cfg.n_shared_experts:
            total += (
                3 * D * (cfg.d_ff_shared or cfg.n_shared_experts * (cfg.d_ff_expert or cfg.d_ff))
            )
            total += D if cfg.shared_expert_gate else 0
    return total
