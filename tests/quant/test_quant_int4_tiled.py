"""The tiled int4 prefill GEMM (``int4_vnni.gemm``: csrc/int4_gemm.h, op ``int4_<kernel>_gemm``) against the
float64 formula y = x · Wᵀ with W = d·q + m from the packed codes and fp16 d, m; its fake (meta) shape; the
errors for bad input; ``Int4Linear`` from ``gemm_rows`` rows on (which takes it) against F.linear on the
dequantised weight.

Tolerances are the rounding bounds of each GEMM dtype, per output element, on Σ_i |x_i|·|W_oi| (``bound``):
fp32: W rounded once from d·q + m (2⁻²⁴) and a fp32 sum of I products (I·2⁻²⁴, any order);
bf16: x and W each rounded to bf16 (2⁻⁹ each: 2⁻⁸ + 2⁻¹⁸ on a product) on top of that."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from lmstack.quant import Int4Linear, int4, int4_vnni, quantize_int4

pytestmark = pytest.mark.usefixtures("one_thread")
G = 32


def relative_bound(dtype: torch.dtype, I: int) -> float:
    fp32 = (I + 2) * 2.0**-24
    return fp32 if dtype == torch.float32 else fp32 + 2.0**-8 + 2.0**-17


def packed_weight(O: int, I: int, seed: int):
    """(packed, d, m) of a random (O, I) weight and its W = d·q + m in float64 from the packed form."""
    q, s, lo = quantize_int4(torch.randn(O, I, generator=torch.Generator().manual_seed(seed)), G)
    packed, d, m = int4_vnni.pack(q, s, lo)

    def rows(a):  # (O/16, I/G, 16) -> (O, I) per input
        return a.double().permute(0, 2, 1).reshape(O, -1).repeat_interleave(G, 1)

    w = rows(d) * int4_vnni.unpack(packed).double() + rows(m)
    return packed, d, m, w


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> None:
    ref = x.double() @ w.T
    bound = relative_bound(dtype, x.shape[1]) * (x.double().abs() @ w.abs().T)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    assert bool((err <= bound + 1e-30).all()), (
        f"max error {err.max():.3g}, bound there {bound[err.argmax() // ref.shape[1]].max():.3g}"
    )


def kernels():
    return [k for k in int4_vnni.KERNELS if int4_vnni.build(k) is None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 17, 90])
def test_tiled_gemm_equals_the_float64_formula(M, dtype):
    ks = kernels()
    if not ks:
        pytest.skip(f"no lmstack int4 kernel builds here: {int4_vnni.status()}")
    O, I = (
        16 * 37,
        128,
    )  # 37 tiles: not a multiple of any block (64 / 128 rows by default, 48 below)
    packed, d, m, w = packed_weight(O, I, M)
    x = torch.randn(M, I, generator=torch.Generator().manual_seed(100 + M))
    for kernel in ks:  # vnni and, where the CPU has AVX2, the avx2 build forced
        for block in (0, 16, 48):
            check(int4_vnni.gemm(x, packed, d, m, G, kernel, dtype, block), x, w, dtype)
        # bf16 activations in: the same numbers (they are rounded to bf16 anyway when dtype is bf16)
        if dtype == torch.bfloat16:
            xb = x.bfloat16()
            check(int4_vnni.gemm(xb, packed, d, m, G, kernel, dtype), xb.float(), w, dtype)


def test_tiled_gemm_on_two_threads_and_a_wide_input():
    ks = kernels()
    if not ks:
        pytest.skip(f"no lmstack int4 kernel builds here: {int4_vnni.status()}")
    O, I = 16 * 9, 512  # blocks split over threads; I = 16 groups
    packed, d, m, w = packed_weight(O, I, 7)
    x = torch.randn(20, I, generator=torch.Generator().manual_seed(8))
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for kernel in ks:
            for dtype in (torch.float32, torch.bfloat16):
                check(int4_vnni.gemm(x, packed, d, m, G, kernel, dtype, 32), x, w, dtype)
                # under inference mode (every engine and benchmark forward): the worker threads' GEMMs
                # write into the inference-mode output (the fp32 path's at::mm_out raised there)
                with torch.inference_mode():
                    xi = x.clone()
                    check(int4_vnni.gemm(xi, packed, d, m, G, kernel, dtype, 32), x, w, dtype)
    finally:
        torch.set_num_threads(n)


def test_fake_shape_and_bad_inputs():
    ks = kernels()
    if not ks:
        pytest.skip(f"no lmstack int4 kernel builds here: {int4_vnni.status()}")
    packed, d, m, _ = packed_weight(48, 64, 1)
    x = torch.randn(5, 64)
    for kernel in ks:
        op = getattr(torch.ops.lmstack_quant, f"int4_{kernel}_gemm")
        with FakeTensorMode() as mode:
            fx, fp, fd, fm = (mode.from_tensor(t) for t in (x, packed, d, m))
            y = op(fx, fp, fd, fm, G, True, 0)
        assert y.shape == (5, 48) and y.dtype == torch.float32
        with pytest.raises(RuntimeError, match="x has 60 features, weights 64"):
            op(torch.randn(5, 60), packed, d, m, G, True, 0)
        with pytest.raises(RuntimeError, match="got 24"):
            op(x, packed, d, m, G, True, 24)
        with pytest.raises(RuntimeError, match=r"x must be \(M, I\), got \[1, 5, 64\]"):
            op(x[None], packed, d, m, G, True, 0)
        with pytest.raises(RuntimeError, match="group size 12"):
            op(x, packed, d, m, 12, True, 0)
        with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got Half"):
            op(x.half(), packed, d, m, G, True, 0)
        with pytest.raises(RuntimeError, match="d, m must be contiguous fp16"):
            op(x, packed, d.float(), m, G, True, 0)
    with pytest.raises(ValueError, match="dtype=torch.float16"):
        int4_vnni.gemm(x, packed, d, m, G, ks[0], torch.float16)


def test_int4linear_prefill_takes_the_tiled_gemm_and_matches_f_linear(monkeypatch):
    ks = kernels()
    if not ks:
        pytest.skip(f"no lmstack int4 kernel builds here: {int4_vnni.status()}")
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "8")  # the GEMM from 8 rows on
    O, I = 96, 128
    q, s, lo = quantize_int4(torch.randn(O, I, generator=torch.Generator().manual_seed(3)), G)
    calls = []
    real = int4_vnni.gemm
    monkeypatch.setattr(
        int4_vnni, "gemm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    )
    x = torch.randn(2, 6, I, generator=torch.Generator().manual_seed(4))  # 12 rows >= 8
    for kernel in ks:
        lin = Int4Linear(q, s, lo, kernel=kernel)
        assert lin.gemm_rows == 8
        calls.clear()
        y = lin(x)
        assert calls == [(12, I)] and y.shape == (2, 6, O)
        w = (
            lin.dequantized_weight().double()
        )  # fp32 scale and minimum; the op uses them rounded to fp16
        ref = F.linear(x.double(), w)
        # + the fp16 rounding of d and m (2⁻¹¹ each: |Δw| <= 2⁻¹¹ (d·q + |m|)) on top of the GEMM's own bound
        dw = 2.0**-11 * (
            s.double().repeat_interleave(G, 1) * q.double()
            + lo.double().abs().repeat_interleave(G, 1)
        )
        xa = x.double().abs()
        bound = xa @ dw.T + relative_bound(lin.gemm_dtype, I) * (xa @ (w.abs() + dw).T)
        assert bool(((y.double() - ref).abs() <= bound).all())
        # below gemm_rows the int8-activation kernel runs instead
        calls.clear()
        lin(x[0, :4])
        assert calls == []
    # the old path behind LMSTACK_INT4_GEMM=dequant gives the same numbers within the same bound
    monkeypatch.setenv(int4.GEMM_ENV, "dequant")
    calls.clear()
    y_old = Int4Linear(q, s, lo, kernel=ks[0])(x)
    assert calls == [] and bool(((y_old.double() - ref).abs() <= bound + 2.0**-8 * ref.abs()).all())


def test_gemm_rows_times_the_kernel_with_the_layers_own_terms(monkeypatch):
    """``Int4Linear`` hands rows to the GEMM by a measurement of its kernel: with the layer's int8 terms (one by
    default), not ``mm``'s default of two, which cost 1.7-1.9x and moved the hand-over too low."""
    from lmstack.quant import linear

    ks = kernels()
    if not ks:
        pytest.skip(f"no lmstack int4 kernel builds here: {int4_vnni.status()}")
    monkeypatch.delenv("LMSTACK_QUANT_GEMM_ROWS", raising=False)
    monkeypatch.setattr(linear, "_measured", {})
    seen = []
    real = int4_vnni.mm

    def spy(x, packed, d, m, group_size, terms=2, kernel=None):
        seen.append(terms)
        return real(x, packed, d, m, group_size, terms, kernel)

    monkeypatch.setattr(int4_vnni, "mm", spy)
    q, s, lo = quantize_int4(torch.randn(32, 64, generator=torch.Generator().manual_seed(5)), G)
    for terms in (1, 2):
        seen.clear()
        Int4Linear(q, s, lo, kernel=ks[0], terms=terms)
        assert seen and set(seen) == {terms}
    assert {k.split("_")[2] for k in linear._measured} == {"t1", "t2"}
