"""Int8Linear's many-row path where torch's int8 kernel runs (quant/int8.py ``onednn_mm``: oneDNN's int8 GEMM
on prepacked Q, two int8 terms per activation row): its output against that formula written in numpy (the
quantisation in float32 as the code does it, the products in float64) and against F.linear on the dequantised
weight, and ``LMSTACK_QUANT_GEMM_ROWS`` deciding from which row count it runs (below: torch's bf16 kernel)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmstack.quant import Int8Linear, dequantize_int8, quantize_int8
from lmstack.quant.int8 import EXACT_INT8_FLAGS, _has_int8_kernel, has_onednn

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(  # torch's side: a CI machine must have it (tests/conftest.py)
        not (has_onednn(flags=frozenset(EXACT_INT8_FLAGS)) and _has_int8_kernel()),
        reason="torch has no oneDNN int8 linear",
    ),
    pytest.mark.skipif(  # the CPU's side: allowed to skip in CI
        not has_onednn(), reason="the CPU lacks VNNI / AMX: its int8 sums saturate"
    ),
]


def two_term_reference(x, q, s):
    """y_m,o = s_o · Σ_t s_t,m · Σ_i Q_oi · x_t,m,i; s_1 = max_i|x_m|/127, x_1 = round(x / s_1) (ties to even),
    x_2 the same rounding of the residual x − s_1·x_1 (float32, as quantised), sums in float64."""
    x = x.numpy().astype(np.float32)
    s1 = (np.abs(x).max(1, keepdims=True) / np.float32(127)).astype(np.float32)
    q1 = np.round(x / s1)
    r = x - q1 * s1
    s2 = (np.abs(r).max(1, keepdims=True) / np.float32(127)).astype(np.float32)
    q2 = np.round(r / s2)
    w = q.numpy().astype(np.float64).T * s.numpy().astype(np.float64)  # (I, O)
    return (q1 @ w) * s1 + (q2 @ w) * s2


@pytest.mark.parametrize("M", [1, 3, 4, 9])
def test_rows_from_the_switch_take_the_two_term_gemm(monkeypatch, M):
    O, I = 48, 96
    g = torch.Generator().manual_seed(M)
    q, s = quantize_int8(torch.randn(O, I, generator=g))
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "4")
    lin = Int8Linear(q, s, kernel="aten")
    assert lin.gemm_rows == 4 and lin.DEQUANT_ROWS is None
    x = torch.randn(M, I, generator=g)
    y = lin(x).double().numpy()
    two = two_term_reference(x, q, s)
    bf16 = F.linear(x.bfloat16().double(), dequantize_int8(q, s).double()).numpy()
    full = F.linear(x.double(), dequantize_int8(q, s).double()).numpy()
    if M < 4:  # torch's kernel: bf16 activations, well off the two-term formula
        np.testing.assert_allclose(y, bf16, rtol=0.02, atol=0.05)
        assert np.abs(y - two).max() > 1e-3 * np.abs(full).max()
    else:
        np.testing.assert_allclose(y, two, rtol=1e-5, atol=1e-5 * np.abs(two).max())
        np.testing.assert_allclose(y, full, rtol=0.02, atol=1e-3 * np.abs(full).max())


def test_never_keeps_the_kernel_and_the_dequantisation(monkeypatch):
    O, I = 32, 64
    g = torch.Generator().manual_seed(7)
    q, s = quantize_int8(torch.randn(O, I, generator=g))
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "never")
    lin = Int8Linear(q, s, kernel="aten")
    assert lin.gemm_rows is None and lin.DEQUANT_ROWS == 32
    x = torch.randn(40, I, generator=g)  # >= DEQUANT_ROWS: F.linear on the fp32 dequantised weight
    torch.testing.assert_close(lin(x), F.linear(x, dequantize_int8(q, s)), atol=1e-5, rtol=1e-5)


def test_fused_rows_equal_the_parts(monkeypatch):
    g = torch.Generator().manual_seed(8)
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "2")
    parts = [
        Int8Linear(*quantize_int8(torch.randn(O, 64, generator=g)), kernel="aten") for O in (32, 16)
    ]
    x = torch.randn(5, 64, generator=g)
    want = torch.cat([p(x) for p in parts], dim=1)  # each part builds its own prepacked Q
    fused = Int8Linear.concat_rows(parts)
    assert fused is not None and fused.gemm_rows == 2
    torch.testing.assert_close(fused(x), want, rtol=1e-6, atol=1e-6)
    copied = copy.deepcopy(fused)  # the prepacked Q is not copied: the copy prepacks its own
    torch.testing.assert_close(copied(x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_compiled_graph_keeps_torchs_kernel(monkeypatch):
    """Inductor cannot take the opaque prepacked Q: inside torch.compile the many-row batch runs torch's
    kernel (bf16 activations) instead of failing to compile."""
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "2")
    g = torch.Generator().manual_seed(9)
    q, s = quantize_int8(torch.randn(64, 64, generator=g))
    lin = Int8Linear(q, s, kernel="aten")
    x = torch.randn(16, 64, generator=g)
    with torch.inference_mode():
        y = torch.compile(lin)(x)
    bf16 = F.linear(x.bfloat16().float(), dequantize_int8(q, s))
    torch.testing.assert_close(y, bf16, rtol=0.02, atol=0.05)


def test_new_weights_loaded_in_place_are_used_by_the_many_row_path(monkeypatch):
    """The prepacked Q is built from qweight: after load_state_dict (an in-place copy, as an RL weight sync
    does) the many-row path must compute with the new codes, not the first call's."""
    O, I = 32, 64
    g = torch.Generator().manual_seed(11)
    q, s = quantize_int8(torch.randn(O, I, generator=g))
    q2, s2 = quantize_int8(torch.randn(O, I, generator=g))
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "4")
    lin = Int8Linear(q, s, kernel="aten")
    x = torch.randn(8, I, generator=g)
    np.testing.assert_allclose(
        lin(x).double().numpy(), two_term_reference(x, q, s), rtol=1e-5, atol=1e-4
    )
    new = Int8Linear(q2, s2, kernel="aten")
    lin.load_state_dict(new.state_dict())
    ref = two_term_reference(x, q2, s2)
    np.testing.assert_allclose(
        lin(x).double().numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max()
    )


def test_one_row_takes_the_two_term_gemm_when_the_switch_says_one(monkeypatch):
    """At M = 1 (a decode step's unembedding) the two-term GEMM: to the float64 formula, and within the
    two-term error of the float64 product (~15 bits of the activation, far inside torch's bf16 kernel's)."""
    O, I = 80, 96
    g = torch.Generator().manual_seed(12)
    q, s = quantize_int8(torch.randn(O, I, generator=g))
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "1")
    lin = Int8Linear(q, s, kernel="aten")
    assert lin.gemm_rows == 1 and lin.onednn_rows(1)
    x = torch.randn(1, I, generator=g)
    y = lin(x).double().numpy()
    two = two_term_reference(x, q, s)
    np.testing.assert_allclose(y, two, rtol=1e-5, atol=1e-5 * np.abs(two).max())
    full = F.linear(x.double(), dequantize_int8(q, s).double()).numpy()
    assert np.abs(y - full).max() < 1e-3 * np.abs(full).max()


def test_the_row_count_is_measured_per_weight_shape(monkeypatch):
    """One measurement per (O, I), on the layer's own shape (a fused layer measures its joined shape): here a
    faked measurement in which oneDNN wins from one row on weights of 256+ rows and from 8 rows below."""
    monkeypatch.setenv("LMSTACK_INT8_KERNEL", "aten")  # oneDNN serves torch's kernel's layers only
    from lmstack.quant import int8, linear

    monkeypatch.delenv("LMSTACK_QUANT_GEMM_ROWS", raising=False)
    monkeypatch.setattr(linear, "_measured", {})
    shapes = []

    def fake(q, s):
        def measure(M):
            shapes.append((tuple(q.shape), M))
            return 1.0, 0.5 if q.shape[0] >= 256 or M >= 8 else 2.0

        return measure

    monkeypatch.setattr(int8, "measure_onednn_rows", fake)
    g = torch.Generator().manual_seed(13)
    small = [Int8Linear(*quantize_int8(torch.randn(160, 64, generator=g))) for _ in range(2)]
    big = Int8Linear(*quantize_int8(torch.randn(512, 64, generator=g)))
    assert [m.gemm_rows for m in small] == [8, 8] and big.gemm_rows == 1
    assert big.DEQUANT_ROWS is None and not small[0].onednn_rows(7) and small[0].onednn_rows(8)
    fused = Int8Linear.concat_rows(small)
    assert fused is not None and fused.gemm_rows == 1 and fused.out_features == 320
    rows = list(int8.ONEDNN_ROWS_CANDIDATES)
    assert shapes == [(shape, M) for shape in [(160, 64), (512, 64), (320, 64)] for M in rows]
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "never")
    off = Int8Linear(*quantize_int8(torch.randn(512, 64, generator=g)))
    assert off.gemm_rows is None and off.DEQUANT_ROWS == 32
