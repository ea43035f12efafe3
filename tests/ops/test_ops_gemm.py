"""ops.gemm: the GEMM policy is chosen per CPU (faked with LMSTACK_CPU / CpuFeatures), set by configure(), and
linear() follows it; oneDNN products equal F.linear (torch's own op) to fp32 rounding."""

import pytest
import torch
import torch.nn.functional as F

from lmstack.cpu import FAKE_CPUS, CpuFeatures
from lmstack.kernels.runtime import RuntimeConfig, configure
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.ops import gemm

M4 = 1 << 22  # 4M elements: an unembedding's V·D


@pytest.fixture
def restore_policy():
    saved = gemm.set_gemm(None)
    yield
    gemm.set_gemm(saved)


UNEMBED, DOWN = 49152 * 576, 576 * 1536  # SmolLM2's unembedding and FFN down weights


@pytest.mark.parametrize(
    "machine,onednn_at",
    [
        # which of (1, DOWN), (8, DOWN), (1, UNEMBED), (4, UNEMBED) (rows, weight) go to oneDNN
        ("epyc", [False, True, True, True]),  # AMD: MKL's slow path, oneDNN from 8 rows
        ("avx512_bf16", [False, True, True, True]),  # Zen 4 is AMD too
        ("amx", [False, False, False, True]),  # Intel Xeon: MKL but the unembedding from 4 rows
        ("avx512_vnni", [False, False, False, True]),
        ("neon", [False, False, False, False]),  # not measured: torch's own BLAS
        ("avx2", [False, False, False, False]),  # no vendor in the canned machine
    ],
)
def test_auto_is_the_measured_row_of_the_vendor(monkeypatch, machine, onednn_at):
    monkeypatch.setenv("LMSTACK_CPU", machine)
    p = gemm.choose_gemm("auto")
    cases = [(1, DOWN), (8, DOWN), (1, UNEMBED), (4, UNEMBED)]
    assert [p.uses_onednn(r, w) for r, w in cases] == onednn_at
    assert gemm.choose_gemm("auto", FAKE_CPUS[machine]) == p


def test_explicit_backends_and_the_off_switch(monkeypatch):
    amd = CpuFeatures("x86_64", "AVX2", frozenset(), vendor="AuthenticAMD")
    assert gemm.choose_gemm("onednn").uses_onednn(1, 1)
    assert not gemm.choose_gemm("blas").uses_onednn(10**6, 10**9)
    monkeypatch.setenv("LMSTACK_ONEDNN", "0")
    assert gemm.choose_gemm("auto", amd).name == "blas"
    with pytest.raises(ValueError, match="gemm backend='mkl'"):
        gemm.choose_gemm("mkl")
    with pytest.raises(ValueError, match="gemm='mkl'"):
        RuntimeConfig(gemm="mkl")


def test_prepack_off_switch_keeps_the_plain_rules(monkeypatch):
    monkeypatch.setenv("LMSTACK_PREPACK", "0")
    p = gemm.choose_gemm("auto", FAKE_CPUS["amx"])
    assert not p.prepack and not p.prepack_bf16 and p.infer_rows is None
    assert not p.uses_onednn(64, DOWN, inference=True)  # plain-strided oneDNN loses to MKL there
    assert p.uses_onednn(64, UNEMBED, inference=True)


def test_policy_thresholds_by_hand():
    p = gemm.GemmPolicy("t", 8, M4)
    assert [p.uses_onednn(m, DOWN) for m in (1, 7, 8, 300)] == [False, False, True, True]
    assert p.uses_onednn(1, UNEMBED)  # the unembedding at one row
    big_only = gemm.GemmPolicy("t", None, M4, 4)
    assert [big_only.uses_onednn(m, UNEMBED) for m in (1, 3, 4, 512)] == [False, False, True, True]
    assert not big_only.uses_onednn(4096, DOWN)
    never = gemm.GemmPolicy("t", None, None)
    assert not never.uses_onednn(4096, UNEMBED)


@pytest.mark.parametrize("policy", ["onednn", "blas"])
def test_linear_follows_the_policy(monkeypatch, restore_policy, policy):
    calls = []
    real = gemm.onednn_linear
    monkeypatch.setattr(gemm, "onednn_linear", lambda x, w: calls.append(x.shape) or real(x, w))
    gemm.set_gemm(gemm.choose_gemm(policy))
    x, w, b = torch.randn(2, 3, 16), torch.randn(8, 16), torch.randn(8)
    y = gemm.linear(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    expect = [(6, 16)] if policy == "onednn" and gemm.onednn_ok(x) else []
    assert calls == expect


def test_configure_sets_the_policy_and_logs_it(monkeypatch, restore_policy):
    monkeypatch.setenv("LMSTACK_CPU", "epyc")
    cfg = ModelConfig(
        vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16
    )
    model = Transformer(cfg)
    line = configure(model)
    assert line.endswith(
        "; gemm: auto (auto: AMD EPYC: oneDNN from 8 rows or a weight of 4M elements)"
    )
    assert gemm.gemm_policy().uses_onednn(8, DOWN)
    assert configure(model, RuntimeConfig(gemm="blas")).endswith("; gemm: blas (configured)")
    assert not gemm.gemm_policy().uses_onednn(4096, UNEMBED)


def test_expert_swiglu_equals_the_per_expert_formula(restore_policy):
    """Grouped experts under both policies == silu(x W_g) * (x W_u) W_d per expert with torch's F.linear."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 8, generator=g)
    gate, up = torch.randn(3, 12, 8, generator=g), torch.randn(3, 12, 8, generator=g)
    down = torch.randn(3, 8, 12, generator=g)
    counts = [4, 0, 5]
    ref = torch.cat(
        [
            F.linear(F.silu(F.linear(r, gate[e])) * F.linear(r, up[e]), down[e])
            for e, r in enumerate(x.split(counts))
            if r.shape[0]
        ]
    )
    for name in ("onednn", "blas"):
        gemm.set_gemm(gemm.choose_gemm(name))
        torch.testing.assert_close(
            gemm.expert_swiglu(x, counts, gate, up, down), ref, atol=1e-4, rtol=1e-5
        )


def test_inference_products_through_onednn_run_in_row_buckets(monkeypatch):
    """A server's prefills of every length each made oneDNN cache a new primitive (its RSS grew with each new
    length): with autograd off, rows above 32 are padded to a multiple of 32, on the prepacked weight; the
    result equals F.linear's. Training runs the plain weight, unpadded, and its gradient flows."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not built into this torch")
    seen = []
    real = gemm._onednn_mm_t
    monkeypatch.setattr(
        gemm,
        "_onednn_mm_t",
        lambda a, b, *c: seen.append((a.shape[0], b.is_mkldnn)) or real(a, b, *c),
    )
    old = gemm.set_gemm(gemm.choose_gemm("onednn"))
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g)
        with torch.no_grad():
            for rows in (1, 32, 33, 64, 65, 100):
                x = torch.randn(rows, 16, generator=g)
                torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w))
        x = torch.randn(2, 50, 16, generator=g, requires_grad=True)
        gemm.linear(x, w).sum().backward()  # training: no padding, the gradient still flows
        torch.testing.assert_close(x.grad, w.sum(0).expand(2, 50, 16))
    finally:
        gemm.set_gemm(old)
    packed = [(r, True) for r in (1, 32, 64, 64, 96, 128)]
    assert seen == packed + [(100, False), (100, False)]  # forward, then dx = dy @ w


@pytest.fixture
def intel_auto(monkeypatch):
    if not gemm.onednn_ok(torch.zeros(1)):
        pytest.skip("oneDNN's linear not built into this torch")
    monkeypatch.setenv("LMSTACK_CPU", "amx")
    old = gemm.set_gemm(gemm.choose_gemm("auto"))
    yield gemm.gemm_policy()
    gemm.set_gemm(old)


def test_intel_inference_runs_prepacked_onednn_from_4_rows(intel_auto, monkeypatch):
    """Intel's measured row: inference products of 4-511 rows go to oneDNN on the prepacked weight (MKL outside
    that and for training; the unembedding from 4 rows at any count); every result equals torch's F.linear (MKL) to fp32 rounding (atol = rtol = 1e-5
    on outputs of std ~1: oneDNN and MKL add the 576 products in different orders)."""
    assert intel_auto.prepack and intel_auto.infer_rows == (4, 512)
    assert not intel_auto.uses_onednn(3, DOWN, inference=True)
    assert intel_auto.uses_onednn(4, DOWN, inference=True)
    assert intel_auto.uses_onednn(511, DOWN, inference=True)
    assert not intel_auto.uses_onednn(512, DOWN, inference=True)
    assert intel_auto.uses_onednn(512, UNEMBED, inference=True)
    assert not intel_auto.uses_onednn(4096, DOWN)  # training: MKL
    kinds = []
    real = gemm._onednn_mm_t
    monkeypatch.setattr(
        gemm, "_onednn_mm_t", lambda a, b, *c: kinds.append(b.is_mkldnn) or real(a, b, *c)
    )
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 576, generator=g) / 24
    b = torch.randn(96, generator=g)
    with torch.no_grad():
        for rows in (1, 3, 4, 16, 64, 65, 300, 600):
            x = torch.randn(rows, 576, generator=g)
            torch.testing.assert_close(
                gemm.linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5
            )
        x = torch.randn(2, 7, 576, generator=g)  # (B, S, D) rows
        torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert kinds == [True] * 6  # 4, 16, 64, 65, 300 rows and the 14 of (2, 7): all prepacked


def test_the_prepacked_weight_follows_in_place_updates(intel_auto, monkeypatch):
    """GRPO updates the weights the rollout engine reads in place: after an optimizer step, a load_state_dict
    or a write through a view (the separate q/k/v parameters' ``.data`` views the fused QKV weight, as
    ``fuse_linears`` makes them, and their version counter is their own: passed as ``views``), the next
    inference product uses the new values (equal to F.linear on them); an unchanged weight is packed once."""
    packs = []
    real = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(
        gemm.torch.ops.mkldnn, "_reorder_linear_weight", lambda w, n: packs.append(1) or real(w, n)
    )
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(48, 64, generator=g) / 8  # (3·16, 64): q, k, v row blocks
    q = torch.nn.Parameter(torch.empty(16, 64))
    q.data = fused[:16]  # fuse_linears' way: fused's storage, q's own version counter
    x = torch.randn(8, 64, generator=g)

    def check():
        with torch.no_grad():
            y = gemm.linear(x, fused, views=[q])
            torch.testing.assert_close(y, F.linear(x, fused), atol=1e-5, rtol=1e-5)

    check()
    check()
    assert len(packs) == 1  # unchanged: the first pack serves
    before = gemm.linear(x, fused, views=[q]).detach().clone()
    opt = torch.optim.SGD([q], lr=1.0)
    q.grad = torch.ones_like(q)
    opt.step()  # q -= 1 in place, seen through fused
    check()
    assert len(packs) == 2
    with (
        torch.no_grad()
    ):  # each q row lost 1 per input: its outputs lost the row sums of x (by hand)
        after = gemm.linear(x, fused, views=[q])
    torch.testing.assert_close(
        after[:, :16], before[:, :16] - x.sum(1, keepdim=True), atol=1e-4, rtol=1e-5
    )
    torch.testing.assert_close(after[:, 16:], before[:, 16:], atol=1e-5, rtol=1e-5)
    lin = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        y0 = gemm.linear(x, lin.weight)
        lin.load_state_dict({"weight": torch.zeros(32, 64)})
        assert gemm.linear(x, lin.weight).abs().max() == 0
        assert y0.abs().max() > 0


def test_a_packed_copy_leaves_with_its_weight(intel_auto):
    w = torch.randn(32, 64)
    with torch.no_grad():
        gemm.linear(torch.randn(8, 64), w)
    assert id(w) in gemm._PACKED
    key = id(w)
    del w
    assert key not in gemm._PACKED


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(),
    reason="the CPU lacks AMX: measured (and bit-equal) on an AMX CPU",
)
def test_bf16_inference_runs_prepacked_and_gives_f_linear_bits(intel_auto, monkeypatch):
    """On an AMX CPU, F.linear's bf16 GEMM is oneDNN's, laying the weight out anew at every call; the packed
    call gives the very same bits (with and without bias, 1-300 rows); training stays on F.linear."""
    assert intel_auto.prepack_bf16
    kinds = []
    real = gemm._onednn_mm_t
    monkeypatch.setattr(
        gemm, "_onednn_mm_t", lambda a, b, *c: kinds.append(b.is_mkldnn) or real(a, b, *c)
    )
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 576, generator=g) / 24).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    with torch.no_grad():
        for rows in (1, 4, 64, 300):
            x = torch.randn(rows, 576, generator=g).bfloat16()
            assert torch.equal(gemm.linear(x, w), F.linear(x, w))
            assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
    assert kinds == [True] * 8
    x = torch.randn(4, 576, generator=g).bfloat16().requires_grad_()
    gemm.linear(x, w).sum().backward()  # autograd on: F.linear, not the packed call
    assert len(kinds) == 8 and x.grad is not None


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(),
    reason="the CPU lacks AMX: measured (and bit-equal) on an AMX CPU",
)
def test_inference_dtype_bf16_runs_fp32_weights_as_bf16_gemms(intel_auto):
    """``inference_dtype(bf16)`` (GRPO's bf16 rollouts): an fp32 inference product equals F.linear on bf16
    casts of x and w, in fp32 (the fp32 bias added after), at any row count, on one packed bf16 copy that
    replaces the fp32 one and follows an in-place update; autograd-on products and products outside the
    block stay fp32 (F.linear's fp32 result to 1e-5); a dtype other than bf16/fp32 is refused."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 576, generator=g) / 24
    b = torch.randn(96, generator=g)

    def ref(x):
        return F.linear(x.bfloat16(), w.bfloat16()).float() + b

    with torch.no_grad():
        x = torch.randn(16, 576, generator=g)
        gemm.linear(x, w, b)  # outside: the fp32 packed copy
        assert gemm._PACKED[id(w)][2].dtype == torch.float32
        with gemm.inference_dtype(torch.bfloat16):
            for rows in (1, 4, 64, 300, 600):
                xr = torch.randn(rows, 576, generator=g)
                y = gemm.linear(xr, w, b)
                assert y.dtype == torch.float32 and torch.equal(y, ref(xr))
            assert gemm._PACKED[id(w)][2].dtype == torch.bfloat16  # replaced, not added
            w.mul_(2)  # an optimizer's in-place write
            assert torch.equal(gemm.linear(x, w, b), ref(x))
        y = gemm.linear(x, w, b)
        torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        assert not torch.equal(y, ref(x))
    with gemm.inference_dtype(torch.bfloat16):
        xg = x.clone().requires_grad_()
        y = gemm.linear(xg, w, b)  # autograd on: the learner's fp32 product
        torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="inference_dtype"):
        with gemm.inference_dtype(torch.float16):
            pass
