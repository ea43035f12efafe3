"""Per-mixer accounting: parameters, decode FLOPs per token, and cache bytes per sequence (KV or state).

Seed 001 "注意力机制" (linear attention, Mamba-2, Gated DeltaNet, hybrids, DSA: O(n²) → O(n)),
"推理时注意力开销" (one full-attention layer in four or six); seed 000 §1.9, §2.5 (a local layer keeps W
positions). For one sequence at context S, layer by layer (``config.mixer_types``):

  attention           KV 2·K·H·S elements          FLOPs/token  proj + 4·N·H·S
  local_attention     KV 2·K·H·min(S, W)            proj + 4·N·H·min(S, W)
  dsa                 KV 2·K·H·S + indexer keys H_I·S     proj + indexer 2·n_I·H_I·S + 4·N·H·min(S, k)
  linear_attention    state N·H·(H+1) (normalised)     proj + 4·N·H·(H+1)             — flat in S
  mamba2              state heads·N_state·P + conv (K_c−1)·conv_dim     proj + conv + 4·heads·N_state·P
  gated_deltanet      state n_v·H_k·H_v + conv (K_c−1)·conv_dim         proj + conv + 6·n_v·H_k·H_v

Recurrent states are kept in fp32 (``model.linear_scan``), KV and conv inputs in the model dtype,
exactly as ``model.mixers.MixerCache`` holds them (its ``nbytes()`` equals ``cache_bytes`` —
tests/model/test_mixers_accounting.py). Parameter counts equal the modules' ``numel`` sums.
"""

from __future__ import annotations

from lmstack.accounting.params import (attention_params_per_layer, ffn_params_per_layer, layer_ffn_params,
                                      norm_params_per_layer)
from lmstack.accounting.precision import bytes_per_element
from lmstack.model.config import ModelConfig
from lmstack.utils import atomic_path

STATE_DTYPE = "fp32"


def _mamba2_sizes(c: ModelConfig) -> dict[str, int]:
    inner = c.ssm_expand * c.d_model
    heads = inner // c.ssm_head_dim
    conv_dim = inner + 2 * c.ssm_n_groups * c.ssm_state_size
    return dict(inner=inner, heads=heads, conv_dim=conv_dim, in_out=inner + conv_dim + heads)


def _delta_sizes(c: ModelConfig) -> dict[str, int]:
    n_k = c.delta_n_heads or c.n_heads
    n_v = c.delta_n_v_heads or n_k
    h_k = c.delta_head_dim or c.head_dim
    h_v = c.delta_v_head_dim or h_k
    return dict(n_k=n_k, n_v=n_v, h_k=h_k, h_v=h_v, conv_dim=2 * n_k * h_k + n_v * h_v, value_dim=n_v * h_v)


def mixer_params(c: ModelConfig, kind: str) -> int:
    """Parameters of one layer's token mixer of ``kind`` (QK-norm gammas counted under norms, as in params.py)."""
    D = c.d_model
    if kind in ("attention", "local_attention"):
        return attention_params_per_layer(c)
    if kind == "dsa":
        return attention_params_per_layer(c) + D * (c.dsa_index_heads * c.dsa_index_head_dim + c.dsa_index_head_dim
                                                    + c.dsa_index_heads)
    if kind == "linear_attention":
        return 4 * D * c.n_heads * c.head_dim
    if kind == "mamba2":
        m = _mamba2_sizes(c)
        return D * m["in_out"] + m["conv_dim"] * (c.conv_kernel + 1) + 3 * m["heads"] + m["inner"] + m["inner"] * D
    if kind == "gated_deltanet":
        d = _delta_sizes(c)
        return (D * (d["conv_dim"] + d["value_dim"] + 2 * d["n_v"]) + d["conv_dim"] * c.conv_kernel + 2 * d["n_v"]
                + d["h_v"] + d["value_dim"] * D)
    raise ValueError(f"unknown mixer {kind!r}")


def model_params(c: ModelConfig) -> int:
    """All parameters of the lmstack Transformer for ``c`` with its per-layer mixers."""
    qk = 2 * c.head_dim if c.qk_norm else 0
    per_layer = 0
    for i, kind in enumerate(c.mixer_types):
        norms = norm_params_per_layer(c) - (qk if kind not in ("attention", "local_attention", "dsa") else 0)
        # the HF hybrid-family block options (model/variants.py): no FFN (Mamba2), sandwich norms (Gemma),
        # the attention output gate's half of q_proj (Qwen3-Next)
        norms += (c.d_model if c.sandwich_norm else 0) * (2 if c.block_ffn else 1) - (0 if c.block_ffn else c.d_model)
        gate = c.d_model * c.n_heads * c.head_dim if c.attn_output_gate and kind in ("attention", "local_attention") \
            else 0
        ffn = (layer_ffn_params(c, i) if c.n_experts else ffn_params_per_layer(c)) if c.block_ffn else 0
        per_layer += mixer_params(c, kind) + gate + ffn + norms
    emb = c.vocab_size * c.d_model
    return per_layer + emb + c.d_model + (0 if c.tie_embeddings else emb)


def mixer_decode_flops(c: ModelConfig, kind: str, S: int) -> int:
    """Forward FLOPs of one layer's mixer for one new token at context S: 2 per multiply-add of the
    projections, the short convolution and the state/score products (biases, norms and gates not counted)."""
    D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    if kind in ("attention", "local_attention", "dsa"):
        proj = 2 * D * (2 * N * H + 2 * K * H)  # W_Q, W_K, W_V, W_O
        if kind == "attention":
            return proj + 4 * N * H * S
        if kind == "local_attention":
            return proj + 4 * N * H * min(S, c.local_window)
        nI, HI = c.dsa_index_heads, c.dsa_index_head_dim
        indexer = 2 * D * (nI * HI + HI + nI) + 2 * nI * HI * S
        return proj + indexer + 4 * N * H * min(S, c.dsa_top_k)
    if kind == "linear_attention":
        cols = H + 1 if c.linear_normalize else H
        return 2 * 4 * D * N * H + 4 * N * H * cols  # S += k vᵀ, y = Sᵀ q
    if kind == "mamba2":
        m = _mamba2_sizes(c)
        return (2 * D * m["in_out"] + 2 * m["inner"] * D + 2 * m["conv_dim"] * c.conv_kernel
                + 4 * m["heads"] * c.ssm_state_size * c.ssm_head_dim)
    if kind == "gated_deltanet":
        d = _delta_sizes(c)
        return (2 * D * (d["conv_dim"] + d["value_dim"] + 2 * d["n_v"]) + 2 * d["value_dim"] * D
                + 2 * d["conv_dim"] * c.conv_kernel + 6 * d["n_v"] * d["h_k"] * d["h_v"])  # Sᵀk, k uᵀ, Sᵀq
    raise ValueError(f"unknown mixer {kind!r}")


def mixer_cache_bytes(c: ModelConfig, kind: str, S: int, dtype: object = "bf16", state_dtype: object = STATE_DTYPE
                      ) -> float:
    """Bytes one layer keeps for one sequence after S tokens: KV (model dtype) or state (fp32) + conv inputs."""
    p, ps = bytes_per_element(dtype), bytes_per_element(state_dtype)
    K, H = c.n_kv_heads, c.head_dim
    if kind == "attention":
        return 2 * K * H * S * p
    if kind == "local_attention":
        return 2 * K * H * min(S, c.local_window - 1) * p  # MixerCache keeps the W − 1 keys the next query needs
    if kind == "dsa":
        return (2 * K * H + c.dsa_index_head_dim) * S * p
    if kind == "linear_attention":
        return c.n_heads * H * (H + 1 if c.linear_normalize else H) * ps
    if kind == "mamba2":
        m = _mamba2_sizes(c)
        return m["heads"] * c.ssm_state_size * c.ssm_head_dim * ps + m["conv_dim"] * (c.conv_kernel - 1) * p
    if kind == "gated_deltanet":
        d = _delta_sizes(c)
        return d["n_v"] * d["h_k"] * d["h_v"] * ps + d["conv_dim"] * (c.conv_kernel - 1) * p
    raise ValueError(f"unknown mixer {kind!r}")


def cache_bytes(c: ModelConfig, S: int, B: int = 1, dtype: object = "bf16") -> float:
    """KV + state bytes of the whole model for B sequences at context S."""
    return B * sum(mixer_cache_bytes(c, kind, S, dtype) for kind in c.mixer_types)


def decode_flops(c: ModelConfig, S: int) -> int:
    """Forward FLOPs of all mixers + FFNs + unembedding for one token at context S."""
    mixers = sum(mixer_decode_flops(c, kind, S) for kind in c.mixer_types)
    return mixers + 2 * c.n_layers * ffn_params_per_layer(c) + 2 * c.d_model * c.vocab_size


def pattern_variants(c: ModelConfig, window: int = 4096) -> dict[str, ModelConfig]:
    """The seed's comparison for one model size: full attention, 3:1 Gated-DeltaNet:full, 5:1 local:global
    (window W), and pure Gated DeltaNet (head sizes from ``c``)."""
    L = c.n_layers

    def rep(unit):
        return [unit[i % len(unit)] for i in range(L)]

    return {
        "full": c.replace(layer_types=None),
        "3:1 deltanet:full": c.replace(layer_types=rep(["gated_deltanet"] * 3 + ["attention"])),
        f"5:1 local({window}):global": c.replace(layer_types=rep(["local_attention"] * 5 + ["attention"]),
                                                 local_window=window),
        "pure deltanet": c.replace(layer_types=rep(["gated_deltanet"])),
    }


def cache_table(c: ModelConfig, contexts: list[int], dtype: object = "bf16", window: int = 4096
                ) -> dict[str, list[float]]:
    """{variant: [KV+state bytes at each S]} for ``pattern_variants``."""
    return {name: [cache_bytes(v, S, 1, dtype) for S in contexts] for name, v in pattern_variants(c, window).items()}


def plot_cache_vs_context(c: ModelConfig, contexts: list[int], path, dtype: object = "bf16", window: int = 4096) -> None:
    """PNG: KV + state bytes per sequence vs context length (log-log) for the four layer patterns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = cache_table(c, contexts, dtype, window)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in table.items():
        ax.plot(contexts, [y / 2**20 for y in ys], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length S (tokens)")
    ax.set_ylabel(f"KV + state per sequence (MiB, {dtype})")
    ax.set_title(f"{c.name}: L={c.n_layers}, D={c.d_model}, K={c.n_kv_heads}, H={c.head_dim}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
