"""ModelConfig: the hyper-parameters of a Llama-family decoder-only Transformer, and presets.

Book of LLMs §1.1 “architecture and symbols” names the symbols used throughout lmstack:
B batch, L layers (``n_layers``), S context length, T new tokens, V vocab (``vocab_size``),
D model dim (``d_model``), H head dim (``head_dim``), N query heads (``n_heads``),
K kv heads (``n_kv_heads``), G = N // K, F MLP hidden dim (``d_ff``).

CS336 notes "超参数选择" discusses the usual choices (F ≈ 8/3·D for gated FFNs, D = N·H,
D / L ≈ 128); they are conventions, not rules, so only what the maths needs is enforced.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lmstack.model.mixer_spec import LAYER_TYPES, layer_type_names
from lmstack.utils import atomic_write_text, check_bool, check_float, check_int

ROPE_LAYOUTS = ("half", "interleaved")
# Runtime choices, not architecture: older lmstack config files hold them; they are dropped on load
# (the backends are set by lmstack.kernels.runtime.RuntimeConfig).
RUNTIME_FIELDS = ("attn_backend", "norm_backend")
ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "mixtral",
    "olmoe",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "mamba2",
    "gemma2",
    "gemma3_text",
    "qwen3_next",
)  # HF families lmstack loads and saves (model/hf.py; MoE: moe.py, MLA: mla.py)
#: Token mixers a layer may have (``ModelConfig.layer_types``): the kinds declared in ``lmstack.model.mixer_spec``.
MIXERS = LAYER_TYPES
LINEAR_FEATURE_MAPS = ("identity", "elu1", "relu")
FFN_ACTS = ("silu", "gelu_tanh")  # the gated FFN's activation: SwiGLU, GeGLU (Gemma)
#: Longest context lmstack accepts (the RoPE tables grow on demand up to it): 16.7M positions;
#: real models use <= 10M, and a corrupt 2**32 must not ask for terabytes.
MAX_SEQ_LEN = 1 << 24
MAX_SIZE = (1 << 31) - 1  # no size of a real model comes near this; larger ones are corrupt files


class ConfigError(ValueError):
    """A model configuration that cannot describe a working model."""


# ---- the field groups: ModelConfig is their union (see ModelConfig's docstring) ---------------------------
@dataclass
class DecoderConfig:
    """The Llama-family decoder: sizes, RoPE, norms, embeddings, the HF family and the special tokens.

    ``rope_layout`` says which dimensions RoPE pairs up: ``"interleaved"`` rotates (2i, 2i+1)
    as in the RoFormer paper and Meta's original Llama code; ``"half"`` rotates (i, i + H/2) as
    HF transformers does (HF checkpoints have their q/k rows permuted to match).
    """

    vocab_size: int = 32000  # V
    d_model: int = 4096  # D
    n_layers: int = 32  # L
    n_heads: int = 32  # N
    n_kv_heads: int | None = None  # K; None means K = N (MHA); 1 is MQA
    d_ff: int = 11008  # F
    head_dim: int | None = None  # H; None means D // N
    max_seq_len: int = 4096  # longest S the RoPE tables cover
    rope_theta: float = 10000.0  # Θ
    rope_layout: str = "half"
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v (not o)
    sliding_window: int | None = None  # W: a query sees itself and the W - 1 keys before it
    parallel_block: bool = False  # GPT-J: y = x + Attn(Norm(x)) + MLP(Norm(x))
    init_std: float = 0.02
    architecture: str = "llama"  # HF family used when saving: llama | mistral | qwen2
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = field(default="custom", compare=False)


@dataclass
class MixerConfig:
    """Token mixers beyond softmax attention and the per-layer pattern (model/mixer_spec.py, mixers.py,
    linear_attention.py, mamba2.py, deltanet.py, dsa.py)."""

    layer_types: list[str] | None = (
        None  # per layer, one of MIXERS; None = "attention" in every layer
    )
    local_window: int | None = None  # W of the "local_attention" layers (Gemma-style local:global)
    mixer_chunk_size: int = 64  # C: chunk length of the chunked (training/prefill) forms
    linear_feature_map: str = "elu1"  # φ of "linear_attention": identity | elu1 (elu + 1) | relu
    linear_normalize: bool = True  # "linear_attention" divides by φ(q)·Σφ(k)
    ssm_state_size: int = 64  # Mamba-2: state size per head (HF state_size)
    ssm_n_groups: int = 1  # Mamba-2: groups of heads sharing B_t, C_t
    ssm_head_dim: int = 64  # Mamba-2: P; heads = ssm_expand·D / P
    ssm_expand: int = 2  # Mamba-2: inner width = ssm_expand·D
    conv_kernel: int = 4  # Mamba-2 / Gated DeltaNet short causal depthwise convolution
    ssm_dt_limit: list | None = (
        None  # Mamba-2: Δ clamped to [lo, hi] after the softplus (HF time_step_limit)
    )
    delta_n_heads: int | None = None  # Gated DeltaNet q/k heads; None = n_heads
    delta_n_v_heads: int | None = (
        None  # Gated DeltaNet value heads (a multiple of delta_n_heads); None = equal
    )
    delta_head_dim: int | None = None  # Gated DeltaNet q/k head dim; None = head_dim
    delta_v_head_dim: int | None = None  # Gated DeltaNet value head dim; None = delta_head_dim
    dsa_top_k: int = 2048  # DSA: keys each query attends to
    dsa_index_heads: int = 4  # DSA: lightning-indexer heads
    dsa_index_head_dim: int = 32  # DSA: lightning-indexer head dim
    dsa_indexer_loss: float = (
        0.0  # DSA: weight of the indexer's KL loss in training (model/dsa.py); 0 = off
    )
    dsa_dense_warmup: bool = (
        False  # DSA: V3.2's dense warm-up stage (dense attention, KL over every causal key)
    )


@dataclass
class MoEConfig:
    """Mixture of experts: routed and shared experts, the router, capacity and the balance losses
    (model/moe.py)."""

    n_experts: int = 0  # E routed experts per MoE layer; 0 = every FFN is the dense SwiGLU
    n_experts_per_token: int = 2  # k
    d_ff_expert: int | None = (
        None  # F of one routed expert (fine-grained experts: < d_ff); None = d_ff
    )
    n_shared_experts: int = 0  # always-on shared experts (DeepSeekMoE, Qwen-MoE)
    d_ff_shared: int | None = (
        None  # total hidden width of the shared experts; None = n_shared · d_ff_expert
    )
    shared_expert_gate: bool = (
        False  # Qwen-MoE: the shared expert's output is scaled by sigmoid(x·w)
    )
    moe_first_dense: int = (
        0  # the first k layers keep the dense FFN (DeepSeek first_k_dense_replace)
    )
    moe_layer_step: int = (
        1  # layer i >= moe_first_dense is MoE when (i + 1) % step == 0 (Qwen decoder_sparse_step)
    )
    router: str = "topk"  # topk | hash (hash: model.moe.hash_route on the token ids)
    router_score: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    router_order: str = "softmax_topk"  # softmax_topk | topk_softmax
    router_norm_topk: bool = False  # renormalise the k gate values to sum to 1
    router_scale: float = 1.0  # routed_scaling_factor multiplying the gate values
    router_groups: int = 1  # group-limited routing: experts in this many groups ...
    router_topk_groups: int = 1  # ... of which only the best this many may be chosen
    router_aux_free_bias: bool = (
        False  # DeepSeek-V3 per-expert selection bias (e_score_correction_bias)
    )
    capacity_factor: float | None = (
        None  # None: no token dropping; else capacity ceil(cf·T·k/E) per expert
    )
    moe_aux_loss_coef: float = 0.0  # α of the balance loss α·E·Σ f_i·P_i
    moe_device_loss_coef: float = (
        0.0  # α_dev of the device-level balance loss over moe_devices groups
    )
    moe_devices: int = 1
    moe_z_loss_coef: float = 0.0  # β of the router z-loss β·mean(logsumexp²)
    moe_bias_update_rate: float = (
        0.0  # γ: aux-free bias step b_i += γ·sign(mean load − load_i) per step
    )

    def __post_init__(self) -> None:
        self._check_moe()

    def _check_moe(self) -> None:
        """The MoE fields on their own (model/moe.py); ModelConfig runs it too."""
        for f in ("n_experts", "n_shared_experts", "moe_first_dense"):
            setattr(self, f, check_int(f, getattr(self, f), ConfigError, 0, MAX_SIZE))
        for f in (
            "n_experts_per_token",
            "moe_layer_step",
            "router_groups",
            "router_topk_groups",
            "moe_devices",
        ):
            setattr(self, f, check_int(f, getattr(self, f), ConfigError, 1, MAX_SIZE))
        for f in ("d_ff_expert", "d_ff_shared"):
            if getattr(self, f) is not None:
                setattr(self, f, check_int(f, getattr(self, f), ConfigError, 1, MAX_SIZE))
        for f in ("shared_expert_gate", "router_norm_topk", "router_aux_free_bias"):
            check_bool(f, getattr(self, f), ConfigError)
        for f in (
            "router_scale",
            "moe_aux_loss_coef",
            "moe_device_loss_coef",
            "moe_z_loss_coef",
            "moe_bias_update_rate",
        ):
            setattr(self, f, check_float(f, getattr(self, f), ConfigError))
            if getattr(self, f) < 0:
                raise ConfigError(f"{f}={getattr(self, f)} must be >= 0")
        if self.capacity_factor is not None:
            self.capacity_factor = check_float("capacity_factor", self.capacity_factor, ConfigError)
            if not self.capacity_factor > 0:
                raise ConfigError(f"capacity_factor={self.capacity_factor} must be > 0 (or null)")
        choices = {
            "router": ("topk", "hash"),
            "router_score": ("softmax", "sigmoid"),
            "router_order": ("softmax_topk", "topk_softmax"),
        }
        for f, allowed in choices.items():
            if getattr(self, f) not in allowed:
                raise ConfigError(f"{f}={getattr(self, f)!r}; expected one of {allowed}")
        if self.n_experts:
            if self.n_experts_per_token > self.n_experts:
                raise ConfigError(
                    f"n_experts_per_token={self.n_experts_per_token} exceeds n_experts="
                    f"{self.n_experts}; top-k routing needs k <= E"
                )
            if self.n_experts % self.router_groups:
                raise ConfigError(
                    f"router_groups={self.router_groups} does not divide n_experts={self.n_experts}"
                )
            if self.router_topk_groups > self.router_groups:
                raise ConfigError(
                    f"router_topk_groups={self.router_topk_groups} exceeds router_groups="
                    f"{self.router_groups}"
                )
            if (
                self.router_groups > 1
                and self.router_topk_groups * (self.n_experts // self.router_groups)
                < self.n_experts_per_token
            ):
                raise ConfigError(
                    f"router_topk_groups={self.router_topk_groups} groups of "
                    f"{self.n_experts // self.router_groups} experts hold fewer than "
                    f"n_experts_per_token={self.n_experts_per_token}"
                )
            if self.n_experts % self.moe_devices:
                raise ConfigError(
                    f"moe_devices={self.moe_devices} does not divide n_experts={self.n_experts}"
                )


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, model/mla.py); ``kv_lora_rank > 0`` turns it on."""

    kv_lora_rank: int = 0  # d_c of MLA's compressed KV; > 0 makes every token mixer MLA
    q_lora_rank: int = 0  # d_c' of MLA's compressed query; 0 = a full-rank q projection
    qk_nope_head_dim: int = 0  # MLA per-head q/k dims without RoPE
    qk_rope_head_dim: int = 0  # d_R: MLA's decoupled RoPE dims (one shared key per token)
    v_head_dim: int = 0  # MLA per-head value dims
    rope_yarn: dict | None = (
        None  # MLA only: YaRN RoPE scaling {factor, original_max_position_embeddings, ...}
    )

    def __post_init__(self) -> None:
        self._check_mla()

    def _check_mla(self) -> None:
        """The MLA fields on their own (model/mla.py); ModelConfig runs it too."""
        for f in (
            "kv_lora_rank",
            "q_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            setattr(self, f, check_int(f, getattr(self, f), ConfigError, 0, MAX_SIZE))
        if self.kv_lora_rank:
            for f in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, f) < 1:
                    raise ConfigError(
                        f"MLA (kv_lora_rank={self.kv_lora_rank}) needs {f} >= 1, got {getattr(self, f)}"
                    )
            if self.qk_rope_head_dim % 2:
                raise ConfigError(
                    f"qk_rope_head_dim={self.qk_rope_head_dim} is odd; RoPE rotates pairs"
                )
        if self.rope_yarn is not None:
            if not self.is_mla:
                raise ConfigError(
                    "rope_yarn (YaRN scaling) is implemented for MLA models (kv_lora_rank > 0) only"
                )
            if not isinstance(self.rope_yarn, dict):
                raise ConfigError(
                    f"rope_yarn={self.rope_yarn!r} must be an object of YaRN parameters"
                )
            allowed = {
                "factor",
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
                "mscale",
                "mscale_all_dim",
                "attention_factor",
                "truncate",
            }
            unknown = sorted(set(self.rope_yarn) - allowed)
            if unknown:
                raise ConfigError(
                    f"rope_yarn has unknown key(s) {unknown}; known: {sorted(allowed)}"
                )
            for key in ("factor", "original_max_position_embeddings"):
                if key not in self.rope_yarn:
                    raise ConfigError(f"rope_yarn needs {key!r}, got {self.rope_yarn!r}")
            for key, v in self.rope_yarn.items():
                if key == "truncate":
                    check_bool("rope_yarn.truncate", v, ConfigError)
                elif v is not None:
                    check_float(f"rope_yarn.{key}", v, ConfigError)

    @property
    def is_mla(self) -> bool:
        """Every layer's token mixer is multi-head latent attention (model/mla.py)."""
        return self.kv_lora_rank > 0


@dataclass
class VariantConfig:
    """Variants of the block and of softmax attention (QK-norm, soft-capping, output gate, partial RoPE,
    sandwich norms, ...; model/variants.py, model/olmoe.py); the defaults are the Llama block, unchanged."""

    qk_norm: bool = False  # RMSNorm over H on q and k before RoPE (CS336 notes "训练稳定性")
    qk_norm_full: bool = (
        False  # OLMoE: RMSNorm over all N·H query / K·H key features (not per head)
    )
    qkv_clip: float | None = None  # OLMoE clip_qkv: clamp q, k, v to ±clip
    block_ffn: bool = (
        True  # False: a block is norm -> token mixer -> residual only (Mamba2ForCausalLM)
    )
    norm_offset: bool = (
        False  # every RMSNorm applies (1 + w), w stored zero-centred (Gemma, Qwen3-Next)
    )
    sandwich_norm: bool = (
        False  # Gemma-2/3: a norm on the mixer's and on the FFN's output too, before the residual
    )
    ffn_act: str = "silu"  # gated FFN activation: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma)
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(D)
    query_pre_attn_scalar: float | None = (
        None  # Gemma: attention scale 1/sqrt(this) instead of 1/sqrt(H)
    )
    attn_softcap: float | None = None  # Gemma-2: attention logits s -> cap·tanh(s/cap)
    final_softcap: float | None = None  # Gemma-2: output logits z -> cap·tanh(z/cap)
    local_rope_theta: float | None = None  # Gemma-3: RoPE base Θ of the local_attention layers
    rotary_dim: int | None = (
        None  # partial RoPE: only the first rotary_dim of H rotate (Qwen3-Next); None = H
    )
    attn_output_gate: bool = (
        False  # Qwen3-Next: attention output ·sigmoid(gate), gate from a doubled q_proj
    )
    rope_linear_factor: float | None = (
        None  # linear RoPE scaling (positions / factor) of the global layers (Gemma-3)
    )


_G = TypeVar("_G", DecoderConfig, MixerConfig, MoEConfig, MLAConfig, VariantConfig)
#: the field groups, by the name of their ``ModelConfig`` view (``config.moe`` is a MoEConfig)
GROUPS = {
    "decoder": DecoderConfig,
    "mixers": MixerConfig,
    "moe": MoEConfig,
    "mla": MLAConfig,
    "variants": VariantConfig,
}


@dataclass
class ModelConfig(VariantConfig, MLAConfig, MoEConfig, MixerConfig, DecoderConfig):
    """Hyper-parameters of the model; every field is checked in ``__post_init__``.

    The fields are declared in groups (``DecoderConfig``, ``MixerConfig``, ``MoEConfig``, ``MLAConfig``,
    ``VariantConfig``) and ModelConfig holds them all, flat: a field is read and set as ``config.n_experts``,
    constructed as ``ModelConfig(n_experts=8)`` and stored flat in config files and checkpoints (one JSON
    object of fields). ``config.moe`` (``.decoder``, ``.mixers``, ``.mla``, ``.variants``) is the group as
    its own typed object, a copy; ``config.replace(moe=MoEConfig(...))`` and
    ``ModelConfig.from_groups(MoEConfig(...), n_layers=4)`` set a whole group.
    """

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
            setattr(
                self, f, check_int(f, getattr(self, f), ConfigError, minimum=1, maximum=MAX_SIZE)
            )
        self.max_seq_len = check_int("max_seq_len", self.max_seq_len, ConfigError, 1, MAX_SEQ_LEN)
        for f in ("tie_embeddings", "qkv_bias", "qk_norm", "parallel_block"):
            check_bool(f, getattr(self, f), ConfigError)
        for f in ("rope_theta", "norm_eps", "init_std"):
            setattr(self, f, check_float(f, getattr(self, f), ConfigError))
        for f in ("head_dim", "sliding_window", "bos_token_id", "eos_token_id"):
            if getattr(self, f) is not None:
                setattr(
                    self,
                    f,
                    check_int(
                        f, getattr(self, f), ConfigError, 0 if f.endswith("_id") else 1, MAX_SIZE
                    ),
                )
        for f in ("bos_token_id", "eos_token_id"):
            if getattr(self, f) is not None and getattr(self, f) >= self.vocab_size:
                raise ConfigError(
                    f"{f}={getattr(self, f)} is not a token id of vocab_size={self.vocab_size}"
                )
        if not isinstance(self.name, str):
            raise ConfigError(f"name={self.name!r} must be a string")
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise ConfigError(
                    f"n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                    "choose n_heads so that d_model = n_heads * head_dim, or set head_dim explicitly"
                )
            self.head_dim = self.d_model // self.n_heads
        if self.head_dim % 2 != 0:
            raise ConfigError(
                f"head_dim={self.head_dim} is odd; RoPE rotates pairs of dimensions and needs an even head dim"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; "
                "grouped-query attention needs n_heads = G * n_kv_heads"
            )
        if not (self.rope_theta > 0):
            raise ConfigError(f"rope_theta={self.rope_theta!r} must be > 0")
        if not (self.norm_eps > 0):
            raise ConfigError(f"norm_eps={self.norm_eps!r} must be > 0")
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ConfigError(f"rope_layout={self.rope_layout!r}; expected one of {ROPE_LAYOUTS}")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture={self.architecture!r}; expected one of {ARCHITECTURES}"
            )
        if not (self.init_std > 0):
            raise ConfigError(f"init_std={self.init_std!r} must be > 0")
        self._check_mixers()
        self._check_moe()
        self._check_mla()
        self._check_variants()

    def _check_variants(self) -> None:
        """The HF hybrid / interleaved-family fields (model/variants.py)."""
        for f in (
            "block_ffn",
            "norm_offset",
            "sandwich_norm",
            "embed_scale",
            "attn_output_gate",
            "qk_norm_full",
        ):
            check_bool(f, getattr(self, f), ConfigError)
        if self.ffn_act not in FFN_ACTS:
            raise ConfigError(f"ffn_act={self.ffn_act!r}; expected one of {FFN_ACTS}")
        for f in (
            "qkv_clip",
            "query_pre_attn_scalar",
            "attn_softcap",
            "final_softcap",
            "local_rope_theta",
            "rope_linear_factor",
        ):
            if getattr(self, f) is not None:
                setattr(self, f, check_float(f, getattr(self, f), ConfigError))
                if not getattr(self, f) > 0:
                    raise ConfigError(f"{f}={getattr(self, f)} must be > 0 (or null)")
        if self.rotary_dim is not None:
            self.rotary_dim = check_int(
                "rotary_dim", self.rotary_dim, ConfigError, 2, self.head_dim
            )
            if self.rotary_dim % 2:
                raise ConfigError(
                    f"rotary_dim={self.rotary_dim} is odd; RoPE rotates pairs of dimensions"
                )
        if self.ssm_dt_limit is not None:
            lim = self.ssm_dt_limit
            if not isinstance(lim, (list, tuple)) or len(lim) != 2:
                raise ConfigError(f"ssm_dt_limit={lim!r}; expected [lo, hi]")
            lo, hi = (
                v if v == float("inf") and i else check_float(f"ssm_dt_limit[{i}]", v, ConfigError)
                for i, v in enumerate(lim)
            )
            if not 0 <= lo < hi:
                raise ConfigError(f"ssm_dt_limit={lim!r}; expected 0 <= lo < hi")
            self.ssm_dt_limit = [lo, hi]
        if not self.block_ffn and self.parallel_block:
            raise ConfigError(
                "block_ffn=False (no feed-forward) and parallel_block=True contradict each other"
            )

    def _check_mixers(self) -> None:
        """The token-mixer block: a per-layer pattern of known mixers, and the sizes the used ones need."""
        if self.layer_types is not None:
            if isinstance(self.layer_types, (str, bytes)) or not isinstance(
                self.layer_types, (list, tuple)
            ):
                raise ConfigError(
                    f"layer_types={self.layer_types!r:.80}; expected a list of {self.n_layers} "
                    f"mixer names from {MIXERS}"
                )
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.n_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries but n_layers={self.n_layers}; "
                    "give one mixer per layer"
                )
            known = layer_type_names()  # the built-in MIXERS and any registered since
            for i, t in enumerate(self.layer_types):
                if t not in known:
                    raise ConfigError(
                        f"layer_types[{i}]={t!r} (layer {i}) is not a known mixer; expected one of {known}"
                    )
        for f in (
            "mixer_chunk_size",
            "ssm_state_size",
            "ssm_n_groups",
            "ssm_head_dim",
            "ssm_expand",
            "conv_kernel",
            "dsa_top_k",
            "dsa_index_heads",
            "dsa_index_head_dim",
        ):
            setattr(self, f, check_int(f, getattr(self, f), ConfigError, 1, MAX_SIZE))
        for f in (
            "local_window",
            "delta_n_heads",
            "delta_n_v_heads",
            "delta_head_dim",
            "delta_v_head_dim",
        ):
            if getattr(self, f) is not None:
                setattr(self, f, check_int(f, getattr(self, f), ConfigError, 1, MAX_SIZE))
        check_bool("linear_normalize", self.linear_normalize, ConfigError)
        check_bool("dsa_dense_warmup", self.dsa_dense_warmup, ConfigError)
        self.dsa_indexer_loss = check_float("dsa_indexer_loss", self.dsa_indexer_loss, ConfigError)
        if self.dsa_indexer_loss < 0:
            raise ConfigError(
                f"dsa_indexer_loss={self.dsa_indexer_loss!r} must be >= 0 (0 turns it off)"
            )
        if self.linear_feature_map not in LINEAR_FEATURE_MAPS:
            raise ConfigError(
                f"linear_feature_map={self.linear_feature_map!r}; expected one of {LINEAR_FEATURE_MAPS}"
            )
        used = set(self.mixer_types)
        if "local_attention" in used and self.local_window is None:
            i = self.mixer_types.index("local_attention")
            raise ConfigError(
                f"layer_types[{i}]='local_attention' (layer {i}) needs local_window (the window W)"
            )
        if "mamba2" in used:
            inner = self.ssm_expand * self.d_model
            if inner % self.ssm_head_dim or (inner // self.ssm_head_dim) % self.ssm_n_groups:
                raise ConfigError(
                    f"mamba2 layers: ssm_expand*d_model={inner} must be ssm_head_dim={self.ssm_head_dim} "
                    f"x a multiple of ssm_n_groups={self.ssm_n_groups} heads"
                )
        if "gated_deltanet" in used:
            nk = self.delta_n_heads or self.n_heads
            nv = self.delta_n_v_heads or nk
            if nv % nk:
                raise ConfigError(
                    f"gated_deltanet layers: delta_n_v_heads={nv} must be a multiple of delta_n_heads={nk}"
                )

    @property
    def mixer_types(self) -> list[str]:
        """Each layer's token mixer (``layer_types``, or softmax attention everywhere)."""
        return (
            list(self.layer_types)
            if self.layer_types is not None
            else ["attention"] * self.n_layers
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layer ``layer_idx``'s FFN is a mixture of experts (model/moe.py)."""
        return (
            self.n_experts > 0
            and layer_idx >= self.moe_first_dense
            and (layer_idx + 1) % self.moe_layer_step == 0
        )

    # ---- derived symbols -------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """G = N // K: query heads served by one kv head."""
        assert self.n_kv_heads is not None  # resolved by __post_init__
        return self.n_heads // self.n_kv_heads

    # ---- the field groups as typed objects --------------------------------------------------
    def group(self, cls: type[_G]) -> _G:
        """The fields of group ``cls`` (one of ``GROUPS``' classes) as a ``cls`` object (a copy)."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    @property
    def decoder(self) -> DecoderConfig:
        return self.group(DecoderConfig)

    @property
    def mixers(self) -> MixerConfig:
        return self.group(MixerConfig)

    @property
    def moe(self) -> MoEConfig:
        return self.group(MoEConfig)

    @property
    def mla(self) -> MLAConfig:
        return self.group(MLAConfig)

    @property
    def variants(self) -> VariantConfig:
        return self.group(VariantConfig)

    @staticmethod
    def _flatten(changes: dict[str, Any]) -> dict[str, Any]:
        """``changes`` with each group object (``moe=MoEConfig(...)``, or a bare one under its class
        name) spread into its fields."""
        flat: dict[str, Any] = {}
        for k, v in changes.items():
            if k in GROUPS:
                if not isinstance(v, GROUPS[k]):
                    raise ConfigError(f"{k}={v!r:.80} must be a {GROUPS[k].__name__}")
                flat.update({f.name: getattr(v, f.name) for f in dataclasses.fields(GROUPS[k])})
            else:
                flat[k] = v
        return flat

    @classmethod
    def from_groups(cls, *groups: Any, **fields: Any) -> ModelConfig:
        """A config from whole groups and single fields: ``from_groups(MoEConfig(n_experts=8), n_layers=4)``."""
        changes: dict[str, Any] = {}
        for g in groups:
            name = next((k for k, c in GROUPS.items() if type(g) is c), None)
            if name is None:
                raise ConfigError(f"{g!r:.80} is not one of the groups {sorted(GROUPS)}")
            changes[name] = g
        return cls(**cls._flatten({**changes, **fields}))

    # ---- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError(
                f"a ModelConfig needs a JSON object of fields, got {type(d).__name__} {d!r:.80}"
            )
        d = {
            k: v for k, v in d.items() if k not in RUNTIME_FIELDS
        }  # written by older lmstack versions
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}"
            )
        return cls(**d)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes``: fields, or whole groups (``replace(moe=MoEConfig(n_experts=8))``)."""
        return dataclasses.replace(self, **self._flatten(changes))

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ModelConfig:
        """Read an lmstack config JSON (``lmstack.model.hf.load_config`` also reads HF ``config.json``)."""
        d = read_json_object(path)
        if "model_type" in d:
            raise ConfigError(
                f"{path}: an HF config.json (model_type={d['model_type']!r}); read it with "
                "lmstack.model.hf.load_config, which reads both kinds"
            )
        try:
            return cls.from_dict(d)
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        key = name.lower()
        if key not in PRESETS:
            raise ConfigError(
                f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}"
            )
        return PRESETS[key].replace(**overrides)


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """A config file's JSON object; anything else (bad JSON or UTF-8, a number, a list) is a ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__} {d!r:.80}")
    return d


def _preset(name: str, **kw: Any) -> ModelConfig:
    return ModelConfig(name=name, **kw)


# Numbers from each model's public config.json on its HF hub page.
PRESETS: dict[str, ModelConfig] = {
    p.name: p
    for p in [
        _preset(
            "llama2-7b",
            vocab_size=32000,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=32,
            d_ff=11008,
            max_seq_len=4096,
            rope_theta=10000.0,
            norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        _preset(
            "llama2-13b",
            vocab_size=32000,
            d_model=5120,
            n_layers=40,
            n_heads=40,
            n_kv_heads=40,
            d_ff=13824,
            max_seq_len=4096,
            rope_theta=10000.0,
            norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        _preset(
            "llama2-70b",
            vocab_size=32000,
            d_model=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            d_ff=28672,
            max_seq_len=4096,
            rope_theta=10000.0,
            norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        _preset(
            "llama3-8b",
            vocab_size=128256,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            d_ff=14336,
            max_seq_len=8192,
            rope_theta=500000.0,
            norm_eps=1e-5,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
        _preset(
            "llama3-70b",
            vocab_size=128256,
            d_model=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            d_ff=28672,
            max_seq_len=8192,
            rope_theta=500000.0,
            norm_eps=1e-5,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
        # Mistral-7B-v0.1: GQA with K=8 and a 4096-token sliding window.
        _preset(
            "mistral-7b",
            vocab_size=32000,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            d_ff=14336,
            max_seq_len=32768,
            rope_theta=10000.0,
            norm_eps=1e-5,
            sliding_window=4096,
            architecture="mistral",
            bos_token_id=1,
            eos_token_id=2,
        ),
        _preset(
            "qwen2.5-0.5b",
            vocab_size=151936,
            d_model=896,
            n_layers=24,
            n_heads=14,
            n_kv_heads=2,
            d_ff=4864,
            max_seq_len=32768,
            rope_theta=1000000.0,
            norm_eps=1e-6,
            tie_embeddings=True,
            qkv_bias=True,
            architecture="qwen2",
            bos_token_id=151643,
            eos_token_id=151643,
        ),
        _preset(
            "smollm2-135m",
            vocab_size=49152,
            d_model=576,
            n_layers=30,
            n_heads=9,
            n_kv_heads=3,
            d_ff=1536,
            max_seq_len=8192,
            rope_theta=100000.0,
            norm_eps=1e-5,
            tie_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ]
}


def repeat_pattern(unit: list[str], n_layers: int) -> list[str]:
    """``unit`` repeated to ``n_layers`` layers: ``repeat_pattern(["linear_attention"] * 3 + ["attention"], 8)``
    is the 3:1 linear:full hybrid; ``["local_attention"] * 5 + ["attention"]`` Gemma's 5:1 local:global."""
    if not unit:
        raise ConfigError("repeat_pattern needs a non-empty unit of mixer names")
    return [unit[i % len(unit)] for i in range(n_layers)]


# --- mixture of experts / MLA presets (model/moe.py, model/mla.py): numbers from each model's HF config.json
PRESETS.update(
    {
        p.name: p
        for p in [
            _preset(
                "mixtral-8x7b",
                vocab_size=32000,
                d_model=4096,
                n_layers=32,
                n_heads=32,
                n_kv_heads=8,
                d_ff=14336,
                max_seq_len=32768,
                rope_theta=1e6,
                norm_eps=1e-5,
                architecture="mixtral",
                bos_token_id=1,
                eos_token_id=2,
                n_experts=8,
                n_experts_per_token=2,
                router_norm_topk=True,
            ),
            _preset(
                "olmoe-1b-7b",
                vocab_size=50304,
                d_model=2048,
                n_layers=16,
                n_heads=16,
                n_kv_heads=16,
                d_ff=1024,
                max_seq_len=4096,
                rope_theta=10000.0,
                norm_eps=1e-5,
                architecture="olmoe",
                eos_token_id=50279,
                n_experts=64,
                n_experts_per_token=8,
                qk_norm_full=True,
            ),
            _preset(
                "qwen1.5-moe-a2.7b",
                vocab_size=151936,
                d_model=2048,
                n_layers=24,
                n_heads=16,
                n_kv_heads=16,
                d_ff=5632,
                max_seq_len=8192,
                rope_theta=1e6,
                norm_eps=1e-6,
                qkv_bias=True,
                architecture="qwen2_moe",
                bos_token_id=151643,
                eos_token_id=151643,
                n_experts=60,
                n_experts_per_token=4,
                d_ff_expert=1408,
                n_shared_experts=1,
                d_ff_shared=5632,
                shared_expert_gate=True,
            ),
            _preset(
                "deepseek-v2-lite",
                vocab_size=102400,
                d_model=2048,
                n_layers=27,
                n_heads=16,
                n_kv_heads=16,
                d_ff=10944,
                head_dim=192,
                max_seq_len=163840,
                rope_theta=10000.0,
                rope_layout="interleaved",
                norm_eps=1e-6,
                architecture="deepseek_v2",
                bos_token_id=100000,
                eos_token_id=100001,
                n_experts=64,
                n_experts_per_token=6,
                d_ff_expert=1408,
                n_shared_experts=2,
                moe_first_dense=1,
                kv_lora_rank=512,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                rope_yarn=dict(
                    factor=40,
                    original_max_position_embeddings=4096,
                    beta_fast=32,
                    beta_slow=1,
                    mscale=0.707,
                    mscale_all_dim=0.707,
                ),
            ),
            _preset(
                "deepseek-v3",
                vocab_size=129280,
                d_model=7168,
                n_layers=61,
                n_heads=128,
                n_kv_heads=128,
                d_ff=18432,
                head_dim=192,
                max_seq_len=163840,
                rope_theta=10000.0,
                rope_layout="interleaved",
                norm_eps=1e-6,
                architecture="deepseek_v3",
                bos_token_id=0,
                eos_token_id=1,
                n_experts=256,
                n_experts_per_token=8,
                d_ff_expert=2048,
                n_shared_experts=1,
                moe_first_dense=3,
                router_score="sigmoid",
                router_norm_topk=True,
                router_scale=2.5,
                router_groups=8,
                router_topk_groups=4,
                router_aux_free_bias=True,
                kv_lora_rank=512,
                q_lora_rank=1536,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                rope_yarn=dict(
                    factor=40,
                    original_max_position_embeddings=4096,
                    beta_fast=32,
                    beta_slow=1,
                    mscale=1.0,
                    mscale_all_dim=1.0,
                ),
            ),
        ]
    }
)
