"""lmstack's int8 x int8 AVX2 kernel for Int8Linear (quant/int8.py, csrc/int8_avx2.cpp): the tile layout by
hand, the kernel against its formula written in numpy float64 (activations quantised per group, one or two
int8 terms), ``Int8Linear`` on it against F.linear on the dequantised weight and under torch.compile, and the
choice of kernel from faked CPU flags and ``LMSTACK_INT8_KERNEL``. Where the CPU or compiler cannot run it,
the constructor's reason is what is checked."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmstack.quant import Int8Linear, dequantize_int8, int4_vnni, quantize_int8
from lmstack.quant.int8 import choose_int8_kernel, int8_kernel, pack_int8, unpack_int8

pytestmark = pytest.mark.usefixtures("one_thread")
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
AVX512_VNNI = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def test_pack_layout_by_hand_and_unpack():
    q = torch.randint(
        -127, 128, (32, 8), generator=torch.Generator().manual_seed(0), dtype=torch.int8
    )
    packed = pack_int8(q)
    assert packed.shape == (2, 2, 64)
    assert int(packed[1, 1, 4 * 5 + 2]) == int(q[16 + 5, 4 + 2])  # tile 1, chunk 1, row 5, j = 2
    assert torch.equal(unpack_int8(packed), q)


def reference(x, q, s, G, terms):
    """y = s_o · Σ_g Σ_t s_t·Σ Q·x_t in float64; term 1: s_1 = max|x_g|/127, x_1 = round(x / s_1) (ties to even),
    term 2 the same rounding of the residual."""
    x = x.double().numpy()
    M, I = x.shape
    xg, qg = x.reshape(M, I // G, G), q.double().numpy().reshape(-1, I // G, G)
    out, rest = 0.0, xg
    for _ in range(terms):
        sc = (
            (np.abs(rest).max(-1) / 127).astype(np.float32).astype(np.float64)
        )  # the kernel's float32 scale
        xq = np.clip(np.round(rest / np.where(sc > 0, sc, 1)[..., None]), -127, 127)
        out = out + (np.einsum("ogi,mgi->mog", qg, xq) * sc[:, None]).sum(-1)
        rest = rest - xq * sc[..., None]
    return out * s.double().numpy()[None]


@pytest.mark.parametrize(
    "O,I,G,M",
    [
        (64, 128, 32, 1),
        (32, 64, 8, 5),
        (48, 256, 64, 4),
        (16, 96, 32, 3),
        (32, 64, 8, 7),  # 2-row passes and a last row (one term), 1-row passes (two)
        (16, 96, 32, 6),
        # many rows of many inputs: 18 two-row passes and one row (one term), 37 one-row passes (two)
        (16, 2048, 32, 37),
    ],
)
def test_kernel_equals_its_formula_and_int8linear_is_close_to_float(O, I, G, M, monkeypatch):
    monkeypatch.setenv(
        "LMSTACK_QUANT_GEMM_ROWS", "never"
    )  # Int8Linear on the kernel at every row count
    g = torch.Generator().manual_seed(O + M)
    w, x = torch.randn(O, I, generator=g), torch.randn(M, I, generator=g)
    q, s = quantize_int8(w)
    if int4_vnni.build("int8_avx2") is not None:  # no skip: the reason is what is checked here
        with pytest.raises(ValueError, match="cannot run"):
            Int8Linear(q, s, kernel="avx2")
        return
    for terms in (1, 2):
        ref = reference(x, q, s, G, terms)
        y = torch.ops.lmstack_quant.int8_avx2_mm(x, pack_int8(q), s, G, terms)
        np.testing.assert_allclose(
            y.double().numpy(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max()
        )
    lin = Int8Linear(q, s, kernel="avx2", terms=2)
    assert (
        lin.kernel == "avx2"
        and "kernel=avx2" in repr(lin)
        and lin.qweight.shape == (O // 16, I // 4, 64)
    )
    torch.testing.assert_close(lin.dequantized_weight(), dequantize_int8(q, s))
    full = F.linear(x.double(), dequantize_int8(q, s).double())
    # two int8 terms per activation (~15 bits): ~1e-4 of float
    assert lin.terms == 2 and "terms=2" in repr(lin)
    assert float((lin(x).double() - full).norm() / full.norm()) < 3e-4
    np.testing.assert_allclose(
        lin(x).double().numpy(), reference(x, q, s, lin.act_group, 2), rtol=1e-5, atol=1e-5
    )
    # the default: one term, llama.cpp's Q8_0: |error| <= s_x/2 each, ~2e-3 of float
    one = Int8Linear(q, s, kernel="avx2")
    assert one.terms == 1 and "terms=1" in repr(one)
    err1 = float((one(x).double() - full).norm() / full.norm())
    assert 2e-4 < err1 < 6e-3
    np.testing.assert_allclose(
        one(x).double().numpy(), reference(x, q, s, one.act_group, 1), rtol=1e-5, atol=1e-5
    )
    assert lin.kernel_bytes() == O * I + 4 * O


@pytest.mark.parametrize("M", [1, 3, 4, 9])
def test_prefill_gemm_and_kernel_each_equal_their_float64_formula(monkeypatch, M):
    """``LMSTACK_QUANT_GEMM_ROWS=4``: below 4 rows the AVX2 kernel (its int8-activation formula), from 4 on the
    dequantised weight times the float activations (F.linear in float64 within fp32 rounding)."""
    O, I = 32, 96
    g = torch.Generator().manual_seed(M)
    q, s = quantize_int8(torch.randn(O, I, generator=g))
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "4")
    if int4_vnni.build("int8_avx2") is not None:
        with pytest.raises(ValueError, match="cannot run"):
            Int8Linear(q, s, kernel="avx2")
        return
    lin = Int8Linear(q, s, kernel="avx2")
    assert lin.DEQUANT_ROWS == 4
    x = torch.randn(M, I, generator=g)
    y, full = lin(x).double(), F.linear(x.double(), dequantize_int8(q, s).double())
    tight = {"rtol": 1e-6, "atol": 2e-6 * float(full.abs().max())}
    if M < 4:
        np.testing.assert_allclose(
            y.numpy(), reference(x, q, s, lin.act_group, lin.terms), rtol=1e-5, atol=1e-5
        )
        assert not torch.allclose(
            y, full, **tight
        )  # the kernel is measurably off the float product
    else:
        torch.testing.assert_close(y, full, **tight)


@pytest.mark.parametrize(
    "flags,arch,forced,want",
    [
        (AVX2, "x86_64", "", ("avx2", None)),
        (
            AVX512_VNNI,
            "x86_64",
            "",
            ("aten", "torch's int8 kernel is as fast on an AVX-512 VNNI CPU"),
        ),
        (AVX512_VNNI, "x86_64", "avx2", ("avx2", None)),
        (AVX2, "x86_64", "aten", ("aten", "LMSTACK_INT8_KERNEL=aten")),
        (frozenset({"sse4_2", "avx"}), "x86_64", "", ("aten", "the CPU lacks avx2, fma, f16c")),
    ],
)
def test_kernel_chosen_from_faked_cpu_flags(flags, arch, forced, want):
    assert choose_int8_kernel(flags, arch, forced) == want


def test_arm_and_bad_switch():
    name, why = choose_int8_kernel({"fp", "asimd", "asimddp"}, "aarch64")
    assert name == "aten" and "aarch64" in why
    with pytest.raises(ValueError, match="LMSTACK_INT8_KERNEL='vnni'"):
        choose_int8_kernel(AVX2, "x86_64", "vnni")


@pytest.mark.parametrize("forced", ["avx2", "aten"])
def test_env_switch_forces_each_kernel(monkeypatch, forced):
    q, s = quantize_int8(torch.randn(32, 64, generator=torch.Generator().manual_seed(5)))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    monkeypatch.setenv("LMSTACK_INT8_KERNEL", forced)
    lin = Int8Linear(q, s)
    want = "aten" if forced == "aten" or int4_vnni.build("int8_avx2") is not None else "avx2"
    assert int8_kernel() == want and lin.kernel == want
    if want == "avx2":  # ours: its int8-activation formula (one term by default)
        np.testing.assert_allclose(
            lin(x).double().numpy(),
            reference(x, q, s, lin.act_group, lin.terms),
            rtol=1e-5,
            atol=1e-5,
        )
    else:  # aten: bf16 activations
        torch.testing.assert_close(lin(x), F.linear(x, dequantize_int8(q, s)), atol=0.05, rtol=0.02)


@pytest.mark.slow
def test_kernel_runs_inside_a_compiled_graph():
    q, s = quantize_int8(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)))
    if int4_vnni.build("int8_avx2") is not None:
        return
    lin = Int8Linear(q, s, kernel="avx2")
    x = torch.randn(1, 64)
    compiled = torch.compile(lambda t: torch.relu(lin(t)) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.relu(lin(x)) * 2)


def test_the_avx2_kernel_is_not_handed_to_onednn(monkeypatch):
    """On lmstack's AVX2 kernel (what an AVX2 CPU without VNNI runs) no oneDNN row count is measured or used:
    one row is the kernel's formula (one int8 term per group of 32, the default)."""
    from lmstack.quant import linear

    if int4_vnni.build("int8_avx2") is not None:
        pytest.skip("the AVX2 int8 kernel cannot be built here")
    monkeypatch.delenv("LMSTACK_QUANT_GEMM_ROWS", raising=False)
    monkeypatch.setattr(
        linear, "_measured", {"int8_avx2_t1": 32}
    )  # its own prefill switch, as measured
    g = torch.Generator().manual_seed(21)
    q, s = quantize_int8(torch.randn(64, 128, generator=g))
    lin = Int8Linear(q, s, kernel="avx2")
    assert lin.gemm_rows is None and not lin.onednn_rows(1) and lin.DEQUANT_ROWS == 32
    assert list(linear._measured) == ["int8_avx2_t1"]  # no oneDNN measurement for this layer
    x = torch.randn(1, 128, generator=g)
    np.testing.assert_allclose(
        lin(x).double().numpy(), reference(x, q, s, lin.act_group, 1), rtol=1e-5, atol=1e-5
    )


def test_int8_terms_default_switch_and_bad_values(monkeypatch):
    """``terms``: 1 by default, ``LMSTACK_INT8_TERMS=2`` takes two; anything else is refused, naming the value."""
    from lmstack.quant.int8 import default_terms

    monkeypatch.delenv("LMSTACK_INT8_TERMS", raising=False)
    assert default_terms() == 1
    monkeypatch.setenv("LMSTACK_INT8_TERMS", "2")
    assert default_terms() == 2
    monkeypatch.setenv("LMSTACK_INT8_TERMS", "3")
    with pytest.raises(ValueError, match="LMSTACK_INT8_TERMS='3'; expected 1 or 2"):
        default_terms()
    q, s = quantize_int8(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="terms=3"):
        Int8Linear(q, s, terms=3)


@pytest.mark.parametrize(
    "flags,exact",
    [
        (
            frozenset({"avx2", "fma", "f16c"}),
            False,
        ),  # vpmaddubsw: u8·s8 pair sums saturate at int16
        (frozenset({"avx2", "fma", "avx_vnni"}), True),
        (frozenset({"avx512f", "avx512bw", "avx512_vnni"}), True),
        (frozenset({"avx512f", "amx_int8", "amx_tile"}), True),
        (frozenset({"fp", "asimd"}), False),
    ],
)
def test_onednn_int8_gemm_only_where_its_sums_are_exact(flags, exact):
    """oneDNN's int8 GEMM (``onednn_mm``) is taken only on a CPU with VNNI or AMX: without them oneDNN's u8 x s8
    products go through vpmaddubsw, whose pair sums saturate (an AMD Zen 3 gave outputs up to 5.3 off)."""
    from lmstack.quant.int8 import has_onednn

    torch_has = torch.backends.mkldnn.is_available() and hasattr(
        getattr(torch.ops, "onednn", None), "qlinear_pointwise"
    )
    assert has_onednn(flags) == (exact and torch_has)
