"""Accelerator specs and a measurement of this machine (Book of LLMs §4.1 “HBM and SRAM”, CS336 notes "可用资源盘点").

Book of LLMs §4.1 “HBM and SRAM”: HBM is the GPU's large, slow main memory (A100: 40 or 80 GB); SRAM is the small
on-chip memory (about 20 MB on an A100). CS336 notes "计算强度分析" gives the H100 numbers the
roofline uses: 9.89e14 FLOP/s and 3.35e12 bytes/s, a ridge point of about 295 FLOPs/byte.

Units: FLOP/s are dense (no 2:4 sparsity; datasheets often quote the sparse figure, twice the
dense one). Bandwidths are bytes/s. ``nvlink_bandwidth`` and ``pcie_bandwidth`` are the total
bidirectional figures vendors quote per GPU (half of it flows each way); ``ib_bandwidth`` is one
NIC's line rate in one direction. ``sram_bytes`` is the SMs' combined L1/shared memory.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field

from lmstack.accounting.precision import canonical_dtype
from lmstack.utils import FLOAT_DTYPES, torch_dtype

KIB = 1024


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dense FLOP/s per dtype key (fp32, tf32, bf16, fp16, fp8, int8)
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: float  # bytes of HBM (device memory)
    sram_bytes: float = 0.0  # on-chip SRAM (L1/shared over all SMs)
    nvlink_bandwidth: float | None = None  # bytes/s, bidirectional total per GPU
    pcie_bandwidth: float | None = None  # bytes/s, bidirectional, x16
    ib_bandwidth: float | None = None  # bytes/s, one NIC, one direction
    source: str = ""
    notes: dict[str, str] = field(default_factory=dict, compare=False)

    def flops(self, dtype: object = "bf16") -> float:
        """Peak dense FLOP/s for ``dtype``; raises if this device has no such tensor-core mode."""
        key = canonical_dtype(dtype)
        if key not in self.peak_flops:
            raise ValueError(
                f"hardware {self.name!r} lists no peak FLOP/s for dtype={key!r}; it has {sorted(self.peak_flops)}"
            )
        return self.peak_flops[key]

    def ridge_point(self, dtype: object = "bf16") -> float:
        """CS336 notes "计算强度分析": peak FLOP/s / memory bandwidth, in FLOPs per byte."""
        return ridge_point(self.flops(dtype), self.hbm_bandwidth)

    def link_bandwidth(self, link: str = "nvlink") -> float:
        """One-direction bytes/s of ``link`` (nvlink | pcie | ib), what a ring step can send."""
        if link == "nvlink":
            v = self.nvlink_bandwidth
            return v / 2 if v else _no_link(self, link)
        if link == "pcie":
            v = self.pcie_bandwidth
            return v / 2 if v else _no_link(self, link)
        if link == "ib":
            return self.ib_bandwidth or _no_link(self, link)
        raise ValueError(f"link={link!r}; expected one of nvlink, pcie, ib")


def _no_link(hw: Hardware, link: str) -> float:
    raise ValueError(f"hardware {hw.name!r} has no {link} bandwidth in its table entry")


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """CS336 notes "计算强度分析": the arithmetic intensity (FLOPs/byte) where the roofline bends."""
    return peak_flops / bandwidth


HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column: FP32 19.5 TF, TF32 156 TF,
    # BF16/FP16 312 TF, INT8 624 TOPS (dense); 40 GB HBM2 at 1,555 GB/s; NVLink 600 GB/s;
    # PCIe Gen4 64 GB/s. SRAM: A100 whitepaper, 108 SMs x 192 KB L1/shared (Book of LLMs §4.1 “HBM and SRAM”: ~20 MB).
    # InfiniBand: HDR 200 Gb/s ConnectX-6 (DGX A100).
    "a100-40gb": Hardware(
        name="a100-40gb",
        peak_flops={
            "fp32": 19.5e12,
            "tf32": 156e12,
            "bf16": 312e12,
            "fp16": 312e12,
            "int8": 624e12,
        },
        hbm_bandwidth=1.555e12,
        hbm_bytes=40e9,
        sram_bytes=108 * 192 * KIB,
        nvlink_bandwidth=600e9,
        pcie_bandwidth=64e9,
        ib_bandwidth=200e9 / 8,
        source="NVIDIA A100 datasheet; A100 whitepaper",
    ),
    # Same datasheet, A100 80GB SXM column: 80 GB HBM2e at 2,039 GB/s; compute as the 40 GB part.
    "a100-80gb": Hardware(
        name="a100-80gb",
        peak_flops={
            "fp32": 19.5e12,
            "tf32": 156e12,
            "bf16": 312e12,
            "fp16": 312e12,
            "int8": 624e12,
        },
        hbm_bandwidth=2.039e12,
        hbm_bytes=80e9,
        sram_bytes=108 * 192 * KIB,
        nvlink_bandwidth=600e9,
        pcie_bandwidth=64e9,
        ib_bandwidth=200e9 / 8,
        source="NVIDIA A100 datasheet; A100 whitepaper",
    ),
    # NVIDIA H100 Tensor Core GPU datasheet / H100 whitepaper, SXM5 column, dense:
    # FP32 66.9 TF, TF32 494.7 TF, BF16/FP16 989.4 TF, FP8 1978.9 TF, INT8 1978.9 TOPS;
    # 80 GB HBM3 at 3.35 TB/s (the numbers CS336 notes uses: 9.89e14, 3.35e12, ridge ~295);
    # NVLink 4 900 GB/s; PCIe Gen5 128 GB/s; 132 SMs x 256 KB L1/shared; NDR 400 Gb/s IB.
    "h100-sxm": Hardware(
        name="h100-sxm",
        peak_flops={
            "fp32": 66.9e12,
            "tf32": 494.7e12,
            "bf16": 989.4e12,
            "fp16": 989.4e12,
            "fp8": 1978.9e12,
            "int8": 1978.9e12,
        },
        hbm_bandwidth=3.35e12,
        hbm_bytes=80e9,
        sram_bytes=132 * 256 * KIB,
        nvlink_bandwidth=900e9,
        pcie_bandwidth=128e9,
        ib_bandwidth=400e9 / 8,
        source="NVIDIA H100 datasheet; H100 whitepaper (SXM5)",
    ),
    # Same sources, H100 PCIe column, dense: FP32 51.2 TF, TF32 378 TF, BF16/FP16 756 TF,
    # FP8 1513 TF, INT8 1513 TOPS; 80 GB HBM2e at 2.0 TB/s; NVLink bridge 600 GB/s;
    # PCIe Gen5 128 GB/s; 114 SMs x 256 KB.
    "h100-pcie": Hardware(
        name="h100-pcie",
        peak_flops={
            "fp32": 51.2e12,
            "tf32": 378e12,
            "bf16": 756e12,
            "fp16": 756e12,
            "fp8": 1513e12,
            "int8": 1513e12,
        },
        hbm_bandwidth=2.0e12,
        hbm_bytes=80e9,
        sram_bytes=114 * 256 * KIB,
        nvlink_bandwidth=600e9,
        pcie_bandwidth=128e9,
        ib_bandwidth=400e9 / 8,
        source="NVIDIA H100 datasheet; H100 whitepaper (PCIe)",
    ),
    # NVIDIA H200 datasheet (SXM): the H100 SXM compute (sparse figures halved: BF16 989.5 TF,
    # FP8 1979 TF, TF32 494.5 TF, INT8 1979 TOPS, FP32 67 TF) with 141 GB HBM3e at 4.8 TB/s;
    # NVLink 900 GB/s; PCIe Gen5 128 GB/s; 132 SMs x 256 KB.
    "h200": Hardware(
        name="h200",
        peak_flops={
            "fp32": 67e12,
            "tf32": 494.5e12,
            "bf16": 989.5e12,
            "fp16": 989.5e12,
            "fp8": 1979e12,
            "int8": 1979e12,
        },
        hbm_bandwidth=4.8e12,
        hbm_bytes=141e9,
        sram_bytes=132 * 256 * KIB,
        nvlink_bandwidth=900e9,
        pcie_bandwidth=128e9,
        ib_bandwidth=400e9 / 8,
        source="NVIDIA H200 datasheet (SXM)",
    ),
    # NVIDIA HGX B200 datasheet (8 GPUs, sparse): TF32 18 PF, FP16/BF16 36 PF, FP8 72 PF,
    # INT8 72 POPS, 1,440 GB HBM3e, NVLink 5 1.8 TB/s per GPU -> per GPU dense: TF32 1.125 PF,
    # BF16 2.25 PF, FP8 4.5 PF, INT8 4.5 POPS; 180 GB at 8 TB/s. FP32 80 TF: NVIDIA Blackwell
    # datasheet at 1,000 W. 148 SMs x 256 KB L1/shared (Blackwell tuning guide); PCIe Gen6
    # x16 256 GB/s; ConnectX-7 400 Gb/s (DGX B200).
    "b200": Hardware(
        name="b200",
        peak_flops={
            "fp32": 80e12,
            "tf32": 1.125e15,
            "bf16": 2.25e15,
            "fp16": 2.25e15,
            "fp8": 4.5e15,
            "int8": 4.5e15,
        },
        hbm_bandwidth=8e12,
        hbm_bytes=180e9,
        sram_bytes=148 * 256 * KIB,
        nvlink_bandwidth=1.8e12,
        pcie_bandwidth=256e9,
        ib_bandwidth=400e9 / 8,
        source="NVIDIA HGX B200 datasheet; Blackwell datasheet",
    ),
}

_HW_ALIASES = {
    "a100": "a100-80gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100": "h100-sxm",
    "h100sxm": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h100pcie": "h100-pcie",
    "h200-sxm": "h200",
}


def get_hardware(name: str) -> Hardware:
    """Look up a table entry by name (``h100`` means the SXM part, ``a100`` the 80 GB part)."""
    key = name.lower().replace("_", "-").replace(" ", "-")
    key = _HW_ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}, cpu")
    return HARDWARE[key]


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cpu(
    quick: bool = False, dtypes: tuple[str, ...] = ("fp32", "bf16"), threads: int | None = None
) -> Hardware:
    """Measure this machine: memory bandwidth (a large tensor copy) and matmul FLOP/s per dtype.

    Bandwidth = bytes read + bytes written by ``dst.copy_(src)`` / median time; matmul FLOP/s =
    2·n³ / median time of an (n, n) @ (n, n) product (CS336 notes "张量计算": 2·D·B·K FLOPs).
    ``quick`` uses small sizes (well under a second) for tests; the numbers are then rough.
    """
    import torch  # only to measure: the formulas import without torch

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        n_bytes = (16 if quick else 256) * 2**20
        buffers = [torch.ones(n_bytes // 4, dtype=torch.float32)]
        buffers.append(torch.empty_like(buffers[0]))
        t = _median_time(lambda: buffers[1].copy_(buffers[0]), 3 if quick else 7)
        bandwidth = 2 * n_bytes / t
        buffers.clear()  # free the 2 x n_bytes before the matmul timings
        n = 256 if quick else 1024
        peak: dict[str, float] = {}
        for d in dtypes:
            key = canonical_dtype(d)
            if key not in FLOAT_DTYPES:
                raise ValueError(
                    f"measure_cpu cannot time dtype={d!r}; choose from {sorted(FLOAT_DTYPES)}"
                )
            a = torch.randn(n, n).to(torch_dtype(key))
            b = torch.randn(n, n).to(torch_dtype(key))
            tm = _median_time(lambda: torch.mm(a, b), 3 if quick else 5)  # noqa: B023
            peak[key] = 2 * n**3 / tm
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            mem = 0
        return Hardware(
            name="cpu",
            peak_flops=peak,
            hbm_bandwidth=bandwidth,
            hbm_bytes=float(mem),
            source=f"measured on {platform.machine()} {platform.processor() or ''}".strip()
            + f", {torch.get_num_threads()} threads, n={n}, copy {n_bytes // 2**20} MiB",
        )
    finally:
        torch.set_num_threads(old_threads)
