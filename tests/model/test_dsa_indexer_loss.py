"""DSA's indexer objective (DeepSeek-V3.2): KL(p_t ‖ softmax(I_t)) with p_t the main attention summed over heads
and L1-normalised, dense warm-up (every causal key) and sparse stage (the selected top-k only). Checked against a
worked number and a float64 loop over queries and keys; the KL's gradients reach the indexer only."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmstack.model.config import ConfigError, ModelConfig, repeat_pattern
from lmstack.model.dsa import dsa_indexer_loss, indexer_kl_loss
from lmstack.model.seam import AttentionMetadata
from lmstack.model.transformer import Transformer

BASE = dict(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    dsa_top_k=3,
    dsa_index_heads=2,
    dsa_index_head_dim=8,
    max_seq_len=64,
    init_std=0.2,
)


def test_worked_number():
    """One query, two keys; heads' probabilities [.5, .5] and [1, 0] sum to [1.5, .5] -> p = [.75, .25];
    I = [0, ln 3] -> q = [.25, .75]; KL = .75 ln 3 + .25 ln(1/3) = ln(3)/2."""
    probs = torch.tensor([[[[0.5, 0.5]], [[1.0, 0.0]]]], dtype=torch.float64)  # (1, N=2, T=1, S=2)
    scores = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64)  # (1, 1, 2)
    allowed = torch.ones(1, 1, 2, dtype=torch.bool)
    assert indexer_kl_loss(scores, probs, allowed).item() == pytest.approx(
        math.log(3.0) / 2, rel=1e-12
    )
    # restricted to the first key only: p = q = [1] -> 0
    assert indexer_kl_loss(scores, probs, torch.tensor([[[True, False]]])).item() == pytest.approx(
        0.0, abs=1e-15
    )


def _loop_kl(scores, probs, allowed):
    """The definition, one query and one key at a time in Python floats."""
    B, N, T, S = probs.shape
    total = 0.0
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(S) if allowed[b, t, s]]
            mass = {s: sum(float(probs[b, h, t, s]) for h in range(N)) for s in keys}
            z1 = sum(mass.values())
            zq = sum(math.exp(float(scores[b, t, s])) for s in keys)
            kl = 0.0
            for s in keys:
                p, q = mass[s] / z1, math.exp(float(scores[b, t, s])) / zq
                if p > 0:
                    kl += p * math.log(p / q)
            total += kl
    return total / (B * T)


def test_loss_equals_the_definition():
    g = torch.Generator().manual_seed(0)
    B, N, T, S = 2, 3, 5, 5
    scores = torch.randn(B, T, S, generator=g, dtype=torch.float64) * 2
    causal = torch.ones(T, S, dtype=torch.bool).tril().expand(B, T, S)
    probs = torch.softmax(
        torch.randn(B, N, T, S, generator=g, dtype=torch.float64).masked_fill(
            ~causal[:, None], -torch.inf
        ),
        -1,
    )
    assert indexer_kl_loss(scores, probs, causal).item() == pytest.approx(
        _loop_kl(scores, probs, causal), rel=1e-12
    )
    subset = causal & (torch.rand(B, T, S, generator=g) < 0.6)
    subset[..., 0] = True  # every query keeps at least one key
    assert indexer_kl_loss(scores, probs, subset).item() == pytest.approx(
        _loop_kl(scores, probs, subset), rel=1e-12
    )


def _layer(**kw):
    cfg = ModelConfig(**{**BASE, **kw}, layer_types=repeat_pattern(["dsa", "attention"], 2))
    torch.manual_seed(0)
    model = Transformer(cfg, seed=1).to(torch.float64)
    return model, model.blocks[0].attn


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "dense-warmup"])
def test_layer_loss_against_float64_reference(warmup):
    """The layer's stored loss == weight × the loop KL over the keys it attends to, the target being the
    attention probabilities recomputed from q, k with an explicit softmax; dense warm-up output == dense attention."""
    model, layer = _layer(dsa_indexer_loss=0.5, dsa_dense_warmup=warmup)
    x = torch.randn(2, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(7)
    out = layer(x, AttentionMetadata(pos))
    with torch.no_grad():
        q, k, v = layer.project(x)
        q, k = layer.rope.rotate(q, pos), layer.rope.rotate(k, pos)
        B, T = 2, 7
        qi = (x @ layer.idx_q.weight.T).view(B, T, 2, 8) / math.sqrt(8)
        ki = x @ layer.idx_k.weight.T
        wi = (x @ layer.idx_w.weight.T) / math.sqrt(2)
        scores = torch.einsum(
            "btj,btjs->bts", wi, torch.relu(torch.einsum("btjh,bsh->btjs", qi, ki))
        )
        allowed = torch.zeros(B, T, T, dtype=torch.bool)
        for b in range(B):
            for t in range(T):
                visible = list(range(t + 1))
                keep = (
                    visible
                    if warmup
                    else sorted(visible, key=lambda s: (-float(scores[b, t, s]), s))[:3]
                )
                allowed[b, t, keep] = True
        kk = k.repeat_interleave(2, dim=1)
        logits = (q @ kk.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        probs = torch.softmax(logits.masked_fill(~allowed[:, None], -torch.inf), -1)
        want = 0.5 * _loop_kl(scores, probs, allowed)
        vv = v.repeat_interleave(2, dim=1)
        ref_out = layer.o_proj((probs @ vv).transpose(1, 2).reshape(B, T, -1))
    assert layer.indexer_loss.item() == pytest.approx(want, rel=1e-10)
    torch.testing.assert_close(out, ref_out)
    if warmup:  # every causal key: the dense causal softmax
        dense = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        torch.testing.assert_close(out, layer.o_proj(dense.transpose(1, 2).reshape(B, T, -1)))


def test_gradients_reach_only_the_indexer():
    model, _ = _layer(dsa_indexer_loss=1.0)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    logits = model(tokens)
    aux = dsa_indexer_loss(model)
    assert aux is not None and aux.item() > 0
    aux.backward(retain_graph=True)
    got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got == {
        "blocks.0.attn.idx_q.weight",
        "blocks.0.attn.idx_k.weight",
        "blocks.0.attn.idx_w.weight",
    }
    model.zero_grad(set_to_none=True)
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1))
    lm.backward()
    assert all(
        p.grad is None for n, p in model.named_parameters() if "idx_" in n
    )  # the LM loss never reaches it


def test_off_without_gradients_or_weight():
    model, layer = _layer(dsa_indexer_loss=1.0)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert layer.indexer_loss is None and dsa_indexer_loss(model) is None
    model, layer = _layer()
    model(torch.zeros(1, 4, dtype=torch.long))
    assert layer.indexer_loss is None


def test_indexer_training_lowers_the_kl():
    """A few Adam steps on the KL alone move the indexer towards the main attention."""
    model, layer = _layer(dsa_indexer_loss=1.0, dsa_dense_warmup=True)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if "idx_" in n], lr=3e-2)
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(4))
    losses = []
    for _ in range(15):
        model(tokens)
        loss = dsa_indexer_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dsa_indexer_loss=-1.0), r"dsa_indexer_loss=-1.0 must be >= 0"),
        (dict(dsa_indexer_loss="big"), r"dsa_indexer_loss='big' must be a number"),
        (dict(dsa_dense_warmup="yes"), r"dsa_dense_warmup='yes' must be true or false"),
    ],
)
def test_bad_settings(kw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**BASE, **kw})


def test_dense_warmup_decode_equals_its_forward():
    """A warm-up model attends densely in decode too: cached decode logits == one full forward."""
    from lmstack.inference.kv_cache import MixerCache

    model, _ = _layer(dsa_dense_warmup=True)
    tokens = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(5))
    cache = MixerCache()
    with torch.no_grad():
        full = model(tokens)
        outs = [model(tokens[:, :4], positions=torch.arange(4), kv_cache=cache)]
        outs += [
            model(tokens[:, t : t + 1], positions=torch.tensor([t]), kv_cache=cache)
            for t in range(4, 10)
        ]
    torch.testing.assert_close(torch.cat(outs, dim=1), full)
