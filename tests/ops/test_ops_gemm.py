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
    length): with autograd off, rows above 32 are padded to a multiple of 32; the result equals F.linear's."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not built into this torch")
    seen = []
    real = gemm.onednn_linear
    monkeypatch.setattr(gemm, "onednn_linear", lambda x, w: seen.append(x.shape[0]) or real(x, w))
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
    assert seen == [1, 32, 64, 64, 96, 128, 100]
