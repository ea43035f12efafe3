"""The mixer specs (lmstack.model.mixer_spec) against independent references: parameter counts against
``sum(p.numel())`` of the built model for every kind of layer and block variant, FLOPs against a hand count of a
hybrid, and what a layer refuses (tensor / context parallelism, a backend without soft-capping) by name."""

import pytest
import torch

from lmstack.accounting.flops import forward_flops, training_step_flops
from lmstack.accounting.memory import inference_memory
from lmstack.accounting.params import param_counts, total_params
from lmstack.model.config import MIXERS, ModelConfig, repeat_pattern
from lmstack.model.mixer_spec import CACHES, SPECS, TP_STYLES, UnsupportedMixer, layer_kinds
from lmstack.model.mixers import MODULES
from lmstack.model.seam import AttentionMetadata, ReferenceAttention, SDPAAttention
from lmstack.model.transformer import Transformer

BASE = dict(
    vocab_size=64,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    ssm_head_dim=16,
    ssm_state_size=8,
    mixer_chunk_size=4,
    local_window=3,
    dsa_top_k=3,
    dsa_index_heads=2,
    dsa_index_head_dim=8,
    max_seq_len=64,
)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
GEMMA = dict(
    layer_types=repeat_pattern(["local_attention", "attention"], 4),
    sandwich_norm=True,
    norm_offset=True,
    ffn_act="gelu_tanh",
    embed_scale=True,
    attn_softcap=50.0,
    final_softcap=30.0,
    query_pre_attn_scalar=8.0,
    qk_norm=True,
)
MODELS = {
    "llama": {},
    "qkv-bias, qk-norm, tied": dict(qkv_bias=True, qk_norm=True, tie_embeddings=True),
    "gpt-j parallel block": dict(parallel_block=True),
    "olmoe qk-norm over heads": dict(qk_norm_full=True, qkv_clip=8.0),
    "moe": dict(
        n_experts=4,
        n_experts_per_token=2,
        d_ff_expert=16,
        n_shared_experts=1,
        moe_first_dense=1,
        router_aux_free_bias=True,
        shared_expert_gate=True,
    ),
    "mla": MLA,
    "mla, compressed q": dict(MLA, q_lora_rank=12),
    "local:global": dict(layer_types=repeat_pattern(["local_attention", "attention"], 4)),
    "3:1 linear": dict(layer_types=repeat_pattern(["linear_attention"] * 3 + ["attention"], 4)),
    "3:1 mamba2": dict(layer_types=repeat_pattern(["mamba2"] * 3 + ["attention"], 4)),
    "mamba2, no ffn": dict(layer_types=["mamba2"] * 4, block_ffn=False),
    "3:1 gated deltanet": dict(
        layer_types=repeat_pattern(["gated_deltanet"] * 3 + ["attention"], 4)
    ),
    "dsa, qk-norm": dict(layer_types=["dsa"] * 4, qk_norm=True),
    "gemma-2 like": GEMMA,
    "output-gated (qwen3-next)": dict(
        layer_types=repeat_pattern(["gated_deltanet"] * 3 + ["attention"], 4),
        attn_output_gate=True,
        rotary_dim=4,
        norm_offset=True,
        qk_norm=True,
        qkv_bias=True,
    ),
}


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**BASE, **kw})


def _meta_model(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def test_every_spec_has_a_module():
    assert (
        set(SPECS)
        == set(MODULES)
        == {
            "attention",
            "local_attention",
            "mla",
            "dsa",
            "linear_attention",
            "mamba2",
            "gated_deltanet",
        }
    )
    assert MIXERS == (
        "attention",
        "local_attention",
        "linear_attention",
        "mamba2",
        "gated_deltanet",
        "dsa",
    )
    for s in SPECS.values():
        assert s.cache in CACHES
        try:
            assert all(style in TP_STYLES for _, style in s.tp_plan(_cfg(qk_norm=True)))
        except UnsupportedMixer:
            pass


@pytest.mark.parametrize("name", MODELS)
def test_param_counts_equal_the_built_model(name):
    """total_params (what `lmstack plan`, the memory estimates and 6ND use) == sum(p.numel()) of the model, and
    each layer's mixer weights / norms == its spec's count (before the specs, every non-Llama row was wrong)."""
    cfg = _cfg(**MODELS[name])
    model = _meta_model(cfg)
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())
    pc = param_counts(cfg)
    assert pc.embedding + pc.unembedding == sum(
        p.numel() for n, p in model.named_parameters() if n.startswith(("embed.", "lm_head."))
    )
    assert pc.ffn == sum(p.numel() for n, p in model.named_parameters() if ".ffn." in n)
    for i, (block, kind) in enumerate(zip(model.blocks, layer_kinds(cfg))):
        norms = sum(
            p.numel() for n, p in block.attn.named_parameters() if "norm" in n.split(".")[0]
        )
        own = sum(p.numel() for p in block.attn.parameters()) - norms
        if kind in ("mamba2", "gated_deltanet"):  # their gated norm is part of the mixer (``norm``)
            own, norms = own + norms, 0
        assert (SPECS[kind].params(cfg), SPECS[kind].norm_params(cfg)) == (own, norms), (i, kind)


def test_param_counts_of_the_issue_table():
    """The four models issue 29 measured (V=97, D=64, L=4, N=4, K=2, F=128): the Llama formula said 160,448 for
    each; the built models hold 207,848 / 198,432 / 160,960 / 176,832 parameters, and so does total_params now."""
    base = dict(
        vocab_size=97, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    assert total_params(ModelConfig(**base)) == 160_448
    for kw, real in [
        (
            dict(
                layer_types=repeat_pattern(["mamba2"] * 3 + ["attention"], 4),
                ssm_head_dim=16,
                ssm_state_size=16,
            ),
            207_848,
        ),  # a 3:1 Mamba-2 hybrid
        (dict(layer_types=["gated_deltanet"] * 4), 198_432),  # Gated DeltaNet
        (
            dict(
                layer_types=repeat_pattern(["local_attention", "attention"], 4),
                local_window=8,
                sandwich_norm=True,
                norm_offset=True,
                ffn_act="gelu_tanh",
            ),
            160_960,
        ),  # Gemma-like
        (dict(attn_output_gate=True), 176_832),  # output-gated attention (Qwen3-Next)
    ]:
        cfg = ModelConfig(**base, **kw)
        assert sum(p.numel() for p in _meta_model(cfg).parameters()) == real
        assert total_params(cfg) == real


def test_flops_of_a_hybrid_by_hand():
    """forward FLOPs of a 2-layer [gated_deltanet, local_attention] model with a 2-expert top-1 MoE in layer 1,
    B=1, T=S=10, counted by hand (2 per multiply-add)."""
    cfg = _cfg(
        n_layers=2,
        layer_types=["gated_deltanet", "local_attention"],
        local_window=3,
        n_experts=2,
        n_experts_per_token=1,
        moe_first_dense=1,
    )
    T = 10
    # D=32, N=4, K=2, H=8; deltanet: n_k = n_v = 4 heads of 8: conv_dim = 2·32 + 32 = 96, value 32
    delta = T * (
        2 * 32 * (96 + 32 + 2 * 4) + 2 * 32 * 32 + 2 * 96 * 4
    )  # in_proj_qkv, z, a, b; out_proj; conv K=4
    delta += T * 6 * 4 * 8 * 8  # Sᵀk, k uᵀ, Sᵀq per head
    local = T * 2 * 32 * (2 * 4 * 8 + 2 * 2 * 8)  # W_Q, W_O (N·H = 32) and W_K, W_V (K·H = 16)
    local += 4 * 4 * T * 3 * 8  # QKᵀ and A·V over min(S, W) = 3 keys per query, N = 4 heads
    ffn_dense = T * 6 * 32 * 64  # layer 0: SwiGLU, F = 64
    ffn_moe = T * 2 * (2 * 32 + 1 * 3 * 32 * 64)  # layer 1: router E·D + one active expert of 3·D·F
    logits = T * 2 * 32 * 64
    want = delta + local + ffn_dense + ffn_moe + logits
    assert forward_flops(cfg, 1, T) == want
    assert training_step_flops(cfg, 1, T) == 3 * want  # the trainer's MFU numerator


def test_inference_memory_holds_the_states():
    """A hybrid's recurrent states are in the cache estimate: 3 Mamba-2 layers' fp32 states + conv inputs."""
    cfg = _cfg(layer_types=repeat_pattern(["mamba2"] * 3 + ["attention"], 4))
    mem = inference_memory(cfg, 1, 100, "fp32")
    # attention: 2·K·H·S = 2·2·8·100 elements; mamba2: 4 heads·8·16 state + 80 conv channels·3 inputs, each fp32
    assert mem.kv_cache == 4 * (2 * 2 * 8 * 100 + 3 * (4 * 8 * 16 + 80 * 3))


# ---- what a layer refuses, by name, before anything runs ----------------------------------------------------
@pytest.mark.parametrize(
    "name,kw,match",
    [
        (
            "mamba2",
            dict(layer_types=["attention", "mamba2", "attention", "mamba2"]),
            r"layer 1 \(Mamba-2\).*in_proj",
        ),
        (
            "gated deltanet",
            dict(layer_types=["gated_deltanet"] * 4),
            r"layer 0 \(Gated DeltaNet\).*in_proj_qkv",
        ),
        ("dsa", dict(layer_types=["dsa"] * 4), r"layer 0 \(DSA\).*indexer"),
        ("olmoe", dict(qk_norm_full=True), r"layer 0 \(softmax attention\).*qk_norm_full=True"),
    ],
)
def test_tensor_parallel_refuses_by_name_before_sharding(name, kw, match):
    from lmstack.parallel.tensor import ColumnParallelLinear, tensor_parallel

    model = Transformer(_cfg(**kw))
    with pytest.raises(UnsupportedMixer, match=match):
        tensor_parallel(model, None)  # refused before the (absent) process group is asked anything
    assert not any(
        isinstance(m, ColumnParallelLinear) for m in model.modules()
    )  # nothing was sharded


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            dict(layer_types=["attention", "gated_deltanet"] * 2),
            r"layer 1 is a Gated DeltaNet layer.*non-contiguous",
        ),
        (dict(layer_types=["mamba2"] * 4), r"layer 0 is a Mamba-2 layer \(4 of 4 layers\)"),
        (
            dict(layer_types=["linear_attention", "attention"] * 2),
            r"layer 0 is a linear attention layer",
        ),
        (
            dict(layer_types=["local_attention", "attention"] * 2),
            r"layer 0 is a local attention layer",
        ),
        (MLA, r"layer 0 is a MLA layer"),
    ],
)
def test_context_parallel_refuses_by_name(kw, match):
    from lmstack.parallel.context import context_parallel

    model = Transformer(_cfg(**kw))
    before = model.attention
    with pytest.raises(UnsupportedMixer, match="context parallelism: " + match):
        context_parallel(model, None)
    assert model.attention is before


# ---- soft-capping: metadata a backend applies or is refused for -----------------------------------------------
def test_softcap_reference_is_the_formula():
    """ReferenceAttention with ``meta.softcap`` = softmax(c·tanh(QKᵀ/(√H·c)) + causal mask) V, written out here."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=g, dtype=torch.float64) * 6 for _ in range(3))
    c = 2.0
    s = c * torch.tanh(q @ k.transpose(-1, -2) / 8**0.5 / c)
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -torch.inf)
    want = torch.softmax(s, -1) @ v
    meta = AttentionMetadata(torch.arange(5), is_causal=True, softcap=c)
    torch.testing.assert_close(ReferenceAttention()(q, k, v, meta), want)
    assert not torch.allclose(
        ReferenceAttention()(q, k, v, AttentionMetadata(torch.arange(5), is_causal=True)), want
    )


def test_softcapped_layers_honour_the_backend_or_refuse_it():
    """Gemma-2's capped layers run what the model reports; a backend that cannot cap is refused by name (before,
    ``model.attention`` and configure()'s line said "sdpa" while the layers quietly ran their own formula)."""
    from lmstack.kernels.runtime import RuntimeConfig, configure
    from lmstack.parallel.context import RingAttention

    cfg = _cfg(**GEMMA)
    model = Transformer(cfg, dtype=torch.float64)
    assert model.attention.name == "reference" and model.attention_needs() == ("softcap",)
    with pytest.raises(
        ValueError,
        match=r"attention backend 'sdpa' does not apply attention-logit soft-capping "
        r"\(attn_softcap=50.0 in layers \[0, 1, 2, 3\]\)",
    ):
        model.set_attention(SDPAAttention())
    with pytest.raises(
        ValueError, match="'ring' does not apply"
    ):  # context parallelism's implementation
        model.set_attention(RingAttention(None))
    with pytest.raises(ValueError, match="'matmul' does not apply"):
        configure(model, RuntimeConfig(attn_backend="matmul"), device="cpu")
    line = configure(model, RuntimeConfig(attn_backend="auto"), device="cpu")
    assert line.startswith("attention: reference (auto: soft-capped attention scores)")
    assert model.attention.name == "reference"
    # the cap is applied: the same weights with a tight cap (|s| <= 1e-3) and without one give other logits
    tokens = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    tight, uncapped = (
        Transformer(cfg.replace(attn_softcap=cap), dtype=torch.float64) for cap in (1e-3, None)
    )
    for m in (tight, uncapped):
        m.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(tight(tokens), uncapped(tokens), rtol=0, atol=1e-9)
    # ... and a model without soft-capped layers keeps the fast default
    plain = Transformer(_cfg())
    assert plain.attention_needs() == () and configure(
        plain, RuntimeConfig(), device="cpu"
    ).startswith("attention: sdpa")
