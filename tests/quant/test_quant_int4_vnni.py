"""lmstack's int4 x int8 kernels (quant/int4_vnni.py; csrc/int4_vnni.cpp for AVX-512 VNNI, csrc/int4_avx2.cpp
for AVX2): the packed layout by hand, each kernel the machine can run against the formula written in numpy
float64 (activations quantised per group, w = d·q + m with fp16 d, m), ``Int4Linear`` on it against F.linear
on the dequantised weight, and under torch.compile; the choice of kernel from faked CPU flags, and each
forced by ``LMSTACK_INT4_KERNEL``. Where the CPU or compiler cannot run one, the fallback (a reason, torch's
kernel) is what is checked."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmstack.quant import Int4Linear, dequantize_int4, int4_vnni, quantize_int4

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pack_layout_by_hand_and_unpack():
    q = torch.randint(
        0, 16, (32, 16), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )
    s, lo = torch.rand(32, 2) + 0.1, torch.randn(32, 2)
    packed, d, m = int4_vnni.pack(q, s, lo)
    assert packed.shape == (2, 2, 64) and d.shape == (2, 2, 16) and d.dtype == torch.float16
    # tile 1, chunk 1, row 5, j = 2: q[16 + 5, 8 + 2] low nibble, q[16 + 5, 8 + 4 + 2] high nibble
    assert int(packed[1, 1, 4 * 5 + 2]) == int(q[21, 10]) | (int(q[21, 14]) << 4)
    assert float(d[1, 0, 5]) == float(s[21, 0].half()) and float(m[1, 1, 3]) == float(
        lo[19, 1].half()
    )
    assert torch.equal(int4_vnni.unpack(packed), q)
    with pytest.raises(ValueError, match="% 16"):
        int4_vnni.pack(q[:24], s[:24], lo[:24])


def reference(x, q, d, m, G, terms=1):
    """y = Σ_g d·Σ_t s_t·Σ q·x_t + m·Σ x, float64: term 1 s_1 = max|x_g|/127, x_1 = round(x / s_1) (ties to
    even); term 2 (``terms=2``) the same rounding of the residual x − s_1·x_1."""
    x = x.double().numpy()
    M, I = x.shape
    xg = x.reshape(M, I // G, G)
    qg = q.double().numpy().reshape(-1, I // G, G)
    out, rest = 0.0, xg
    for _ in range(terms):
        s = (
            (np.abs(rest).max(-1) / 127).astype(np.float32).astype(np.float64)
        )  # the kernel's float32 scale
        xq = np.clip(np.round(rest / np.where(s > 0, s, 1)[..., None]), -127, 127)
        out = out + np.einsum("ogi,mgi->mog", qg, xq) * s[:, None]
        rest = rest - xq * s[..., None]
    return (out * d[None] + m[None] * xg.sum(-1)[:, None]).sum(-1)


@pytest.mark.parametrize("kernel", int4_vnni.KERNELS)
@pytest.mark.parametrize(
    "O,I,G,M",
    [
        (64, 128, 32, 1),
        (32, 64, 8, 5),
        (48, 256, 64, 4),
        (16, 96, 32, 9),
        # odd group sizes and tails: G = 24 (3 chunks, the scalar quantisation), 40 (a block of 4 chunks and a
        # 1-chunk tail), 48 (4 + 2), 128 (four blocks); odd M (rows left over after the multi-row passes)
        (32, 120, 24, 3),
        (16, 240, 40, 2),
        (48, 96, 48, 7),
        (32, 256, 128, 1),
        # rows in blocks of ~64 KB of int8 activations (int4_common.h run_tiles): 2048 inputs give blocks of 32
        # rows (one term) or 16 (two), so 37 rows are 2 or 3 blocks, the last with a tail of rows
        (16, 2048, 32, 37),
        # the VNNI kernel's passes of 8 rows (4 with two terms) and one pass for the rest: 13 = 8 + 5
        # (4 + 4 + 4 + 1), 6 rows in one pass (4 + 2), at the compile-time chunk counts of G = 32 and 64
        (32, 128, 32, 13),
        (16, 512, 64, 6),
    ],
)
def test_kernel_equals_its_formula_and_int4linear_is_close_to_float(
    kernel, O, I, G, M, monkeypatch
):
    monkeypatch.setenv(
        "LMSTACK_QUANT_GEMM_ROWS", "never"
    )  # Int4Linear on the kernel at every row count
    g = torch.Generator().manual_seed(O + M)
    w, x = torch.randn(O, I, generator=g), torch.randn(M, I, generator=g)
    q, s, lo = quantize_int4(w, G)
    if int4_vnni.build(kernel) is not None:  # no skip: the fallback is what runs here
        with pytest.raises(ValueError, match="cannot run"):
            Int4Linear(q, s, lo, kernel=kernel)
        return
    packed, d, m = int4_vnni.pack(q, s, lo)
    d64, m64 = (
        d.double().permute(0, 2, 1).reshape(O, -1).numpy(),
        m.double().permute(0, 2, 1).reshape(O, -1).numpy(),
    )
    for terms in (1, 2):
        ref = reference(x, q, d64, m64, G, terms)
        y = int4_vnni.mm(x, packed, d, m, G, terms, kernel=kernel)
        np.testing.assert_allclose(
            y.double().numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max()
        )
    lin = Int4Linear(q, s, lo, kernel=kernel, terms=2)  # two activation terms
    assert (
        lin.kernel == kernel
        and lin.vnni
        and f"kernel={kernel}" in repr(lin)
        and torch.equal(lin._codes(), q)
    )
    torch.testing.assert_close(lin(x), y)
    torch.testing.assert_close(lin.dequantized_weight(), dequantize_int4(q, s, lo))
    # against float activations and fp16 d, m: one int8 term costs ~1% (random weights), two ~1e-4
    full = F.linear(
        x.double(),
        torch.tensor(d64).repeat_interleave(G, 1) * q.double()
        + torch.tensor(m64).repeat_interleave(G, 1),
    )
    one = int4_vnni.mm(x, packed, d, m, G, 1, kernel=kernel)
    assert (
        float((lin(x).double() - full).norm() / full.norm())
        < 3e-4
        < float((one.double() - full).norm() / full.norm())
    )
    assert lin.kernel_bytes() == O * I // 2 + 2 * 2 * O * (I // G)  # codes + fp16 d and m


def test_auto_takes_the_chosen_kernel_or_says_why_not():
    q, s, lo = quantize_int4(torch.randn(32, 64, generator=torch.Generator().manual_seed(4)), 32)
    lin = Int4Linear(q, s, lo)
    assert lin.kernel == int4_vnni.kernel()
    if lin.kernel == "aten":
        assert int4_vnni.status() and not lin.vnni and "kernel=aten" in repr(lin)
    else:
        assert int4_vnni.status() is None and int4_vnni.build(lin.kernel) is None
    assert (
        Int4Linear(q, s, lo, compute_dtype=torch.float32).kernel == "aten"
    )  # ours only for bf16 compute


AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})  # Haswell .. Zen 3
AVX512_VNNI = AVX2 | {
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512cd",
    "avx512_vnni",
}  # Cascade Lake


@pytest.mark.parametrize(
    "flags,arch,forced,want",
    [
        (AVX2, "x86_64", "", ("avx2", None)),
        (
            AVX2 | {"avx_vnni"},
            "x86_64",
            "",
            ("avx2", None),
        ),  # Alder Lake: 256-bit VNNI only, the AVX2 kernel
        (
            AVX2 | {"avx512f", "avx512bw", "avx512vl"},
            "x86_64",
            "auto",
            ("avx2", None),
        ),  # AVX-512 without VNNI
        (AVX512_VNNI, "x86_64", "", ("vnni", None)),
        (AVX512_VNNI, "x86_64", "AVX2", ("avx2", None)),  # forced, case-insensitive
        (AVX512_VNNI, "x86_64", "aten", ("aten", "LMSTACK_INT4_KERNEL=aten")),
        (
            AVX2,
            "x86_64",
            "vnni",
            ("aten", "LMSTACK_INT4_KERNEL=vnni but the CPU lacks avx512f, avx512bw, avx512_vnni"),
        ),
        (frozenset({"sse4_2", "avx"}), "x86_64", "", ("aten", "the CPU lacks avx2, fma, f16c")),
        (AVX2 - {"f16c"}, "x86_64", "", ("aten", "the CPU lacks f16c")),
    ],
)
def test_kernel_chosen_from_faked_cpu_flags(flags, arch, forced, want):
    assert int4_vnni.choose_kernel(flags, arch, forced) == want


# lmstack.cpu's canned machines (LMSTACK_CPU=<name>) -> the kernel, by hand from each part's ISA
CANNED = {
    "default": "aten",
    "avx2": "avx2",
    "avx2_vnni": "avx2",
    "avx512": "avx2",
    "avx512_vnni": "vnni",
    "avx512_bf16": "vnni",
    "amx": "vnni",
    "neon": "aten",
    "neon_bf16": "aten",
}


@pytest.mark.parametrize("machine", sorted(CANNED))
def test_kernel_chosen_for_each_canned_cpu(monkeypatch, machine):
    from lmstack.cpu import FAKE_CPUS

    if machine not in FAKE_CPUS:
        pytest.fail(f"lmstack.cpu has no canned machine {machine!r}")
    f = FAKE_CPUS[machine]
    assert int4_vnni.choose_kernel(f.flags, f.arch)[0] == CANNED[machine]
    monkeypatch.setenv("LMSTACK_CPU", machine)  # the process-wide choice follows the canned machine
    monkeypatch.delenv(
        int4_vnni.ENV, raising=False
    )  # a forced kernel in the caller's env would override it
    int4_vnni.clear_cache()
    try:
        name, why = int4_vnni.selected()
        want = CANNED[machine]
        if (
            want != "aten" and int4_vnni.build(want) is not None
        ):  # this CPU cannot build it (an AVX2 CPU faking AVX-512): auto falls through to the next kernel
            # the faked flags allow and the real CPU builds (avx2), else torch's with the reason naming it
            later = int4_vnni.KERNELS[int4_vnni.KERNELS.index(want) + 1 :]
            runs = [
                k
                for k in later
                if int4_vnni.choose_kernel(f.flags, f.arch, k)[0] == k
                and int4_vnni.build(k) is None
            ]
            if runs:
                assert name == runs[0] and why is None
            else:
                assert name == "aten" and want in why
        else:
            assert name == want and (why is None) == (want != "aten")
            if machine.startswith("neon"):
                assert "aarch64" in why and "NEON" in why
    finally:
        monkeypatch.delenv("LMSTACK_CPU")
        int4_vnni.clear_cache()


def test_arm_and_bad_switch():
    name, why = int4_vnni.choose_kernel({"fp", "asimd", "asimddp"}, "aarch64")
    assert name == "aten" and "aarch64" in why and "NEON" in why
    assert (
        int4_vnni.choose_kernel(AVX512_VNNI, "aarch64", "vnni")[0] == "aten"
    )  # x86 flags on ARM: still torch's
    with pytest.raises(ValueError, match="LMSTACK_INT4_KERNEL='avx'.*auto, aten, vnni, avx2"):
        int4_vnni.choose_kernel(AVX2, "x86_64", "avx")


@pytest.mark.parametrize("kernel", int4_vnni.KERNELS)
def test_env_switch_forces_each_kernel(monkeypatch, kernel):
    q, s, lo = quantize_int4(torch.randn(32, 64, generator=torch.Generator().manual_seed(5)), 32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    monkeypatch.setenv("LMSTACK_INT4_KERNEL", kernel)
    int4_vnni.clear_cache()
    try:
        lin = Int4Linear(q, s, lo)
        # this CPU (or the one LMSTACK_CPU fakes) cannot, or the build fails: torch's kernel, with the reason
        if int4_vnni.selected()[0] != kernel:
            assert lin.kernel == "aten" and kernel in int4_vnni.status()
            return
        assert int4_vnni.kernel() == kernel and lin.kernel == kernel
        # the default int8 terms per activation: one on every kernel (llama.cpp's Q8_1)
        assert lin.terms == 1
        packed, d, m = int4_vnni.pack(q, s, lo)
        d64, m64 = (
            d.double().permute(0, 2, 1).reshape(32, -1).numpy(),
            m.double().permute(0, 2, 1).reshape(32, -1).numpy(),
        )
        ref = reference(x, q, d64, m64, 32, lin.terms)
        np.testing.assert_allclose(
            lin(x).double().numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max()
        )
    finally:
        monkeypatch.delenv("LMSTACK_INT4_KERNEL")
        int4_vnni.clear_cache()


def test_default_terms_per_kernel_and_env_switch(monkeypatch):
    from lmstack.quant.int4 import default_terms

    assert (default_terms("avx2"), default_terms("vnni"), default_terms("aten")) == (1, 1, 1)
    q, s, lo = quantize_int4(torch.randn(32, 64, generator=torch.Generator().manual_seed(7)), 32)
    assert Int4Linear(q, s, lo, terms=1).terms == 1  # an explicit count wins
    monkeypatch.setenv("LMSTACK_INT4_TERMS", "2")
    assert default_terms("avx2") == 2 and Int4Linear(q, s, lo).terms == 2
    monkeypatch.setenv("LMSTACK_INT4_TERMS", "3")
    with pytest.raises(ValueError, match="LMSTACK_INT4_TERMS='3'; expected 1 or 2"):
        default_terms("avx2")
    with pytest.raises(ValueError, match="terms=4"):
        Int4Linear(q, s, lo, terms=4)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", int4_vnni.KERNELS)
def test_kernel_runs_inside_a_compiled_graph(kernel):
    q, s, lo = quantize_int4(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), 32)
    if int4_vnni.build(kernel) is not None:
        with pytest.raises(ValueError, match="cannot run"):
            Int4Linear(q, s, lo, kernel=kernel)
        return
    lin = Int4Linear(q, s, lo, kernel=kernel)
    x = torch.randn(1, 64)
    compiled = torch.compile(
        lambda t: torch.relu(lin(t)) * 2, fullgraph=True
    )  # fullgraph: no graph break
    torch.testing.assert_close(compiled(x), torch.relu(lin(x)) * 2)


def test_turned_off_by_env_logs_the_reason_and_falls_back(monkeypatch, caplog):
    import logging

    q, s, lo = quantize_int4(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)), 32)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    monkeypatch.setenv("LMSTACK_INT4_KERNEL", "aten")
    int4_vnni.clear_cache()
    try:
        with caplog.at_level(logging.WARNING, logger="lmstack.quant.int4_vnni"):
            assert int4_vnni.status() == "LMSTACK_INT4_KERNEL=aten" and not int4_vnni.available()
        assert "int4 kernel off: LMSTACK_INT4_KERNEL=aten" in caplog.text
        lin = Int4Linear(q, s, lo)
        assert (
            not lin.vnni and lin.kernel == "aten"
        )  # torch's kernel, bf16 activations: close to F.linear
        torch.testing.assert_close(
            lin(x), F.linear(x, dequantize_int4(q, s, lo)), atol=0.05, rtol=0.02
        )
    finally:
        monkeypatch.delenv("LMSTACK_INT4_KERNEL")
        int4_vnni.clear_cache()


def test_build_hash_covers_the_shared_header(tmp_path):
    """utils.build_extension names its build by the source and the headers it includes in quotes, so a change
    in csrc/int4_common.h or csrc/int4_gemm.h rebuilds both int4 kernels."""
    from lmstack.utils import source_text_with_headers

    (tmp_path / "a.cpp").write_bytes(b'#include "h.h"\n#include <vector>\nint f();\n')
    (tmp_path / "h.h").write_bytes(b'#pragma once\n#include "g.h"\n')
    (tmp_path / "g.h").write_bytes(b"int g();\n")
    a, h, g = (tmp_path / n for n in ("a.cpp", "h.h", "g.h"))
    assert source_text_with_headers(a) == a.read_bytes() + h.read_bytes() + g.read_bytes()
    for name in ("int4_vnni", "int4_avx2"):  # both kernels include the shared headers
        src = int4_vnni.SPECS[name.removeprefix("int4_")][0]
        # int4_gemm.h includes int4_common.h again: counted once
        headers = b"".join((src.parent / h).read_bytes() for h in ("int4_common.h", "int4_gemm.h"))
        assert source_text_with_headers(src) == src.read_bytes() + headers


def test_choose_gemm_rows_by_hand():
    from lmstack.quant.linear import choose_gemm_rows

    # (kernel s, GEMM s) per row count: the GEMM wins from 32 rows on
    assert choose_gemm_rows({8: (1, 2), 16: (2, 2.5), 32: (4, 3), 64: (8, 5), 128: (16, 9)}) == 32
    assert (
        choose_gemm_rows({8: (1, 0.5), 16: (2, 3), 32: (4, 3)}) == 32
    )  # a win at 8 alone does not count
    assert choose_gemm_rows({8: (1, 2), 16: (2, 3)}) is None  # the kernel always wins
    assert choose_gemm_rows({8: (2, 1), 16: (3, 2)}) == 8


def test_gemm_rows_env_switch_and_one_measurement_per_kernel(monkeypatch):
    from lmstack.quant import linear

    calls = []

    def measure(M):
        calls.append(M)
        return (
            M * 1.0,
            40.0,
        )  # the kernel's time grows with M, the GEMM's does not: GEMM from the first candidate above 40

    monkeypatch.setattr(linear, "_measured", {})
    monkeypatch.delenv(linear.GEMM_ROWS_ENV, raising=False)
    first = min(M for M in linear.GEMM_ROWS_CANDIDATES if M > 40)
    assert linear.gemm_rows("k", measure) == first and linear.gemm_rows("k", measure) == first
    assert calls == list(linear.GEMM_ROWS_CANDIDATES)  # measured once, at each candidate
    monkeypatch.setenv(linear.GEMM_ROWS_ENV, "never")
    assert linear.gemm_rows("k", measure) is None
    monkeypatch.setenv(linear.GEMM_ROWS_ENV, "12")
    assert linear.gemm_rows("other", measure) == 12 and len(calls) == len(
        linear.GEMM_ROWS_CANDIDATES
    )
    for bad in ("0", "many"):
        monkeypatch.setenv(linear.GEMM_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=f"LMSTACK_QUANT_GEMM_ROWS='{bad}'"):
            linear.gemm_rows("k", measure)


@pytest.mark.parametrize("kernel", int4_vnni.KERNELS)
def test_prefill_gemm_and_kernel_each_equal_their_float64_formula(monkeypatch, kernel):
    """Below ``gemm_rows`` rows the kernel (int8 activations, its formula); from it on the dequantised weight
    W = d·q + m (fp16 d, m) times the float activations (F.linear in float64 within fp32 rounding)."""
    O, I, G = 48, 160, 32
    g = torch.Generator().manual_seed(7)
    q, s, lo = quantize_int4(torch.randn(O, I, generator=g), G)
    if int4_vnni.build(kernel) is not None:
        with pytest.raises(ValueError, match="cannot run"):
            Int4Linear(q, s, lo, kernel=kernel)
        return
    packed, d, m = int4_vnni.pack(q, s, lo)
    d64 = d.double().permute(0, 2, 1).reshape(O, -1)
    m64 = m.double().permute(0, 2, 1).reshape(O, -1)
    w64 = d64.repeat_interleave(G, 1) * q.double() + m64.repeat_interleave(G, 1)  # (O, I)
    assert torch.equal(
        int4_vnni.dequant(packed, d, m, G, kernel=kernel).double(), w64
    )  # exact in fp32
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "5")
    lin = Int4Linear(q, s, lo, kernel=kernel)
    assert lin.gemm_rows == 5
    # the GEMM's operands: W and x as they are, or both rounded to bf16 (a CPU with native bf16, where the output
    # is rounded to bf16 once more)
    bf16 = lin.gemm_dtype == torch.bfloat16
    w_gemm = w64.float().bfloat16().double() if bf16 else w64
    for M in (1, 4, 5, 9):
        x = torch.randn(M, I, generator=g)
        x_gemm = x.bfloat16().double() if bf16 else x.double()
        y, full = lin(x).double(), F.linear(x_gemm, w_gemm)
        tight = {"rtol": 1e-6, "atol": 2e-6 * float(full.abs().max())}
        if (
            M < 5
        ):  # the kernel: its formula (its default int8 terms), and measurably off the float product
            ref = reference(x, q, d64.numpy(), m64.numpy(), G, lin.terms)
            np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
            assert not torch.allclose(y, full, **tight)
        elif (
            bf16
        ):  # oneDNN's bf16 GEMM accumulates in fp32 and writes bf16: one bf16 rounding of the sum
            torch.testing.assert_close(y, full, rtol=2**-8, atol=2e-6 * float(full.abs().max()))
        else:
            torch.testing.assert_close(y, full, **tight)
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "never")
    assert Int4Linear(q, s, lo, kernel=kernel).gemm_rows is None


@pytest.mark.parametrize("kernel", int4_vnni.KERNELS)
def test_bf16_dequant_is_the_float64_weight_rounded_to_bf16(kernel):
    """``dequant(dtype=bf16)`` writes W = d·q + m (float64, from the fp16 d, m) rounded to nearest-even bf16:
    torch's own conversion of the exact value, element for element (odd shapes, several groups)."""
    if int4_vnni.build(kernel) is not None:
        pytest.skip(f"kernel {kernel} cannot run here: {int4_vnni.build(kernel)}")
    O, I, G = 80, 96, 32
    g = torch.Generator().manual_seed(11)
    q, s, lo = quantize_int4(torch.randn(O, I, generator=g) * 3, G)
    packed, d, m = int4_vnni.pack(q, s, lo)
    d64 = d.double().permute(0, 2, 1).reshape(O, -1).repeat_interleave(G, 1)
    m64 = m.double().permute(0, 2, 1).reshape(O, -1).repeat_interleave(G, 1)
    w64 = d64 * q.double() + m64  # (O, I), exact in fp32 (the test above)
    got = int4_vnni.dequant(packed, d, m, G, kernel=kernel, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (O, I)
    assert torch.equal(got, w64.float().bfloat16())
    with pytest.raises(ValueError, match="float32 or torch.bfloat16"):
        int4_vnni.dequant(packed, d, m, G, kernel=kernel, dtype=torch.float16)


def test_gemm_dtype_follows_native_bf16(monkeypatch):
    """The prefill GEMM runs in bf16 only on a CPU that multiplies bf16 natively (AMX / AVX512_BF16); an
    AVX-512 VNNI part without bf16 keeps float32 (torch would emulate bf16, slower than fp32)."""
    from lmstack.quant.int4 import gemm_dtype

    for name, want in (
        ("amx", torch.bfloat16),
        ("avx512_bf16", torch.bfloat16),
        ("avx512_vnni", torch.float32),
        ("avx2", torch.float32),
    ):
        monkeypatch.setenv("LMSTACK_CPU", name)
        assert gemm_dtype() == want, name


def test_fused_layer_measures_its_own_shape(monkeypatch):
    """``concat_rows`` measures ``gemm_rows`` again for the fused (sum of outputs, I) shape: a measurement
    keyed by shape (kernel, GEMM dtype, O x I), so the parts' and the fused layer's keys differ."""
    from lmstack.quant import linear

    if not int4_vnni.available():
        pytest.skip("no lmstack int4 kernel on this CPU")
    keys = []

    def fake_gemm_rows(key, measure):
        keys.append(key)
        return 7

    monkeypatch.setattr("lmstack.quant.int4.gemm_rows", fake_gemm_rows)
    g = torch.Generator().manual_seed(3)
    parts = [Int4Linear(*quantize_int4(torch.randn(o, 64, generator=g), 32)) for o in (32, 48)]
    fused = Int4Linear.concat_rows(parts)
    assert fused is not None and fused.gemm_rows == 7
    assert [k.rsplit("_", 1)[1] for k in keys] == ["32x64", "48x64", "80x64"]
    assert linear.GEMM_ROWS_CANDIDATES == tuple(sorted(linear.GEMM_ROWS_CANDIDATES))


def test_arm_falls_back_to_torchs_kernels(monkeypatch):
    """No NEON kernel is written (none could be tested here): on ``LMSTACK_CPU=neon`` Int4Linear and Int8Linear
    take torch's kernels, and their output is the dequantised weight's product within bf16 rounding (in
    relative norm: single elements of a 64-term bf16 sum are off by up to ~5%)."""
    from lmstack.quant import Int8Linear, dequantize_int8, quantize_int8

    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
    monkeypatch.setenv("LMSTACK_CPU", "neon")
    int4_vnni.clear_cache()
    try:
        q, s, lo = quantize_int4(w, 32)
        lin4 = Int4Linear(q, s, lo)
        assert lin4.kernel == "aten" and not lin4.vnni and lin4.gemm_rows is None
        assert "aarch64" in int4_vnni.status() and "NEON" in int4_vnni.status()
        ref4 = F.linear(x, dequantize_int4(q, s, lo))
        assert float((lin4(x) - ref4).norm() / ref4.norm()) < 1e-2  # bf16 activations: ~0.4% each
        q8, s8 = quantize_int8(w)
        lin8 = Int8Linear(q8, s8)
        assert lin8.kernel == "aten"
        ref8 = F.linear(x, dequantize_int8(q8, s8))
        assert float((lin8(x) - ref8).norm() / ref8.norm()) < 1e-2
    finally:
        monkeypatch.delenv("LMSTACK_CPU")
        int4_vnni.clear_cache()
