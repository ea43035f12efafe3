"""Memory: KV cache, inference and training budgets, and per-device training memory.

Book of LLMs §1.5 (activations), §1.7 (inference), §1.8 (training), §1.9 and §2.5 (KV-cache size
for MHA/MQA/GQA/MLA, sliding window), §6.4 (DDP and ZeRO-1/2/3), §6.5 (PP), §6.6 (TP);
CS336 notes "性能指标分析" (Memory_KV = 2·P·B·S·L·K·H) and "可用资源盘点".
Element counts use the seed symbols; ``*_bytes`` multiply by the bytes of a dtype (§5.2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lmstack.accounting.params import norm_params_per_layer, param_counts, total_params
from lmstack.accounting.precision import bytes_per_element
from lmstack.model.config import ModelConfig
from lmstack.model.mixer_spec import attention_kind, layer_specs, spec

# ---- KV cache (§1.7, §2.5) ------------------------------------------------------------------


def kv_cache_elements(cfg: ModelConfig, B: int, S: int, window: int | None = None) -> int:
    """Book of LLMs §1.7 “inference memory”: KV Cache Size = B·S·(K·H)·L·2 elements (2 for key and value).

    With a sliding window W (Book of LLMs §1.9 “sliding-window and sparse attention”, §2.5 "局部注意力") a token's K/V can be dropped
    once it leaves the window, so only min(S, W) positions are kept. Layer by layer (``model.mixer_spec``):
    a softmax layer keeps ``kv_layer_elements`` (MLA: its latent), a local one the W_local − 1 positions the next
    query needs, DSA its indexer keys too; a recurrent layer keeps a state instead (``accounting.mixers``), no KV.
    """
    Se = S if window is None else min(S, window)
    # the spec's bytes at one byte per element are its elements
    return B * sum(
        int(s.cache_bytes(cfg, Se, 1, 1)) for s in layer_specs(cfg) if s.cache != "state"
    )


def kv_layer_elements(cfg: ModelConfig, B: int, S: int) -> int:
    """K/V elements one softmax-attention layer keeps for B sequences of S tokens: 2·B·S·K·H, or MLA's latent
    B·S·(d_c + d_R) (Book of LLMs §2.5 “shrinking the KV cache”) — what a paged pool block holds per layer."""
    return B * int(spec(attention_kind(cfg)).cache_bytes(cfg, S, 1, 1))


def kv_cache_bytes(
    cfg: ModelConfig, B: int, S: int, dtype: object = "bf16", window: int | None = None
) -> float:
    """CS336 notes "性能指标分析": Memory_KV = 2·P·B·S·L·K·H bytes (P bytes per element)."""
    return kv_cache_elements(cfg, B, S, window) * bytes_per_element(dtype)


def mla_kv_cache_bytes(
    B: int, S: int, L: int, latent_dim: int, rope_dim: int = 0, dtype: object = "bf16"
) -> float:
    """Book of LLMs §2.5 “shrinking the KV cache” MLA: cache one latent (S, latent_dim) per layer instead of K and V, plus the
    decoupled-RoPE key of ``rope_dim`` (DeepSeek-V2: latent 512, RoPE key 64)."""
    return B * S * L * (latent_dim + rope_dim) * bytes_per_element(dtype)


def kv_cache_variants(
    cfg: ModelConfig,
    B: int,
    S: int,
    dtype: object = "bf16",
    mla_latent_dim: int = 512,
    mla_rope_dim: int = 64,
) -> dict[str, float]:
    """Book of LLMs §2.5 “shrinking the KV cache”: the same model's cache with MHA (K = N), its own GQA K, MQA (K = 1) and MLA."""
    out = {
        "mha": kv_cache_bytes(cfg.replace(n_kv_heads=cfg.n_heads), B, S, dtype),
        "gqa": kv_cache_bytes(cfg, B, S, dtype),
        "mqa": kv_cache_bytes(cfg.replace(n_kv_heads=1), B, S, dtype),
        "mla": mla_kv_cache_bytes(B, S, cfg.n_layers, mla_latent_dim, mla_rope_dim, dtype),
    }
    return out


# ---- activations (§1.5, §1.7, §1.8) ---------------------------------------------------------


def train_activation_elements_per_layer(
    cfg: ModelConfig, B: int, S: int, flash: bool = False
) -> int:
    """Book of LLMs §1.5 “activation memory”: activations one layer keeps for backward.

    attention: norm input BSD, norm output BSD, Q BS·NH, K and V BS·KH each, scores BNS²,
      attention output BSD                        -> 6BSD + BNS² at K = N
    FFN: norm input BSD, gate and up BSF each, down output BSD -> 2BSD + 2BSF
    Per layer 14BSD + BNS² (the seed's total, reached at F = 3D; ≈ at F = 8/3·D). With
    FlashAttention the S×S scores are never stored; only the BNS softmax statistics are (§1.8).
    """
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    scores = B * N * S if flash else B * N * S * S
    attention = 2 * B * S * D + B * S * N * H + 2 * B * S * K * H + scores + B * S * D
    ffn = 2 * B * S * D + 2 * B * S * F
    return attention + ffn


def train_activation_bytes(
    cfg: ModelConfig,
    B: int,
    S: int,
    dtype: object = "bf16",
    flash: bool = False,
    checkpoint: bool = False,
) -> float:
    """Book of LLMs §1.8 “training memory”: L × per-layer activations. With activation checkpointing only each layer's
    input (BSD) is kept and one layer's activations are rebuilt at a time in backward."""
    per_layer = train_activation_elements_per_layer(cfg, B, S, flash)
    if checkpoint:
        elements = cfg.n_layers * B * S * cfg.d_model + per_layer
    else:
        elements = cfg.n_layers * per_layer
    return elements * bytes_per_element(dtype)


def peak_activation_elements(
    cfg: ModelConfig, B: int, T: int, S: int | None = None, flash: bool = False
) -> int:
    """Book of LLMs §1.7 “inference memory”: under inference_mode only one layer's activations are alive at a time:
    input B·T·D + projections B·T·(NH + 2KH) (3BSD at K = N) + scores B·N·T·S (B·N·T with
    FlashAttention) + FFN hidden B·T·F. Prefill T = S gives O(BNS² + BSF); decode T = 1 O(BNS + BF)."""
    S = T if S is None else S
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    scores = B * N * T if flash else B * N * T * S
    return B * T * D + B * T * (N * H + 2 * K * H) + scores + B * T * F


@dataclass(frozen=True)
class InferenceMemory:
    weights: float
    kv_cache: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def inference_memory(
    cfg: ModelConfig,
    B: int,
    S: int,
    dtype: object = "bf16",
    flash: bool = True,
    kv_dtype: object | None = None,
    window: int | None = None,
) -> InferenceMemory:
    """Book of LLMs §1.7 “inference memory”: Memory_inference = weights + KV cache + peak activations, at the prefill of
    S tokens (the activation peak) with a cache of S positions; a hybrid's recurrent layers add their fp32
    states (and convolution inputs) to the cache (``model.mixer_spec``)."""
    w = total_params(cfg) * bytes_per_element(dtype)
    p = bytes_per_element(kv_dtype or dtype)
    kv = kv_cache_bytes(cfg, B, S, kv_dtype or dtype, window)
    kv += B * sum(
        s.cache_bytes(cfg, S, p, bytes_per_element("fp32"))
        for s in layer_specs(cfg)
        if s.cache == "state"
    )
    act = peak_activation_elements(cfg, B, S, S, flash) * bytes_per_element(dtype)
    return InferenceMemory(weights=w, kv_cache=kv, activations=act)


# ---- training (§1.8) and per device (§6.4-6.6) ----------------------------------------------


@dataclass(frozen=True)
class TrainingMemory:
    master_weights: float  # fp32 4P
    low_precision_weights: float  # bf16 copy 2P (mixed precision)
    optimizer: float  # AdamW m and v in fp32: 8P
    gradients: float  # accumulated in fp32: 4P
    activations: float

    @property
    def states(self) -> float:
        return self.master_weights + self.low_precision_weights + self.optimizer + self.gradients

    @property
    def total(self) -> float:
        return self.states + self.activations

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "states": self.states, "total": self.total}


def training_state_bytes(n_params: float, mixed_precision: bool = True) -> dict[str, float]:
    """Book of LLMs §1.8 "训练四件套": fp32 master 4P, bf16 copy 2P, AdamW states 8P, fp32 grads 4P (18P)."""
    return {
        "master_weights": 4 * n_params,
        "low_precision_weights": 2 * n_params if mixed_precision else 0.0,
        "optimizer": 8 * n_params,
        "gradients": 4 * n_params,
    }


def training_memory(
    cfg: ModelConfig,
    B: int,
    S: int,
    flash: bool = False,
    checkpoint: bool = False,
    mixed_precision: bool = True,
) -> TrainingMemory:
    """Book of LLMs §1.8 “training memory”: Memory_train = weights + optimizer states + gradients + activations,
    activations in bf16 (fp32 without mixed precision)."""
    states = training_state_bytes(total_params(cfg), mixed_precision)
    act = train_activation_bytes(
        cfg, B, S, "bf16" if mixed_precision else "fp32", flash, checkpoint
    )
    return TrainingMemory(activations=act, **states)


STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "tp", "pp")


def training_memory_per_device(
    cfg: ModelConfig,
    B: int,
    S: int,
    strategy: str,
    M: int,
    flash: bool = False,
    checkpoint: bool = False,
    mixed_precision: bool = True,
    micro_batches: int | None = None,
) -> TrainingMemory:
    """Bytes on one of M devices training on a global batch of B sequences of S tokens.

    ddp   (§6.4) everything replicated; each device runs B/M sequences.
    zero1 (§6.4) AdamW states sharded 1/M;  zero2: + gradients 1/M;  zero3 (FSDP): + weights 1/M.
      ZeRO does not shard activations (CS336 notes "ZeRO 的另一个问题"); each device runs B/M.
    tp    (§6.6) Megatron TP: every matrix (and the vocab tables) split M ways, norms replicated;
      Q, K, V, scores, attention output and the F-sized gate/up activations are split by head or
      by F, while the norm inputs/outputs and the down output stay whole (no sequence parallel).
      All M devices see the whole batch B.
    pp    (§6.5) L/M layers per stage (states ≈ P/M); with 1F1B and ``micro_batches`` = n ≥ M the
      first stage holds M micro-batches of B/n in flight: its L/M layers' activations for B·M/n.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}; expected one of {STRATEGIES}")
    if M < 1:
        raise ValueError(f"M={M} devices must be >= 1")
    P = total_params(cfg)
    act_dtype = "bf16" if mixed_precision else "fp32"
    bpe = bytes_per_element(act_dtype)
    s = training_state_bytes(P, mixed_precision)
    if strategy == "single":
        M = 1
    if strategy in ("single", "ddp", "zero1", "zero2", "zero3"):
        b = B / M
        act = train_activation_bytes(cfg, 1, S, act_dtype, flash, checkpoint) * b
        if strategy in ("zero1", "zero2", "zero3"):
            s["optimizer"] /= M
        if strategy in ("zero2", "zero3"):
            s["gradients"] /= M
        if strategy == "zero3":
            s["master_weights"] /= M
            s["low_precision_weights"] /= M
        return TrainingMemory(activations=act, **s)
    if strategy == "tp":
        replicated = cfg.n_layers * norm_params_per_layer(cfg) + cfg.d_model
        frac = (replicated + (P - replicated) / M) / P
        s = {k: v * frac for k, v in s.items()}
        D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
        scores = B * N * S if flash else B * N * S * S
        whole = 4 * B * S * D  # attn norm in/out, FFN norm in, down output
        split = B * S * N * H + 2 * B * S * K * H + scores + B * S * D + 2 * B * S * F
        per_layer = whole + split / M
        if checkpoint:
            elements = cfg.n_layers * B * S * D + per_layer
        else:
            elements = cfg.n_layers * per_layer
        return TrainingMemory(activations=elements * bpe, **s)
    # pp
    n = micro_batches or M
    s = {k: v / M for k, v in s.items()}
    in_flight = B * min(M, n) / n
    layers = cfg.n_layers / M
    per_layer = train_activation_elements_per_layer(cfg, 1, S, flash) * in_flight
    if checkpoint:
        elements = (
            layers * in_flight * S * cfg.d_model
            + train_activation_elements_per_layer(cfg, 1, S, flash) * B / n
        )
    else:
        elements = layers * per_layer
    return TrainingMemory(activations=elements * bpe, **s)


def weight_bytes(cfg: ModelConfig, dtype: object = "bf16") -> float:
    """All parameters stored in ``dtype`` (Book of LLMs §5.2 “precision formats”: bf16 2P, int8 P, int4 P/2)."""
    return param_counts(cfg).total * bytes_per_element(dtype)
