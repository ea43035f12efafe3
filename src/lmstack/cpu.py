"""What this CPU can do, read once, and the defaults that follow from it.

Machines differ more than code assumes: an AVX-512 Xeon with AMX multiplies bf16 matrices natively, an
AVX2-only EPYC or laptop has no bf16 instructions (torch then emulates bf16 matmuls, far slower
than fp32: docs/training.md), Apple Silicon and other ARM CPUs have NEON and maybe BF16/I8MM. Every choice that
depends on the CPU asks this module: :func:`cpu_features` probes once (cached) —

- ``capability``: ``torch.backends.cpu.get_cpu_capability()``, the ISA level torch's own kernels dispatch to
  ("AVX512", "AVX2", "DEFAULT", "SVE256", ...; ``ATEN_CPU_CAPABILITY`` lowers it),
- ``flags``: the instruction-set flags the kernel reports (``/proc/cpuinfo`` "flags" on x86, "Features" on ARM),
- ``vendor``: ``/proc/cpuinfo``'s "vendor_id" ("GenuineIntel", "AuthenticAMD"; "" when unknown), which the GEMM
  dispatch reads (``lmstack.ops.gemm``: MKL takes a slow path on AMD),

and :func:`choose_precision` turns a requested training precision (``auto`` by default) into the one to
run, with the reason, measuring where the flags alone cannot say. ``LMSTACK_CPU=<name>`` replaces the probe
with one of the canned machines in :data:`FAKE_CPUS` (``avx2``, ``epyc``, ``avx512``, ``avx512_vnni``, ``avx512_bf16``,
``amx``, ``neon``, ``neon_bf16``, ``default``), so every dispatch path can be exercised on any machine; tests
pass a :class:`CpuFeatures` directly.
"""

from __future__ import annotations

import functools
import os
import platform
import time
import warnings
from dataclasses import dataclass, field

import torch

from lmstack.utils import FLOAT_DTYPES

ENV = "LMSTACK_CPU"

# The x86 flags that the choices below read (names as /proc/cpuinfo spells them).
_X86_AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
_X86_AVX512 = _X86_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


@dataclass(frozen=True)
class CpuFeatures:
    """One CPU: ``arch`` (``platform.machine()``), torch's dispatch ``capability``, the ISA ``flags``, the
    ``vendor`` ("GenuineIntel", "AuthenticAMD", "" unknown)."""

    arch: str
    capability: str
    flags: frozenset[str] = field(default_factory=frozenset)
    source: str = "probed"  # or "LMSTACK_CPU=<name>" for a canned machine
    vendor: str = ""

    def has(self, *names: str) -> bool:
        """True when every flag in ``names`` is present."""
        return all(n in self.flags for n in names)

    @property
    def is_x86(self) -> bool:
        return self.arch in ("x86_64", "AMD64", "i686", "i386")

    @property
    def is_arm(self) -> bool:
        return self.arch in ("aarch64", "arm64")

    @property
    def avx2(self) -> bool:
        """AVX2 with FMA and F16C: what an AVX2 kernel is compiled for (``-mavx2 -mfma -mf16c``)."""
        return self.is_x86 and self.has("avx2", "fma", "f16c")

    @property
    def avx512(self) -> bool:
        return self.is_x86 and self.has("avx512f", "avx512bw", "avx512vl")

    @property
    def avx512_vnni(self) -> bool:
        return self.avx512 and self.has("avx512_vnni")

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU multiplies bf16 in hardware: AVX512_BF16 or AMX-BF16 on x86, the BF16 extension on ARM.

        Without it torch computes a bf16 matmul by converting to fp32 piece by piece (no faster than fp32, and
        often much slower: docs/training.md), so bf16 autocast only costs time."""
        if self.is_x86:
            return self.has("avx512_bf16") or self.has("amx_bf16")
        if self.is_arm:
            return self.has("bf16")
        return False

    def summary(self) -> str:
        """One line for logs: arch, torch's capability and the flags that matter here."""
        shown = [
            f
            for f in (
                "avx2",
                "fma",
                "avx512f",
                "avx512_vnni",
                "avx_vnni",
                "avx512_bf16",
                "amx_bf16",
                "amx_int8",
                "asimd",
                "asimddp",
                "bf16",
                "i8mm",
                "sve",
            )
            if f in self.flags
        ]
        src = "" if self.source == "probed" else f" [{self.source}]"
        return (
            f"{self.arch}, torch capability {self.capability}, flags {' '.join(shown) or '-'}{src}"
        )


def _fakes(**machines: tuple) -> dict[str, CpuFeatures]:
    """name=(arch, capability, flags[, vendor])"""
    return {
        name: CpuFeatures(
            m[0], m[1], frozenset(m[2]), source=f"{ENV}={name}", vendor=m[3] if len(m) > 3 else ""
        )
        for name, m in machines.items()
    }


# Canned machines for LMSTACK_CPU and for tests (flag sets of real parts, trimmed to what matters).
FAKE_CPUS: dict[str, CpuFeatures] = _fakes(
    default=("x86_64", "DEFAULT", {"sse4_2"}),  # an old x86 (or ATEN_CPU_CAPABILITY=default)
    avx2=("x86_64", "AVX2", _X86_AVX2),  # Haswell .. Zen 3, most laptops: no bf16, no VNNI
    epyc=("x86_64", "AVX2", _X86_AVX2, "AuthenticAMD"),  # Zen 2/3 EPYC: AVX2, MKL's slow path
    avx2_vnni=(
        "x86_64",
        "AVX2",
        _X86_AVX2 | {"avx_vnni"},
        "GenuineIntel",
    ),  # Alder Lake: AVX-VNNI, no AVX-512
    avx512=("x86_64", "AVX512", _X86_AVX512, "GenuineIntel"),  # Skylake-X
    avx512_vnni=(
        "x86_64",
        "AVX512",
        _X86_AVX512 | {"avx512_vnni"},
        "GenuineIntel",
    ),  # Cascade Lake
    avx512_bf16=(
        "x86_64",
        "AVX512",
        _X86_AVX512 | {"avx512_vnni", "avx512_bf16"},
        "AuthenticAMD",
    ),  # Zen 4
    amx=(
        "x86_64",
        "AVX512",
        _X86_AVX512
        | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni"},
        "GenuineIntel",
    ),  # Sapphire Rapids
    neon=("aarch64", "DEFAULT", {"fp", "asimd", "asimddp"}),  # Graviton 2, Raspberry Pi 5
    neon_bf16=(
        "aarch64",
        "DEFAULT",
        {"fp", "asimd", "asimddp", "bf16", "i8mm"},
    ),  # Graviton 3, Apple M2+
)


def _read_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """ISA flags of the first CPU in ``cpuinfo`` (x86 "flags", ARM "Features"); empty when unreadable."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _read_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first CPU's "vendor_id" in ``cpuinfo`` ("GenuineIntel", "AuthenticAMD"); "" when absent or unreadable."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() == "vendor_id":
                    return value.strip()
    except OSError:
        pass
    return ""


def probe(cpuinfo: str = "/proc/cpuinfo") -> CpuFeatures:
    """Read this machine (no cache, no ``LMSTACK_CPU``): ``cpu_features()`` is the cached entry point."""
    arch = platform.machine() or "unknown"
    flags = _read_flags(cpuinfo)
    if not flags and arch in (
        "arm64",
        "aarch64",
    ):  # macOS has no /proc: every Apple Silicon has NEON + dotprod
        flags = frozenset({"fp", "asimd", "asimddp"})
    return CpuFeatures(
        arch, torch.backends.cpu.get_cpu_capability(), flags, vendor=_read_vendor(cpuinfo)
    )


@functools.cache
def _cached(fake: str | None) -> CpuFeatures:
    if fake is None:
        return probe()
    key = fake.strip().lower()
    if key not in FAKE_CPUS:
        raise ValueError(
            f"{ENV}={fake!r}; expected one of {sorted(FAKE_CPUS)} (or unset to probe this CPU)"
        )
    return FAKE_CPUS[key]


def cpu_features() -> CpuFeatures:
    """This CPU, probed once per process; ``LMSTACK_CPU=<name>`` returns a canned machine instead."""
    return _cached(os.environ.get(ENV) or None)


# ---- training precision ------------------------------------------------------------------------------

TRAIN_PRECISIONS = ("auto", *FLOAT_DTYPES)  # ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run uses, why, and (when measured) bf16 and fp32 matmul GFLOP/s."""

    precision: str
    reason: str
    gflops: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        return f"precision: {self.precision} ({self.reason})"


def matmul_gflops(dtype: torch.dtype, n: int = 256, budget_s: float = 0.25) -> float:
    """GFLOP/s of an (n, n) @ (n, n) product in ``dtype`` on this CPU: 2·n³ / best of a few timed calls
    (at least one call; more while the time ``budget_s`` lasts)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # first call: allocation, oneDNN primitive creation
    best = float("inf")
    t_end = time.perf_counter() + budget_s
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return 2 * n**3 / best / 1e9


def _measure(n: int) -> dict[str, float]:
    return {"bf16": matmul_gflops(torch.bfloat16, n), "fp32": matmul_gflops(torch.float32, n)}


def choose_precision(
    requested: str = "auto",
    device: str | torch.device = "cpu",
    features: CpuFeatures | None = None,
    measure=_measure,
) -> PrecisionChoice:
    """The training precision to run for ``requested`` on ``device`` (mixed precision: Book of LLMs §5.4 “autocast and bitsandbytes”).

    ``auto`` on a CPU: bf16 autocast only where the CPU has native bf16 matmul (:attr:`CpuFeatures.native_bf16`)
    *and* a short measurement (``measure(n) -> {"bf16": GFLOP/s, "fp32": GFLOP/s}``) finds bf16 faster; else
    fp32. ``auto`` on CUDA: bf16 where the GPU supports it, else fp32. An explicit ``bf16``/``fp16`` is kept,
    but on a CPU without native bf16 it warns with the measured slowdown (a small matmul: emulated bf16 is slow).
    """
    if requested not in TRAIN_PRECISIONS:
        raise ValueError(f"precision={requested!r}; expected one of {TRAIN_PRECISIONS}")
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        if requested != "auto":
            return PrecisionChoice(requested, "as configured")
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return PrecisionChoice(
            "bf16" if ok else "fp32",
            "auto: " + ("the GPU supports bf16" if ok else "this GPU has no bf16"),
        )
    if dev.type != "cpu":  # mps, xpu, ...: no probe here, fp32 unless asked
        if requested != "auto":
            return PrecisionChoice(requested, "as configured")
        return PrecisionChoice("fp32", f"auto on {dev.type}: fp32")
    f = features if features is not None else cpu_features()
    if requested == "fp32":
        return PrecisionChoice("fp32", "as configured")
    if requested in ("bf16", "fp16"):
        if requested == "bf16" and not f.native_bf16:
            if (
                f.source != "probed"
            ):  # a canned machine: this CPU's timings would say nothing about it
                g, how = {}, "not measured on a faked CPU"
            else:
                g = measure(128)
                slow = g["fp32"] / max(g["bf16"], 1e-9)
                how = f"measured bf16 {g['bf16']:.1f} vs fp32 {g['fp32']:.1f} GFLOP/s, {slow:.1f}x slower"
            warnings.warn(
                f"precision='bf16' on a CPU without native bf16 matmul ({f.summary()}): torch emulates "
                f"it ({how}); precision='auto' or 'fp32' trains faster here",
                RuntimeWarning,
                stacklevel=2,
            )
            return PrecisionChoice("bf16", f"as configured; emulated: {how}", g)
        return PrecisionChoice(requested, "as configured")
    if not f.native_bf16:
        return PrecisionChoice(
            "fp32",
            "auto: no native bf16 matmul on this CPU (AVX512_BF16, AMX or ARM BF16); "
            "torch would emulate bf16",
        )
    g = measure(512)
    if g["bf16"] > g["fp32"]:
        return PrecisionChoice(
            "bf16",
            f"auto: native bf16, measured {g['bf16']:.0f} vs fp32 {g['fp32']:.0f} GFLOP/s",
            g,
        )
    return PrecisionChoice(
        "fp32",
        f"auto: native bf16 flags but measured bf16 {g['bf16']:.0f} <= fp32 "
        f"{g['fp32']:.0f} GFLOP/s",
        g,
    )
