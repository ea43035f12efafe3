"""lmstack's own int4 matmul for decode: int4 codes x int8 activations, with AVX-512 VNNI or, on CPUs
without it, AVX2 (CS336 notes "量化", "性能指标分析": at batch 1 every weight is read once per token, so the
kernel has to keep pace with memory).

Two C++ kernels, one packed layout and one formula: ``csrc/int4_vnni.cpp`` (AVX-512 VNNI, ``vpdpbusd``) and
``csrc/int4_avx2.cpp`` (AVX2 + FMA + F16C, the ``vpmaddubsw`` + ``vpmaddwd`` pair, compiled with
``-mavx2 -mfma -mf16c`` only so it runs on any AVX2 CPU). Each is compiled on first use with
``torch.utils.cpp_extension`` and registered as ``torch.ops.lmstack_quant.int4_<name>_mm``, so a compiled
decode step calls it without a graph break. Both compute, per output row o and group g of G inputs, with the
weight w = d·q + m (q ∈ 0..15) and the activations quantised per group, s_x = max|x|/127, x_q = round(x / s_x):

    y_o = Σ_g d_og · s_x,g · Σ_{i∈g} q_oi · x_q,i  +  m_og · Σ_{i∈g} x_i

(llama.cpp's Q4_1 × Q8_1 dot product has the same form). With ``terms=2`` each activation is two int8
terms, x ≈ s_x1·x_q1 + s_x2·x_q2 with x_q2 the rounded residual: ~15 bits for a second dot product on codes
already unpacked (one 8-bit term costs SmolLM2 +0.9–1.1% perplexity). ``Int4Linear`` takes one term by
default (``int4.default_terms``: the second costs 1.7–1.9x from 4 rows, 1.3x at one). ``pack`` lays the
codes out in tiles of 16 output rows (one ``vpdpbusd`` = 16 rows × 4 inputs, one int32 lane per row; on AVX2
two 8-row halves) and d, m as fp16. Per call the kernel quantises the activations into a per-thread scratch
buffer, accumulates both terms into one output and prefetches the codes 8 KiB ahead.

Which kernel runs (``kernel()``) is decided once per process by :func:`choose_kernel` from the CPU's flags
(``lmstack.cpu.cpu_features()``, which ``LMSTACK_CPU=avx2|avx512_vnni|neon|...`` replaces by a canned machine):
avx512f/avx512bw/avx512_vnni → "vnni", else avx2/fma/f16c → "avx2", else (an older x86, ARM: no NEON kernel
is written, none could be tested here) torch's ``_weight_int4pack_mm_for_cpu`` ("aten") with the reason in
``status()``. ``LMSTACK_INT4_KERNEL=vnni|avx2|aten`` forces one (a forced kernel the CPU cannot run is off,
with the reason); a kernel that fails to build is off with the reason too (auto then tries the next).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

from lmstack.cpu import cpu_features, probe
from lmstack.utils import build_extension

_log = logging.getLogger(__name__)
_BUILD_LOCK = threading.Lock()
_FAKE_REGISTERED: set[str] = (
    set()
)  # each op's shape function, registered with its first successful build
ENV = "LMSTACK_INT4_KERNEL"
KERNELS = ("vnni", "avx2")  # lmstack's own, best first
# name -> (source, CPU flags it needs, compiler flags). -fopenmp: at::parallel_for is a header template whose
# OpenMP pragma is compiled into the kernel; without the flag it silently runs on one thread.
SPECS = {
    "vnni": (
        Path(__file__).with_name("csrc") / "int4_vnni.cpp",
        ("avx512f", "avx512bw", "avx512_vnni", "f16c"),
        [
            "-O3",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512vnni",
            "-mf16c",
            "-mfma",
            "-fopenmp",
        ],
    ),
    "avx2": (
        Path(__file__).with_name("csrc") / "int4_avx2.cpp",
        ("avx2", "fma", "f16c"),
        ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
    ),
    # Int8Linear's AVX2 kernel (quant/int8.py), built the same way: op int8_avx2_mm
    "int8_avx2": (
        Path(__file__).with_name("csrc") / "int8_avx2.cpp",
        ("avx2", "fma", "f16c"),
        ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
    ),
}
OPS = {"vnni": "int4_vnni_mm", "avx2": "int4_avx2_mm", "int8_avx2": "int8_avx2_mm"}
SOURCE = SPECS["vnni"][0]
X86 = ("x86_64", "AMD64", "i686", "i386")


def _cpu_flags() -> frozenset[str]:
    """The flags of the CPU this process really runs on (not ``LMSTACK_CPU``'s canned machine): what a build
    needs, since a kernel using instructions the CPU lacks would crash."""
    return probe().flags


def choose_kernel(flags, arch: str, forced: str = "") -> tuple[str, str | None]:
    """The int4 kernel for a CPU with ISA ``flags`` (/proc/cpuinfo names) and ``arch`` (``platform.machine()``):
    ("vnni" | "avx2", None), or ("aten", why not ours). ``forced``: the ``LMSTACK_INT4_KERNEL`` value."""
    forced = (forced or "auto").strip().lower()
    if forced not in ("auto", "aten", *KERNELS):
        raise ValueError(f"{ENV}={forced!r}; expected one of auto, aten, {', '.join(KERNELS)}")
    if forced == "aten":
        return "aten", f"{ENV}=aten"
    if arch not in X86:
        return "aten", (
            f"no lmstack int4 kernel for {arch} (a NEON one is not written: it could not be tested "
            "here); torch's kernel runs"
        )
    for name in [forced] if forced in KERNELS else KERNELS:
        missing = [f for f in SPECS[name][1] if f not in flags]
        if not missing:
            return name, None
    return "aten", (
        f"{ENV}={forced} but " if forced in KERNELS else ""
    ) + f"the CPU lacks {', '.join(missing)}"


@functools.cache
def build(name: str) -> str | None:
    """Compile and load kernel ``name`` ("vnni" | "avx2" | "int8_avx2") if this CPU (its real flags) and a compiler allow:
    None when loaded, else the reason. Under a lock, so two threads never build it twice."""
    source, needs, cflags = SPECS[name]
    with _BUILD_LOCK:
        missing = [f for f in needs if f not in _cpu_flags()]
        if missing:
            return f"the CPU lacks {', '.join(missing)}"
        # one build folder per source text and flags (utils.build_extension): two checkouts never share a build
        _, reason = build_extension(
            f"lmstack_{OPS[name].removesuffix('_mm')}", source, cflags, ["-fopenmp"]
        )
        if reason is not None:
            return reason
        try:
            if (
                name not in _FAKE_REGISTERED
            ):  # once per process, even if build() is asked again (cache cleared)

                def fake(
                    x, packed, *args
                ):  # shapes for torch.compile: (M, I) -> (M, O), O = 16 tiles
                    return x.new_empty((x.shape[0], packed.shape[0] * 16), dtype=torch.float32)

                torch.library.register_fake(f"lmstack_quant::{OPS[name]}")(fake)
                if name in KERNELS:  # the int4 kernels' dequantisation: (O/16, I/8, 64) -> (O, I)

                    def fake_w(packed, d, m, G, bf16=False):
                        T, C, _ = packed.shape
                        dtype = torch.bfloat16 if bf16 else torch.float32
                        return packed.new_empty((16 * T, 8 * C), dtype=dtype)

                    torch.library.register_fake(f"lmstack_quant::int4_{name}_dequant")(fake_w)

                    def fake_gemm(x, packed, d, m, G, bf16=False, block=0):  # (M, I) -> (M, O) fp32
                        return x.new_empty((x.shape[0], packed.shape[0] * 16), dtype=torch.float32)

                    torch.library.register_fake(f"lmstack_quant::int4_{name}_gemm")(fake_gemm)
                _FAKE_REGISTERED.add(name)
        except Exception as e:  # noqa: BLE001 — any build/registration failure means: use torch's kernel
            return f"building {source.name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


@functools.cache
def selected() -> tuple[str, str | None]:
    """(the kernel Int4Linear uses: "vnni" | "avx2" | "aten", why not ours or None), decided at the first
    call; the reason is logged once as a warning on ``lmstack.quant.int4_vnni``."""
    cpu = (
        cpu_features()
    )  # LMSTACK_CPU=<name> fakes it: the choice follows, the build still checks the real CPU
    flags, arch, forced = cpu.flags, cpu.arch, os.environ.get(ENV, "")
    name, reason = choose_kernel(flags, arch, forced)
    if (
        name in KERNELS
    ):  # ours: build it; auto falls through to the next one the CPU runs when a build fails
        tried = []
        for cand in (
            KERNELS[KERNELS.index(name) :] if forced.strip().lower() in ("", "auto") else [name]
        ):
            if choose_kernel(flags, arch, cand)[0] == cand:
                if (why := build(cand)) is None:
                    return cand, None
                tried.append(f"{cand}: {why}")
        reason = "; ".join(tried)
    _log.warning("int4 kernel off: %s; Int4Linear uses torch's _weight_int4pack_mm_for_cpu", reason)
    return "aten", reason


def kernel() -> str:
    """The kernel Int4Linear's "auto" takes: "vnni", "avx2" or "aten" (torch's)."""
    return selected()[0]


def status() -> str | None:
    """None when one of lmstack's kernels is built and chosen, else the reason it is not used."""
    return selected()[1]


def clear_cache() -> None:
    """Forget the choice (tests that change ``LMSTACK_INT4_KERNEL``); built kernels stay loaded."""
    selected.cache_clear()


def available() -> bool:
    """Whether Int4Linear's "auto" runs one of lmstack's kernels."""
    return status() is None


def pack(q: Tensor, scale: Tensor, lo: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q (O, I) uint8 codes, scale and minimum (O, I/G) -> packed (O/16, I/8, 64) uint8, d, m (O/16, I/G, 16) fp16.

    Byte 4r + j of chunk c in tile t holds q[16t + r, 8c + j] (low nibble) and q[16t + r, 8c + 4 + j] (high)."""
    O, I = q.shape
    if O % 16 or I % 8:
        raise ValueError(
            f"int4 VNNI layout needs out_features % 16 == 0 and in_features % 8 == 0, got ({O}, {I})"
        )
    t = q.to(torch.uint8).view(O // 16, 16, I // 8, 2, 4)  # (tile, row, chunk, low|high, j)
    packed = (t[:, :, :, 0] | (t[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(O // 16, I // 8, 64)

    def tiles(a: Tensor) -> Tensor:
        return (
            a.float().view(O // 16, 16, -1).permute(0, 2, 1).to(torch.float16).contiguous()
        )  # (O/16, I/G, 16)

    return packed.contiguous(), tiles(scale), tiles(lo)


def unpack(packed: Tensor) -> Tensor:
    """The inverse of ``pack`` for the codes: (O/16, I/8, 64) -> Q (O, I) uint8."""
    T, C, _ = packed.shape
    b = packed.view(T, C, 16, 4)
    q = torch.stack([b & 0xF, b >> 4], dim=3)  # (tile, chunk, row, low|high, j)
    return q.permute(0, 2, 1, 3, 4).reshape(T * 16, C * 8)


def mm(
    x: Tensor,
    packed: Tensor,
    d: Tensor,
    m: Tensor,
    group_size: int,
    terms: int = 2,
    kernel: str | None = None,
) -> Tensor:
    """x (M, I) float -> (M, O) float32 through ``kernel`` ("vnni" | "avx2"; None: the chosen one, which must
    be one of ours; a named one must have been built: ``build(kernel)`` is None). ``terms=2``: each activation as two int8 terms,
    x ≈ s_x1·x_q1 + s_x2·x_q2 (the second rounds the residual; ~15 bits)."""
    if (kernel or selected()[0]) == "avx2":
        return torch.ops.lmstack_quant.int4_avx2_mm(x, packed, d, m, group_size, terms)
    return torch.ops.lmstack_quant.int4_vnni_mm(x, packed, d, m, group_size, terms)


def dequant(
    packed: Tensor,
    d: Tensor,
    m: Tensor,
    group_size: int,
    kernel: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The weights the kernel multiplies, W = d·q + m (fp16 d, m), as float32 (O, I) — or rounded to bf16
    (``dtype=torch.bfloat16``, half the bytes written) — from the packed layout in one pass (C++; ``kernel`` as in
    ``mm``): what a prefill's float GEMM takes above ``Int4Linear.gemm_rows``."""
    bf16 = _float_dtype(dtype, "dequantisation writes")
    return _op("dequant", kernel)(packed, d, m, group_size, bf16)


def gemm(
    x: Tensor,
    packed: Tensor,
    d: Tensor,
    m: Tensor,
    group_size: int,
    kernel: str | None = None,
    dtype: torch.dtype = torch.float32,
    block: int = 0,
) -> Tensor:
    """x (M, I) float32 or bf16 -> x Wᵀ (M, O) float32 with W = d·q + m dequantised in blocks of ``block``
    output rows (a multiple of 16; 0: the measured default, 128, halved down to 64 on several threads when that
    balances them) into a per-thread buffer that stays in L2, each block multiplied right after
    (``csrc/int4_gemm.h``): the prefill GEMM without writing the whole (O, I) weight to memory. ``dtype`` (float32 | bfloat16) is the weights'
    and the activations' dtype in the GEMM; fp32 accumulation and output. ``kernel`` as in ``mm``."""
    bf16 = _float_dtype(dtype, "GEMM multiplies in")
    return _op("gemm", kernel)(x, packed, d, m, group_size, bf16, block)


def _float_dtype(dtype: torch.dtype, what: str) -> bool:
    """Whether ``dtype`` is bf16 (else float32); any other dtype is refused, naming it."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype}; the int4 {what} torch.float32 or torch.bfloat16")
    return dtype == torch.bfloat16


def _op(kind: str, kernel: str | None):
    """``torch.ops.lmstack_quant.int4_<kernel>_<kind>`` (kind "gemm" | "dequant") for ``kernel`` (None: the chosen
    one), by plain attribute names (what a compiled step traces)."""
    avx2 = (kernel or selected()[0]) == "avx2"
    ops = torch.ops.lmstack_quant
    if kind == "gemm":
        return ops.int4_avx2_gemm if avx2 else ops.int4_vnni_gemm
    return ops.int4_avx2_dequant if avx2 else ops.int4_vnni_dequant
