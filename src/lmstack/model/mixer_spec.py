"""Each token mixer declared once: what it is, what it costs, what cache it needs, what it supports.

Book: 注意力机制 (softmax attention, linear attention, Mamba-2, Gated DeltaNet, hybrids, DeepSeek sparse attention),
推理时注意力开销 (local layers keep a window of W keys), 有损提速 (MLA's latent cache), 张量并行 (which projections
split by heads, column- or row-parallel), 序列并行和上下文并行 (ring attention needs softmax over a KV set).

``SPECS[kind]`` is one ``MixerSpec`` per kind of layer; ``layer_kinds(config)`` names each layer's kind:
``config.mixer_types`` (``layer_types``, or ``"attention"`` everywhere), with the ``"attention"`` layers of an
MLA model (``kv_lora_rank > 0``) as ``"mla"``. Variants of softmax attention are properties of the layer, not
kinds: soft-capped scores (``attn_softcap``, Gemma-2: ``layer_softcap``), an output gate (``attn_output_gate``,
Qwen3-Next: its half of ``q_proj`` is counted in ``params``), per-head or whole-projection QK-norm (``qk_norm``,
``qk_norm_full``: ``norm_params``; the latter refuses tensor parallelism by name).

Everything here is arithmetic on ``ModelConfig`` — no torch — so ``lmstack.accounting`` may read it (import
contract ``accounting-reads-only-model-config``). The module a kind builds is ``model.mixers.MODULES[kind]``;
``tests/model/test_mixer_spec.py`` checks every count against ``sum(p.numel())`` of the built module.
``model.mixers.register_mixer(spec, build)`` adds a kind from outside the package (``register`` here, its module
there); ``tests/model/test_model_recipes.py`` does it with a toy mixer.

Per layer, one sequence at context S, B sequences of T new tokens (symbols of the book: D, N, K, H):

  attention          params 2·D·N·H + 2·D·K·H        FLOPs proj + 4·B·N·T·S·H        KV 2·K·H·S
  local_attention    the same, S → min(S, W)                                         KV 2·K·H·min(S, W − 1)
  mla                ``mla_params``                   proj + 2·B·N·T·S·(H_n + d_R + H_v)   latent (d_c + d_R)·S
  dsa                attention + indexer              proj + indexer + 4·B·N·T·min(S, k)·H  KV + H_I·S
  linear_attention   4·D·N·H                          proj + 4·B·T·N·H·(H + 1)         state N·H·(H + 1)
  mamba2             ``_mamba2_sizes``                proj + conv + 4·B·T·heads·N_state·P   state + conv inputs
  gated_deltanet     ``_delta_sizes``                 proj + conv + 6·B·T·n_v·H_k·H_v       state + conv inputs

FLOPs: 2 per multiply-add; biases, norms and elementwise gates not counted; the attention matrices counted in
full (T, min(S, W)) as a dense kernel computes them; recurrent mixers counted as their recurrence (per token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:  # only annotations: model.config reads LAYER_TYPES from here
    from lmstack.model.config import ModelConfig

#: the cache a kind needs: per-token K/V (a window of them), MLA's per-token latent, K/V plus DSA's indexer keys,
#: or an O(1) recurrent state (+ the short convolution's last inputs: a ``model.recurrent.RecurrentMixer``)
CACHES = ("kv", "latent", "kv+index", "state")
#: how a tensor-parallel plan treats a submodule: split its output features (column), its input features (row,
#: then all-reduce), or keep it whole on every rank with a gradient that is a partial sum (replicated)
TP_STYLES = ("column", "row", "replicated")

TPPlan = tuple[tuple[str, str], ...]


class UnsupportedMixer(ValueError):
    """A layer's mixer cannot run under the requested plan (tensor/context parallelism, paged engine, ...)."""


@dataclass(frozen=True)
class MixerSpec:
    """One kind of token mixer. Counting functions take the model's config (and the layer's kind is this spec).

    params(c)                        the mixer's own weights (its norm gammas are in ``norm_params``)
    norm_params(c)                   its RMSNorm gammas (QK-norm, MLA's latent norms)
    flops(c, B, T, S, window)        (weights, context) forward FLOPs of T new tokens per sequence attending S keys:
                                     the projections, and the score / state products
    cache_bytes(c, S, p, ps)         bytes kept for one sequence after S tokens (p: bytes per model-dtype element,
                                     ps: per state element)
    tp_plan(c)                       the (submodule, style) pairs it shards by heads, or raises ``UnsupportedMixer``
    """

    name: str
    title: str  # how messages name it ("Mamba-2")
    cache: str
    softmax: bool  # it runs the model's AttentionImpl (``Transformer.set_attention`` sets it)
    params: Callable[[ModelConfig], int]
    norm_params: Callable[[ModelConfig], int]
    flops: Callable[[ModelConfig, int, int, int, int | None], tuple[int, int]]
    cache_bytes: Callable[[ModelConfig, int, float, float], float]
    tp_plan: Callable[[ModelConfig], TPPlan]
    context_parallel: str | None  # None: ring attention can run it; else why not
    paged: str | None  # None: the paged engine serves it; else why not
    speculation: str | None  # None: drafts can be rolled back; else why not
    in_layer_types: bool = (
        True  # ``layer_types`` may name it (MLA is chosen by ``kv_lora_rank`` instead)
    )
    variants: bool = False  # softmax attention whose variants the config switches on (soft-cap, output gate, ...)


# ---- sizes -----------------------------------------------------------------------------------------------
def _mamba2_sizes(c: ModelConfig) -> dict[str, int]:
    inner = c.ssm_expand * c.d_model
    heads = inner // c.ssm_head_dim
    conv_dim = inner + 2 * c.ssm_n_groups * c.ssm_state_size
    return dict(inner=inner, heads=heads, conv_dim=conv_dim, in_out=inner + conv_dim + heads)


def _delta_sizes(c: ModelConfig) -> dict[str, int]:
    n_k = c.delta_n_heads or c.n_heads
    n_v = c.delta_n_v_heads or n_k
    assert c.head_dim is not None  # resolved by ModelConfig.__post_init__
    h_k = c.delta_head_dim or c.head_dim
    h_v = c.delta_v_head_dim or h_k
    return dict(
        n_k=n_k, n_v=n_v, h_k=h_k, h_v=h_v, conv_dim=2 * n_k * h_k + n_v * h_v, value_dim=n_v * h_v
    )


# ---- parameters ------------------------------------------------------------------------------------------
def attention_params(c: ModelConfig) -> int:
    """W_Q (N·H, D), W_K and W_V (K·H, D), W_O (D, N·H) = D·N·H + 2·D·K·H + N·H·D (book: 参数量); q/k/v biases
    N·H + 2·K·H with ``qkv_bias``; the output gate's half of q_proj D·N·H with ``attn_output_gate``."""
    D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    assert K is not None and H is not None  # resolved by ModelConfig.__post_init__
    p = D * N * H + 2 * D * K * H + N * H * D
    if c.qkv_bias:
        p += N * H + 2 * K * H + (N * H if c.attn_output_gate else 0)
    return p + (D * N * H if c.attn_output_gate else 0)


def attention_norm_params(c: ModelConfig) -> int:
    """QK-norm gammas: H each for q and k (per head), or (N + K)·H over whole projections (OLMoE)."""
    assert (
        c.head_dim is not None and c.n_kv_heads is not None
    )  # resolved by ModelConfig.__post_init__
    if c.qk_norm_full:
        return (c.n_heads + c.n_kv_heads) * c.head_dim
    return 2 * c.head_dim if c.qk_norm else 0


def mla_params(c: ModelConfig) -> int:
    """MLA (book: 有损提速): q = D·N(H_n + d_R) (or D·d_c' + d_c'·N(H_n + d_R) compressed), [W_DKV; W_KR]
    D·(d_c + d_R), [W_UK; W_UV] d_c·N(H_n + H_v), W_O N·H_v·D."""
    D, N = c.d_model, c.n_heads
    h_qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = D * c.q_lora_rank + c.q_lora_rank * N * h_qk if c.q_lora_rank else D * N * h_qk
    return (
        q
        + D * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank * N * (c.qk_nope_head_dim + c.v_head_dim)
        + N * c.v_head_dim * D
    )


def _dsa_indexer_params(c: ModelConfig) -> int:
    return c.d_model * (
        c.dsa_index_heads * c.dsa_index_head_dim + c.dsa_index_head_dim + c.dsa_index_heads
    )


def _mamba2_params(c: ModelConfig) -> int:
    m, D = _mamba2_sizes(c), c.d_model
    return (
        D * m["in_out"]
        + m["conv_dim"] * (c.conv_kernel + 1)
        + 3 * m["heads"]
        + m["inner"]
        + m["inner"] * D
    )


def _delta_params(c: ModelConfig) -> int:
    d, D = _delta_sizes(c), c.d_model
    return (
        D * (d["conv_dim"] + d["value_dim"] + 2 * d["n_v"])
        + d["conv_dim"] * c.conv_kernel
        + 2 * d["n_v"]
        + d["h_v"]
        + d["value_dim"] * D
    )


# ---- FLOPs: (weights, context) for B sequences of T tokens attending S keys --------------------------------
def attended_keys(S: int, window: int | None) -> int:
    """With a window W a query attends to min(S, W) keys, not S (book: 推理时注意力开销)."""
    return S if window is None else min(S, window)


def _proj_flops(c: ModelConfig, B: int, T: int) -> int:
    D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    assert K is not None and H is not None  # resolved by ModelConfig.__post_init__
    gate = D * N * H if c.attn_output_gate else 0
    return (
        2 * B * T * (2 * D * N * H + 2 * D * K * H + gate)
    )  # W_Q, W_K, W_V, W_O (+ the gate's projection)


def _attention_flops(c, B, T, S, window):
    return _proj_flops(c, B, T), 4 * B * c.n_heads * T * attended_keys(S, window) * c.head_dim


def _local_flops(c, B, T, S, window):
    w = c.local_window if window is None else min(window, c.local_window)
    return _attention_flops(c, B, T, S, w)


def _mla_flops(c, B, T, S, window):
    scores = (
        2
        * B
        * c.n_heads
        * T
        * attended_keys(S, window)
        * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    )
    return 2 * B * T * mla_params(
        c
    ), scores  # every MLA weight is one multiply-add per token; the expanded form


def _dsa_flops(c, B, T, S, window):
    proj, _ = _attention_flops(c, B, T, S, window)
    nI, HI = c.dsa_index_heads, c.dsa_index_head_dim
    indexer = 2 * B * T * _dsa_indexer_params(c) + 2 * B * T * nI * HI * S
    return proj + indexer, 4 * B * c.n_heads * T * min(
        attended_keys(S, window), c.dsa_top_k
    ) * c.head_dim


def _linear_flops(c, B, T, S, window):
    D, N, H = c.d_model, c.n_heads, c.head_dim
    cols = H + 1 if c.linear_normalize else H
    return 2 * B * T * 4 * D * N * H, 4 * B * T * N * H * cols  # S += k vᵀ, y = Sᵀ q


def _mamba2_flops(c, B, T, S, window):
    m, D = _mamba2_sizes(c), c.d_model
    proj = 2 * B * T * (D * m["in_out"] + m["inner"] * D + m["conv_dim"] * c.conv_kernel)
    return proj, 4 * B * T * m["heads"] * c.ssm_state_size * c.ssm_head_dim


def _delta_flops(c, B, T, S, window):
    d, D = _delta_sizes(c), c.d_model
    proj = (
        2
        * B
        * T
        * (
            D * (d["conv_dim"] + d["value_dim"] + 2 * d["n_v"])
            + d["value_dim"] * D
            + d["conv_dim"] * c.conv_kernel
        )
    )
    return proj, 6 * B * T * d["n_v"] * d["h_k"] * d["h_v"]  # Sᵀk, k uᵀ, Sᵀq


# ---- cache bytes per sequence after S tokens ---------------------------------------------------------------
def _kv_bytes(c, S, p, ps):
    return 2 * c.n_kv_heads * c.head_dim * S * p


def _local_bytes(c, S, p, ps):
    return (
        2 * c.n_kv_heads * c.head_dim * min(S, c.local_window - 1) * p
    )  # the W − 1 keys the next query needs


def _latent_bytes(c, S, p, ps):
    return (c.kv_lora_rank + c.qk_rope_head_dim) * S * p  # [c ; k_R] per token (book: 有损提速)


def _dsa_bytes(c, S, p, ps):
    return (2 * c.n_kv_heads * c.head_dim + c.dsa_index_head_dim) * S * p


def _linear_bytes(c, S, p, ps):
    return c.n_heads * c.head_dim * (c.head_dim + 1 if c.linear_normalize else c.head_dim) * ps


def _mamba2_bytes(c, S, p, ps):
    m = _mamba2_sizes(c)
    return (
        m["heads"] * c.ssm_state_size * c.ssm_head_dim * ps
        + m["conv_dim"] * (c.conv_kernel - 1) * p
    )


def _delta_bytes(c, S, p, ps):
    d = _delta_sizes(c)
    return d["n_v"] * d["h_k"] * d["h_v"] * ps + d["conv_dim"] * (c.conv_kernel - 1) * p


# ---- tensor-parallel plans ---------------------------------------------------------------------------------
def _attention_tp(c: ModelConfig) -> TPPlan:
    """Q, K, V column-parallel by heads (the output gate's per-head [q_h | gate_h] rows split with them), W_O
    row-parallel; per-head QK-norm gammas replicated (each rank's gradient covers its heads only)."""
    if c.qk_norm_full:
        raise UnsupportedMixer(
            "tensor parallelism: qk_norm_full=True (QK-norm over all heads' features at once, "
            "OLMoE) needs every head on every rank; it is not sharded"
        )
    plan = (("q_proj", "column"), ("k_proj", "column"), ("v_proj", "column"), ("o_proj", "row"))
    return plan + ((("q_norm", "replicated"), ("k_norm", "replicated")) if c.qk_norm else ())


def _linear_tp(c: ModelConfig) -> TPPlan:
    """Linear attention: every head's state is its own, so q, k, v split by heads like softmax attention."""
    return (("q_proj", "column"), ("k_proj", "column"), ("v_proj", "column"), ("o_proj", "row"))


def _mla_tp(c: ModelConfig) -> TPPlan:
    """MLA split by heads: the per-head up-projections (q_proj or q_b_proj, kv_b_proj: [W_UK; W_UV] per head)
    column-parallel, W_O row-parallel; the latent projections and their norms (kv_a_proj, kv_a_layernorm, q_a_proj,
    q_a_layernorm) shared by every head, so replicated (each rank's gradient covers its heads only)."""
    q = (
        (("q_a_proj", "replicated"), ("q_a_layernorm", "replicated"), ("q_b_proj", "column"))
        if c.q_lora_rank
        else (("q_proj", "column"),)
    )
    return q + (
        ("kv_a_proj", "replicated"),
        ("kv_a_layernorm", "replicated"),
        ("kv_b_proj", "column"),
        ("o_proj", "row"),
    )


def _refuse_tp(kind: str, why: str) -> Callable[[ModelConfig], TPPlan]:
    def plan(c: ModelConfig) -> TPPlan:
        raise UnsupportedMixer(f"tensor parallelism: {kind} layers are not sharded ({why})")

    return plan


def _none(c: ModelConfig) -> int:
    return 0


_RECURRENT_CP = (
    "its recurrence runs over contiguous tokens, and ring attention hands each rank two non-contiguous "
    "load-balanced chunks"
)
_NO_ROLLBACK = "its recurrent state cannot be rolled back past rejected drafts"

SPECS: dict[str, MixerSpec] = {
    s.name: s
    for s in [
        MixerSpec(
            "attention",
            "softmax attention",
            "kv",
            softmax=True,
            params=attention_params,
            norm_params=attention_norm_params,
            flops=_attention_flops,
            cache_bytes=_kv_bytes,
            tp_plan=_attention_tp,
            context_parallel=None,
            paged=None,
            speculation=None,
            variants=True,
        ),
        MixerSpec(
            "local_attention",
            "local attention",
            "kv",
            softmax=True,
            params=attention_params,
            norm_params=attention_norm_params,
            flops=_local_flops,
            cache_bytes=_local_bytes,
            tp_plan=_attention_tp,
            context_parallel="ring attention has no sliding window",
            paged=None,
            speculation=None,
            variants=True,
        ),
        MixerSpec(
            "linear_attention",
            "linear attention",
            "state",
            softmax=False,
            params=lambda c: 4 * c.d_model * c.n_heads * cast(int, c.head_dim),
            norm_params=_none,
            flops=_linear_flops,
            cache_bytes=_linear_bytes,
            tp_plan=_linear_tp,
            context_parallel=_RECURRENT_CP,
            paged=None,
            speculation=_NO_ROLLBACK,
        ),
        MixerSpec(
            "mamba2",
            "Mamba-2",
            "state",
            softmax=False,
            params=_mamba2_params,
            norm_params=_none,
            flops=_mamba2_flops,
            cache_bytes=_mamba2_bytes,
            tp_plan=_refuse_tp(
                "mamba2", "in_proj stacks [z | xBC | Δ] in one matrix, not split by heads"
            ),
            context_parallel=_RECURRENT_CP,
            paged=None,
            speculation=_NO_ROLLBACK,
        ),
        MixerSpec(
            "gated_deltanet",
            "Gated DeltaNet",
            "state",
            softmax=False,
            params=_delta_params,
            norm_params=_none,
            flops=_delta_flops,
            cache_bytes=_delta_bytes,
            tp_plan=_refuse_tp(
                "gated_deltanet", "in_proj_qkv stacks [q | k | v] in one matrix, not split by heads"
            ),
            context_parallel=_RECURRENT_CP,
            paged=None,
            speculation=_NO_ROLLBACK,
        ),
        MixerSpec(
            "dsa",
            "DSA",
            "kv+index",
            softmax=False,
            params=lambda c: attention_params(c) + _dsa_indexer_params(c),
            norm_params=attention_norm_params,
            flops=_dsa_flops,
            cache_bytes=_dsa_bytes,
            tp_plan=_refuse_tp(
                "dsa", "the lightning indexer scores every key with replicated weights"
            ),
            context_parallel="its indexer selects keys from the whole sequence",
            paged="its indexer keys are not stored in the paged blocks; decode DSA models with "
            "lmstack.inference.generate (MixerCache)",
            speculation=None,
        ),
        MixerSpec(
            "mla",
            "MLA",
            "latent",
            softmax=True,
            params=mla_params,
            norm_params=lambda c: c.kv_lora_rank + c.q_lora_rank,
            flops=_mla_flops,
            cache_bytes=_latent_bytes,
            tp_plan=_mla_tp,
            context_parallel="ring attention passes K and V of one head width; MLA's keys (H_n + d_R) and values "
            "(H_v) differ",
            paged=None,
            speculation=None,
            in_layer_types=False,
        ),
    ]
}
#: the built-in names ``ModelConfig.layer_types`` may hold (``config.MIXERS``): MLA is chosen by ``kv_lora_rank``
LAYER_TYPES = tuple(k for k, s in SPECS.items() if s.in_layer_types)


def layer_type_names() -> tuple[str, ...]:
    """The names ``ModelConfig.layer_types`` may hold now: the built-in ones and any ``register``-ed since."""
    return tuple(k for k, s in SPECS.items() if s.in_layer_types)


def register(s: MixerSpec) -> MixerSpec:
    """Declare a new kind of token mixer (from outside this file too): ``layer_types`` may name it, and
    accounting, tensor / context parallelism and the engine read its answers. Its module is registered beside it
    (``model.mixers.register_mixer`` does both). A name already declared is refused."""
    if s.name in SPECS:
        raise ValueError(f"mixer {s.name!r} is already declared; choose another name")
    if s.cache not in CACHES:
        raise ValueError(f"MixerSpec({s.name!r}).cache={s.cache!r}; expected one of {CACHES}")
    SPECS[s.name] = s
    return s


# ---- queries -------------------------------------------------------------------------------------------------
def attention_kind(c: ModelConfig) -> str:
    """The kind of this model's softmax-attention layers: ``"mla"`` when ``kv_lora_rank > 0``, else ``"attention"``."""
    return "mla" if c.is_mla else "attention"


def layer_kinds(c: ModelConfig) -> list[str]:
    """Each layer's mixer kind: ``config.mixer_types``, with an MLA model's softmax-attention layers as ``"mla"``."""
    return [attention_kind(c) if t == "attention" else t for t in c.mixer_types]


def layer_specs(c: ModelConfig) -> list[MixerSpec]:
    """Each layer's ``MixerSpec``."""
    return [SPECS[k] for k in layer_kinds(c)]


def softmax_layers(c: ModelConfig) -> list[int]:
    """The layers that run the model's AttentionImpl over a KV cache (a hybrid's others keep a state)."""
    return [i for i, s in enumerate(layer_specs(c)) if s.softmax]


def layer_softcap(c: ModelConfig, layer_idx: int) -> float | None:
    """The attention-logit soft-cap of layer ``layer_idx`` (Gemma-2's ``attn_softcap`` on its softmax-attention
    layers), which the layer's AttentionImpl must apply (``supports_softcap``), else None."""
    return c.attn_softcap if layer_specs(c)[layer_idx].variants else None


def unsupported(c: ModelConfig, ability: str) -> list[tuple[int, str, str]]:
    """(layer, kind, why) for every layer whose spec refuses ``ability`` ("context_parallel", "paged",
    "speculation")."""
    if ability not in ("context_parallel", "paged", "speculation"):
        raise ValueError(f"ability={ability!r}; expected context_parallel, paged or speculation")
    return [
        (i, s.name, getattr(s, ability))
        for i, s in enumerate(layer_specs(c))
        if getattr(s, ability) is not None
    ]


def refuse(c: ModelConfig, ability: str, what: str) -> None:
    """Raise ``UnsupportedMixer`` naming the first layer (and how many) whose mixer cannot do ``ability``."""
    bad = unsupported(c, ability)
    if bad:
        i, kind, why = bad[0]
        n = sum(k == kind for _, k, _ in bad)
        raise UnsupportedMixer(
            f"{what}: layer {i} is a {SPECS[kind].title} layer ({n} of {c.n_layers} layers): {why}"
        )


def tp_plan(c: ModelConfig, layer_idx: int) -> TPPlan:
    """Layer ``layer_idx``'s mixer's tensor-parallel plan (``UnsupportedMixer`` naming the layer when it has none)."""
    kind = layer_kinds(c)[layer_idx]
    try:
        return SPECS[kind].tp_plan(c)
    except UnsupportedMixer as e:
        raise UnsupportedMixer(f"layer {layer_idx} ({SPECS[kind].title}): {e}") from None


def spec(kind: str) -> MixerSpec:
    """The spec of ``kind`` (a clear error for an unknown one)."""
    if kind not in SPECS:
        raise ValueError(f"unknown mixer {kind!r}; expected one of {sorted(SPECS)}")
    return SPECS[kind]
