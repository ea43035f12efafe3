"""MoE FFN: routers vs hand computations, balance losses vs the seed's closed forms, grouped compute vs
a per-expert reference, capacity dropping, aux-free bias, and the one-expert case vs the dense SwiGLU."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.layers import SwiGLU
from lmstack.model.moe import (
    MoE,
    Routing,
    balance_loss,
    device_balance_loss,
    hash_route,
    loop_reference,
    moe_aux_loss,
    moe_metrics,
    route,
    update_router_biases,
    z_loss,
)
from lmstack.model.transformer import Transformer

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.1, 2.9]])


def _softmax(row):
    e = np.exp(np.asarray(row, dtype=np.float64) - max(row))
    return e / e.sum()


def test_softmax_then_topk_weights_by_hand():
    r = route(LOGITS, k=2)
    p0, p1 = _softmax([2.0, 1.0, 0.5, -1.0]), _softmax([0.0, 3.0, 0.1, 2.9])
    assert sorted(r.expert_ids[0].tolist()) == [0, 1] and sorted(r.expert_ids[1].tolist()) == [1, 3]
    got = {(t, int(e)): float(w) for t in range(2) for e, w in zip(r.expert_ids[t], r.weights[t])}
    assert got[(0, 0)] == pytest.approx(p0[0], abs=1e-6) and got[(0, 1)] == pytest.approx(
        p0[1], abs=1e-6
    )
    assert got[(1, 1)] == pytest.approx(p1[1], abs=1e-6) and got[(1, 3)] == pytest.approx(
        p1[3], abs=1e-6
    )
    rn = route(LOGITS, k=2, norm_topk=True)
    assert rn.weights.sum(-1).tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    assert float(rn.weights[0].max()) == pytest.approx(p0[0] / (p0[0] + p0[1]), abs=1e-6)
    # top-k of the logits then softmax over those k = renormalised softmax-then-top-k
    rt = route(LOGITS, k=2, order="topk_softmax")
    assert float(rt.weights[1].max()) == pytest.approx(
        math.exp(3.0) / (math.exp(3.0) + math.exp(2.9)), abs=1e-6
    )
    assert torch.allclose(rt.weights.sort(-1).values, rn.weights.sort(-1).values, atol=1e-6)


def test_sigmoid_scores_bias_selects_but_does_not_gate():
    r = route(LOGITS, k=1, score="sigmoid", scale=2.5)
    assert r.expert_ids[:, 0].tolist() == [0, 1]
    assert r.weights[:, 0].tolist() == pytest.approx(
        [2.5 / (1 + math.exp(-2.0)), 2.5 / (1 + math.exp(-3.0))], abs=1e-6
    )
    # probs for the balance loss: scores normalised per token
    s = 1 / (1 + np.exp(-LOGITS[0].double().numpy()))
    assert r.probs[0].tolist() == pytest.approx((s / s.sum()).tolist(), abs=1e-6)
    bias = torch.tensor([-1.0, 0.0, 0.0, 1.0])  # pushes selection toward expert 3
    rb = route(LOGITS, k=1, score="sigmoid", bias=bias)
    assert rb.expert_ids[:, 0].tolist() == [3, 3]
    assert rb.weights[0, 0].item() == pytest.approx(
        1 / (1 + math.exp(1.0)), abs=1e-6
    )  # σ(-1): unbiased score


def test_group_limited_routing_excludes_other_groups():
    # groups {0,1} and {2,3}; V2 (softmax, max per group): token 0's best group is {0,1}
    logits = torch.tensor([[2.0, 1.9, 1.95, -5.0]])
    assert sorted(route(logits, k=2).expert_ids[0].tolist()) == [0, 2]  # unrestricted
    assert sorted(route(logits, k=2, n_groups=2, topk_groups=1).expert_ids[0].tolist()) == [0, 1]
    # V3 (sigmoid, sum of top-2 per group): group {2,3} wins by its sum although expert 0 is the best single
    logits = torch.tensor([[3.0, -4.0, 2.0, 2.0]])
    r = route(logits, k=2, score="sigmoid", n_groups=2, topk_groups=1)
    assert sorted(r.expert_ids[0].tolist()) == [2, 3]


def test_balance_loss_value_and_gradient_vs_closed_form():
    torch.manual_seed(0)
    T, E, k = 7, 4, 2
    probs = torch.softmax(torch.randn(T, E), dim=-1).requires_grad_(True)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0], [1, 2], [0, 3], [2, 0]])
    loss = balance_loss(probs, ids, E)
    counts = np.bincount(ids.numpy().ravel(), minlength=E)
    f = counts / (T * k)
    P = probs.detach().numpy().mean(axis=0)
    assert loss.item() == pytest.approx(E * float((f * P).sum()), rel=1e-6)
    loss.backward()
    # seed: ∂loss/∂p_i(x) = α·N·f_i / T (α = 1 here), the same for every token x
    expected = np.tile(E * f / T, (T, 1))
    np.testing.assert_allclose(probs.grad.numpy(), expected, rtol=1e-6)
    # k = 1 is the seed's argmax count
    ids1 = probs.detach().argmax(-1, keepdim=True)
    f1 = np.bincount(ids1.numpy().ravel(), minlength=E) / T
    assert balance_loss(probs.detach(), ids1, E).item() == pytest.approx(
        E * float((f1 * P).sum()), rel=1e-6
    )
    # uniform router and load: exactly 1
    assert balance_loss(
        torch.full((8, 4), 0.25), torch.arange(8)[:, None] % 4, 4
    ).item() == pytest.approx(1.0)


def test_device_balance_and_z_loss_by_hand():
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]])
    ids = torch.tensor([[0], [1]])
    # devices {0,1}, {2,3}: f = [.5,.5,0,0] -> N·f = [2,2,0,0]; f' = [2, 0]; P = [.55,.25,.1,.1] -> P' = [.8, .2]
    assert device_balance_loss(probs, ids, 4, 2).item() == pytest.approx(2 * 0.8, rel=1e-6)
    with pytest.raises(ValueError, match="n_experts=4 is not divisible by n_devices=3"):
        device_balance_loss(probs, ids, 4, 3)
    lse = np.log(np.exp(LOGITS.double().numpy()).sum(axis=1))
    assert z_loss(LOGITS).item() == pytest.approx(float((lse**2).mean()), rel=1e-6)


def _moe(**kw):
    torch.manual_seed(0)
    args = dict(d_model=16, n_experts=4, k=2, d_ff=24)
    args.update(kw)
    return MoE(**args)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "F.linear"])
@pytest.mark.parametrize("shared", [0, 1])
def test_grouped_compute_equals_per_expert_loop(shared, onednn):
    from lmstack.ops import gemm

    saved = gemm.set_gemm(gemm.choose_gemm("onednn" if onednn else "blas"))  # every lmstack GEMM
    try:
        _check_grouped_against_loop(gemm, shared, onednn)
    finally:
        gemm.set_gemm(saved)


def _token_by_token(x, moe, shared):
    """The MoE written out here, one token at a time in float64 from the module's weights (nothing from
    lmstack.model.moe): logits = x Wᵀ, p = softmax, the top-2 experts, gates p_i / Σ_top p (norm_topk),
    y = Σ_i g_i · W_down,i (silu(W_gate,i x) ⊙ W_up,i x) (+ sigmoid(w_s · x) · shared SwiGLU(x))."""
    Wr, Wg, Wu, Wd = (
        w.double()
        for w in (moe.router.weight, moe.gate_proj.weight, moe.up_proj.weight, moe.down_proj.weight)
    )
    rows = []
    for xt in x.double():  # (D,)
        p = torch.softmax(Wr @ xt, dim=0)  # (E,)
        top = sorted(range(len(p)), key=lambda e: -float(p[e]))[:2]
        yt = sum(
            p[e] / (p[top[0]] + p[top[1]]) * (Wd[e] @ (F.silu(Wg[e] @ xt) * (Wu[e] @ xt)))
            for e in top
        )
        if shared:
            sw = moe.shared
            s = sw.down_proj.weight.double() @ (
                F.silu(sw.gate_proj.weight.double() @ xt) * (sw.up_proj.weight.double() @ xt)
            )
            yt = yt + torch.sigmoid(moe.shared_gate.weight.double()[0] @ xt) * s
        rows.append(yt)
    return torch.stack(rows)  # (T, D)


def _check_grouped_against_loop(gemm, shared, onednn):
    moe = _moe(n_shared=shared, d_ff_shared=20, shared_gate=bool(shared), norm_topk=True)
    x = torch.randn(3, 5, 16, requires_grad=True)
    if onednn and not gemm.onednn_ok(x):
        pytest.skip("this torch build has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
    y = moe(x)
    x2 = x.detach().clone().requires_grad_(True)
    ref = _token_by_token(x2.reshape(-1, 16), moe, shared)
    torch.testing.assert_close(y.reshape(-1, 16).double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    ws = (moe.router.weight, moe.gate_proj.weight, moe.up_proj.weight, moe.down_proj.weight)
    got = torch.autograd.grad(y, (x, *ws), g)
    want = torch.autograd.grad(ref, (x2, *ws), g.reshape(-1, 16).double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)
    if (
        not shared
    ):  # and lmstack's own per-expert loop (other tests' reference) agrees with this one
        flat = x.detach().reshape(-1, 16)
        torch.testing.assert_close(
            loop_reference(flat, moe.routing(flat), *ws[1:]).double(),
            ref.detach(),
            atol=1e-5,
            rtol=1e-5,
        )


def test_one_expert_top1_equals_dense_swiglu():
    moe = _moe(n_experts=1, k=1)
    dense = SwiGLU(16, 24)
    with torch.no_grad():
        dense.gate_proj.weight.copy_(moe.gate_proj.weight[0])
        dense.up_proj.weight.copy_(moe.up_proj.weight[0])
        dense.down_proj.weight.copy_(moe.down_proj.weight[0])
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(moe(x), dense(x), atol=1e-6, rtol=1e-6)


def test_capacity_dropping_counts():
    moe = _moe(n_experts=4, k=1, capacity_factor=1.0)
    with torch.no_grad():  # every token prefers expert 0: x·e_0 large
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
    x = torch.rand(1, 10, 16) + 0.1  # positive features -> logit_0 > 0 = the others
    y = moe(x)
    cap = math.ceil(1.0 * 10 * 1 / 4)  # 3
    assert moe.capacity(10) == cap
    assert int(moe.stats["dropped"]) == 10 - cap
    assert moe.stats["load"].tolist() == [10, 0, 0, 0] and moe.stats["kept"].tolist() == [
        cap,
        0,
        0,
        0,
    ]
    assert torch.all(y[0, cap:] == 0) and torch.all(
        y[0, :cap].abs().sum(-1) > 0
    )  # first come, first served
    no_drop = _moe(n_experts=4, k=1)
    no_drop.load_state_dict(moe.state_dict())
    no_drop(x)
    assert int(no_drop.stats["dropped"]) == 0


def test_aux_free_bias_moves_toward_balance():
    moe = _moe(n_experts=4, k=1, score="sigmoid", aux_free_bias=True)
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.05)
        moe.router.weight[0] += 0.5  # skewed toward expert 0
    x = torch.rand(1, 64, 16, generator=torch.Generator().manual_seed(1)) + 0.2
    moe(x)
    first = moe.stats["load"].float()
    assert first.max() / first.mean() > 2.5
    for _ in range(60):
        update_router_biases(moe, rate=0.01)
        moe(x)
    last = moe.stats["load"].float()
    assert last.max() / last.mean() < first.max() / first.mean() - 1.0
    assert moe.router.bias[0] < 0  # the overloaded expert's selection score went down


def _hash_by_hand(t, E, j):
    """The documented hash in plain Python integers: ((t·2654435761 + j·0x9E3779B1) mod (2^31 − 1)) mod E."""
    return ((t * 2654435761 + j * 0x9E3779B1) % (2**31 - 1)) % E


def test_hash_routing_is_a_fixed_function_of_the_token():
    ids = torch.tensor([[5, 7, 5, 9, 7, 5]])
    r = hash_route(ids, n_experts=8, k=2)
    # worked values: 5·2654435761 = 13272178805 ≡ 386277923 (mod 2^31 − 1), ≡ 3 (mod 8); likewise below
    assert r.expert_ids.tolist() == [[3, 5], [7, 1], [3, 5], [4, 6], [7, 1], [3, 5]]
    assert r.expert_ids.tolist() == [
        [_hash_by_hand(t, 8, j) for j in range(2)] for t in ids[0].tolist()
    ]
    assert torch.all(r.weights == 0.5)
    big = hash_route(torch.arange(8000), n_experts=8)
    load = torch.bincount(big.expert_ids[:, 0], minlength=8).float()
    assert load.max() / load.mean() < 1.1  # balanced over many distinct tokens
    moe = _moe(n_experts=8, k=1, router="hash")
    with pytest.raises(ValueError, match="token ids"):
        moe(torch.randn(1, 6, 16))
    with pytest.raises(ValueError, match="token_ids has 3 ids"):
        moe(torch.randn(1, 6, 16), token_ids=ids[:, :3])
    x = torch.randn(1, 6, 16)
    out = moe(x, token_ids=ids)
    hand = Routing(
        torch.tensor([[_hash_by_hand(t, 8, 0)] for t in ids[0].tolist()]),
        torch.ones(6, 1),
        torch.zeros(6, 8),
        None,
    )
    torch.testing.assert_close(
        out,
        loop_reference(x[0], hand, moe.gate_proj.weight, moe.up_proj.weight, moe.down_proj.weight)[
            None
        ],
        atol=1e-6,
        rtol=1e-6,
    )


HASH = dict(
    vocab_size=60,
    d_model=16,
    n_layers=3,
    n_heads=2,
    d_ff=32,
    n_experts=4,
    n_experts_per_token=2,
    d_ff_expert=16,
    moe_first_dense=1,
    router="hash",
    max_seq_len=64,
)


def test_hash_routing_inside_the_model_forward():
    """The Transformer hands each MoE layer the input token ids: every MoE layer's load is the bincount of
    the hand-computed hash of the tokens, and the logits equal a forward with the hand routing patched in."""
    m = Transformer(ModelConfig(**HASH)).eval()
    tokens = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(3))
    hand = torch.tensor(
        [[_hash_by_hand(t, 4, j) for j in range(2)] for t in tokens.reshape(-1).tolist()]
    )
    with torch.enable_grad():
        logits = m(tokens)
    for b in m.blocks[1:]:
        assert (
            b.ffn.stats["load"].tolist() == torch.bincount(hand.reshape(-1), minlength=4).tolist()
        )
    # the same layers driven by a plain top-k router whose logits force the hand assignment
    ref = Transformer(ModelConfig(**{**HASH, "router": "topk"})).eval()
    ref.load_state_dict(m.state_dict())
    assert (
        hand[:, 0] != hand[:, 1]
    ).all()  # two distinct experts per token here, so a top-2 router can force it
    forced = torch.full((tokens.numel(), 4), -1e4).scatter_(
        1, hand, 0.0
    )  # softmax: 1/2 on each chosen expert
    for b in ref.blocks[1:]:
        b.ffn.router.forward = lambda x, f=forced: f
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(tokens), atol=1e-5, rtol=1e-5)


def test_hash_routed_model_cached_decode_equals_full_recompute():
    from lmstack.inference.kv_cache import KVCache

    m = Transformer(ModelConfig(**HASH), dtype=torch.float64).eval()
    tokens = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(tokens)
        cache = KVCache(m.config, 2, 16, dtype=torch.float64)
        pre = m(tokens[:, :5], positions=torch.arange(5), kv_cache=cache)
        torch.testing.assert_close(pre, full[:, :5], atol=1e-10, rtol=1e-10)
        for t in range(5, 12):
            step = m(tokens[:, t : t + 1], positions=torch.tensor([t]), kv_cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-10, rtol=1e-10)


def test_transformer_interleaves_dense_and_moe_and_reports_aux_losses():
    c = ModelConfig(
        vocab_size=50,
        d_model=16,
        n_layers=4,
        n_heads=2,
        d_ff=32,
        n_experts=4,
        n_experts_per_token=2,
        moe_first_dense=1,
        moe_layer_step=1,
        moe_aux_loss_coef=0.1,
        moe_z_loss_coef=1e-3,
    )
    m = Transformer(c)
    kinds = [type(b.ffn).__name__ for b in m.blocks]
    assert kinds == ["SwiGLU", "MoE", "MoE", "MoE"]
    assert [type(b.ffn).__name__ for b in Transformer(c.replace(moe_layer_step=2)).blocks] == [
        "SwiGLU",
        "MoE",
        "SwiGLU",
        "MoE",
    ]
    m(torch.randint(0, 50, (2, 8)))
    aux = moe_aux_loss(m)
    expect = sum(0.1 * b.ffn.stats["balance"] + 1e-3 * b.ffn.stats["z"] for b in m.blocks[1:])
    assert aux.item() == pytest.approx(float(expect), rel=1e-5)
    metrics = moe_metrics(m)
    assert sum(metrics[f"moe_load_{i}"] for i in range(4)) == 3 * 16 * 2
    assert metrics["moe_dropped"] == 0 and metrics["moe_load_max_over_mean"] >= 1.0


def test_config_errors_name_the_values():
    with pytest.raises(ConfigError, match="n_experts_per_token=5 exceeds n_experts=4"):
        ModelConfig(n_experts=4, n_experts_per_token=5)
    with pytest.raises(ConfigError, match="router_groups=3 does not divide n_experts=8"):
        ModelConfig(n_experts=8, router_groups=3)
    with pytest.raises(ConfigError, match="router_score='relu'"):
        ModelConfig(n_experts=8, router_score="relu")
    with pytest.raises(ConfigError, match="capacity_factor=0.0 must be > 0"):
        ModelConfig(n_experts=8, capacity_factor=0.0)
    with pytest.raises(ValueError, match="k=3 must be between 1 and n_experts=2"):
        MoE(8, 2, 3, 16)
    c = ModelConfig(n_experts=8, n_experts_per_token=2, d_ff_expert=64, capacity_factor=1.25)
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_cpu_autocast_keeps_expert_matmuls_in_bf16():
    import lmstack.model.moe as moe_mod
    from lmstack.ops import gemm

    # under CPU autocast F.linear computes in bf16; the oneDNN path (fp32 only) must step aside, not upcast
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g)
    gate, up, down = (
        torch.randn(2, 12, 8, generator=g),
        torch.randn(2, 12, 8, generator=g),
        torch.randn(2, 8, 12, generator=g),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gemm.onednn_ok(x)
        out = moe_mod.expert_swiglu(x, [2, 4], gate, up, down)
        ref = torch.cat(
            [
                F.linear(F.silu(F.linear(r, gate[e])) * F.linear(r, up[e]), down[e])
                for e, r in enumerate(x.split([2, 4]))
            ]
        )
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
