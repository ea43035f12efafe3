"""Layer patterns through the model: training forward/backward for any pattern, decode with MixerCache ==
full forward, the mixers against plain formulas, DSA against dense attention and brute-force top-k, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmstack.inference.kv_cache import MixerCache
from lmstack.model.config import ConfigError, ModelConfig, repeat_pattern
from lmstack.model.dsa import SparseAttention, index_scores, top_k_selection
from lmstack.model.linear_attention import LinearAttention
from lmstack.model.seam import AttentionMetadata, reference_attention
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
PATTERNS = {
    "3:1 linear:full": ["linear_attention"] * 3 + ["attention"],
    "3:1 deltanet:full": ["gated_deltanet"] * 3 + ["attention"],
    "5:1 local:global": ["local_attention"] * 5 + ["attention"],
    "pure linear": ["linear_attention"],
    "pure mamba2": ["mamba2"],
    "pure deltanet": ["gated_deltanet"],
    "pure full": ["attention"],
    "dsa": ["dsa", "attention"],
}


def _model(unit, n_layers=4, dtype=torch.float64, **kw):
    cfg = ModelConfig(
        **{**BASE, "n_layers": n_layers, **kw}, layer_types=repeat_pattern(unit, n_layers)
    )
    return Transformer(cfg).to(dtype)


@pytest.mark.usefixtures("one_thread")  # tiny float64 forwards: a second thread only adds overhead
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_training_forward_backward_any_pattern(name):
    n_layers = 6 if name.startswith("5:1") else 4
    model = _model(PATTERNS[name], n_layers, dtype=torch.float32)
    tokens = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1))
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(64)) < 1.0
    no_grad = [
        n for n, p in model.named_parameters() if p.grad is None and "idx_" not in n
    ]  # top-k: no indexer grad
    assert no_grad == []
    assert model.config.mixer_types == repeat_pattern(PATTERNS[name], n_layers)
    # the gradients against central finite differences, float64: per layer (and for the embedding), the
    # directional derivative of the loss along a random direction of that layer's parameters
    m64 = _model(PATTERNS[name], n_layers)

    def loss_of():
        return F.cross_entropy(m64(tokens)[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1))

    loss_of().backward()
    g = torch.Generator().manual_seed(2)
    for part in [m64.embed, *m64.blocks]:
        params = [p for n, p in part.named_parameters() if "idx_" not in n]
        dirs = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
        analytic = sum(float((p.grad * d).sum()) for p, d in zip(params, dirs))
        eps, ends = 1e-6, []
        with torch.no_grad():
            for sign in (1, -2, 1):  # +eps, -eps, back to the start
                for p, d in zip(params, dirs):
                    p.add_(sign * eps * d)
                if sign != 1 or not ends:
                    ends.append(float(loss_of()))
        numeric = (ends[0] - ends[1]) / (2 * eps)
        assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-9), (
            type(part).__name__,
            analytic,
            numeric,
        )


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_decode_with_state_cache_equals_full_forward(name):
    """Prefill 7 tokens, then 6 one at a time with a MixerCache: logits == one full forward (fp64)."""
    n_layers = 6 if name.startswith("5:1") else 4
    model = _model(PATTERNS[name], n_layers)
    tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    cache = MixerCache()
    with torch.no_grad():
        full = model(tokens)
        outs = [model(tokens[:, :7], positions=torch.arange(7), kv_cache=cache)]
        for i in range(7, 13):
            outs.append(model(tokens[:, i : i + 1], positions=torch.tensor([i]), kv_cache=cache))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-9)


def test_recurrent_state_is_constant_size():
    """A pure linear model's cache does not grow with the context; a full-attention one grows linearly."""
    sizes = {}
    for unit in (["gated_deltanet"], ["attention"]):
        model = _model(unit, dtype=torch.float32)
        cache = MixerCache()
        got = []
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long), positions=torch.arange(4), kv_cache=cache)
            for i in range(4, 12):
                model(
                    torch.zeros(1, 1, dtype=torch.long), positions=torch.tensor([i]), kv_cache=cache
                )
                got.append(sum(cache.nbytes().values()))
        sizes[unit[0]] = got
    assert len(set(sizes["gated_deltanet"])) == 1
    per_token = 4 * 2 * 2 * 8 * 4  # layers x (K and V) x kv heads x H x fp32 bytes
    assert [b - a for a, b in zip(sizes["attention"], sizes["attention"][1:])] == [per_token] * 7


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("fmap", ["elu1", "identity"])
def test_linear_attention_is_the_quadratic_formula(normalize, fmap):
    """y_t = Σ_{j≤t} (φ(q_t)·φ(k_j)) v_j [/ Σ_{j≤t} φ(q_t)·φ(k_j)], written out with a causal mask."""
    cfg = ModelConfig(
        **{**BASE, "n_layers": 1},
        layer_types=["linear_attention"],
        linear_feature_map=fmap,
        linear_normalize=normalize,
    )
    layer = LinearAttention(cfg).double()
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    phi = (lambda t: F.elu(t) + 1) if fmap == "elu1" else (lambda t: t)
    q = phi(layer.q_proj(x).view(2, 11, 4, 8).transpose(1, 2))
    k = phi(layer.k_proj(x).view(2, 11, 4, 8).transpose(1, 2))
    v = layer.v_proj(x).view(2, 11, 4, 8).transpose(1, 2)
    a = (q @ k.transpose(-1, -2)).tril()
    y = (a @ v) / (a.sum(-1, keepdim=True) + 1e-6) if normalize else (a / math.sqrt(8)) @ v
    ref = layer.o_proj(y.transpose(1, 2).reshape(2, 11, 32))
    torch.testing.assert_close(layer(x, AttentionMetadata(torch.arange(11), is_causal=True)), ref)


def test_local_attention_uses_its_layer_window():
    """A 'local_attention' layer equals the reference formula with a W-window mask built here by hand."""
    model = _model(["local_attention"], n_layers=1)
    layer = model.blocks[0].attn
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    q = layer.rope.rotate(layer.q_proj(x).view(1, 9, 4, 8).transpose(1, 2), torch.arange(9))
    k = layer.rope.rotate(layer.k_proj(x).view(1, 9, 2, 8).transpose(1, 2), torch.arange(9))
    v = layer.v_proj(x).view(1, 9, 2, 8).transpose(1, 2)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    mask = (j <= i) & (i - j < 3)
    ref = layer.o_proj(reference_attention(q, k, v, mask).transpose(1, 2).reshape(1, 9, 32))
    torch.testing.assert_close(layer(x, AttentionMetadata(torch.arange(9), is_causal=True)), ref)


# ---- DSA -------------------------------------------------------------------------------------------
def test_dsa_with_k_at_least_s_is_dense_causal_attention():
    dense = _model(["attention"], n_layers=2)
    sparse = _model(["dsa"], n_layers=2, dsa_top_k=16)
    sparse.load_state_dict(
        dense.state_dict(), strict=False
    )  # same q/k/v/o/FFN weights; indexer extra
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(sparse(tokens), dense(tokens))
        small = _model(["dsa"], n_layers=2, dsa_top_k=4)
        small.load_state_dict(sparse.state_dict())
        assert (small(tokens) - dense(tokens)).abs().max() > 1e-4  # k < S really drops keys


def test_dsa_indexer_top_k_matches_brute_force():
    gen = torch.Generator().manual_seed(6)
    B, T, nI, HI, k = 2, 10, 3, 4, 4
    q_idx, k_idx = torch.randn(B, T, nI, HI, generator=gen), torch.randn(B, T, HI, generator=gen)
    w = torch.randn(B, T, nI, generator=gen)
    scores = index_scores(q_idx, k_idx, w)
    chosen = top_k_selection(scores, torch.arange(T).expand(B, T), torch.arange(T).expand(B, T), k)
    for b in range(B):
        for t in range(T):
            s = [
                sum(
                    w[b, t, j].item() * max(0.0, float(q_idx[b, t, j] @ k_idx[b, u]))
                    for j in range(nI)
                )
                for u in range(t + 1)
            ]
            assert abs(s[-1] - scores[b, t, t].item()) < 1e-5
            best = sorted(range(t + 1), key=lambda u: (-s[u], u))[:k]
            assert sorted(chosen[b, t].nonzero().flatten().tolist()) == sorted(best)


def test_dsa_layer_attends_only_to_selected_keys():
    model = _model(["dsa"], n_layers=1, dsa_top_k=3)
    layer: SparseAttention = model.blocks[0].attn
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    q_idx, k_idx, w = layer.indexer(x)
    chosen = top_k_selection(
        index_scores(q_idx, k_idx, w), torch.arange(8)[None], torch.arange(8)[None], 3
    )
    q = layer.rope.rotate(layer.q_proj(x).view(1, 8, 4, 8).transpose(1, 2), torch.arange(8))
    k = layer.rope.rotate(layer.k_proj(x).view(1, 8, 2, 8).transpose(1, 2), torch.arange(8))
    v = layer.v_proj(x).view(1, 8, 2, 8).transpose(1, 2)
    ref = layer.o_proj(
        reference_attention(q, k, v, chosen[:, None]).transpose(1, 2).reshape(1, 8, 32)
    )
    torch.testing.assert_close(layer(x, AttentionMetadata(torch.arange(8), is_causal=True)), ref)


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,match",
    [
        (
            dict(layer_types=["attention", "mamba3", "attention", "attention"]),
            r"layer_types\[1\]='mamba3' \(layer 1\)",
        ),
        (dict(layer_types=["attention"] * 3), r"layer_types has 3 entries but n_layers=4"),
        (dict(layer_types="attention"), r"layer_types='attention'.*list"),
        (
            dict(layer_types=["local_attention"] * 4, local_window=None),
            r"layer_types\[0\]='local_attention'.*local_window",
        ),
        (dict(mixer_chunk_size=0), r"mixer_chunk_size"),
        (dict(linear_feature_map="softmax"), r"linear_feature_map='softmax'"),
        (
            dict(layer_types=["gated_deltanet"] * 4, delta_n_heads=3, delta_n_v_heads=4),
            r"delta_n_v_heads=4",
        ),
        (dict(layer_types=["mamba2"] * 4, ssm_head_dim=24), r"ssm_head_dim=24"),
    ],
)
def test_bad_patterns_and_sizes(kw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**BASE, **kw})


def test_recurrent_layer_needs_a_state_cache():
    from lmstack.model.cache import StoreThenAttend

    class KVOnly(StoreThenAttend):
        def update(self, layer_idx, k, v, positions):
            return k, v, positions

    model = _model(["gated_deltanet", "attention"], n_layers=2)
    with pytest.raises(TypeError, match=r"layer 0 \(gated_deltanet\).*MixerCache"):
        model(torch.zeros(1, 3, dtype=torch.long), positions=torch.arange(3), kv_cache=KVOnly())
    with pytest.raises(ValueError, match=r"layer 0 \(gated_deltanet\): document_ids with a cache"):
        model(
            torch.zeros(1, 3, dtype=torch.long),
            positions=torch.arange(3),
            kv_cache=MixerCache(),
            document_ids=torch.zeros(1, 3, dtype=torch.long),
        )


@pytest.mark.parametrize("name", [n for n in sorted(PATTERNS) if n != "dsa"])
def test_packed_documents_equal_separate_sequences(name):
    """Packing (document_ids, positions restarting per document): each document's logits are those of the
    document run alone — recurrent states and conv inputs restart at every boundary."""
    n_layers = 6 if name.startswith("5:1") else 4
    model = _model(PATTERNS[name], n_layers)
    lengths = [[5, 7, 4], [9, 7]]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(8))
    docs = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths])
    positions = torch.tensor([sum((list(range(n)) for n in row), []) for row in lengths])
    with torch.no_grad():
        packed = model(tokens, positions=positions, document_ids=docs)
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = model(tokens[b : b + 1, start : start + n])
                torch.testing.assert_close(
                    packed[b : b + 1, start : start + n], alone, rtol=1e-9, atol=1e-9
                )
                start += n


def test_conv_state_shape_mismatch_is_named():
    model = _model(["mamba2"], n_layers=1)
    cache = MixerCache()
    cache.set_state(0, (torch.zeros(1, 5, 3, dtype=torch.float64), None))
    with pytest.raises(ValueError, match=r"conv state has shape \(1, 5, 3\)"):
        model(torch.zeros(1, 1, dtype=torch.long), positions=torch.tensor([0]), kv_cache=cache)


def test_set_attention_skips_recurrent_layers():
    from lmstack.model.seam import ReferenceAttention

    model = _model(["linear_attention", "attention"], n_layers=2)
    impl = ReferenceAttention()
    model.set_attention(impl)
    assert model.blocks[1].attn.impl is impl and not hasattr(model.blocks[0].attn, "impl")
    assert model.attention is impl


def test_init_recurrent_parameters_reference_ranges():
    from lmstack.model.mixers import init_recurrent_parameters

    model = _model(["mamba2", "gated_deltanet"], n_layers=2, dtype=torch.float32)
    init_recurrent_parameters(model, seed=3)
    for block in model.blocks:
        m = block.attn
        A, dt = -m.A_log.exp(), F.softplus(m.dt_bias)
        assert ((A <= -1.0) & (A >= -16.0)).all() and (
            (dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001)
        ).all()
        assert m.conv1d.weight.abs().max() <= 0.5  # U(±1/√4)
    assert (model.blocks[0].attn.D == 1).all()
