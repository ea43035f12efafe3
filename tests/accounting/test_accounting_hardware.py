"""Hardware table (Book of LLMs §4.1 “HBM and SRAM”, CS336 notes "计算强度分析") and measure_cpu, and precisions (§5.2)."""

import time

import pytest

from lmstack.accounting.hardware import HARDWARE, get_hardware, measure_cpu
from lmstack.accounting.precision import bytes_per_element


def test_table_entries_complete():
    assert set(HARDWARE) == {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200"}
    for hw in HARDWARE.values():
        for d in ("fp32", "tf32", "bf16", "fp16", "int8"):
            assert hw.flops(d) > 0
        assert hw.hbm_bandwidth > 0 and hw.hbm_bytes > 0 and hw.sram_bytes > 0
        assert hw.nvlink_bandwidth and hw.pcie_bandwidth and hw.ib_bandwidth
        assert hw.source
        # dense throughput roughly doubles per halving of the precision
        assert hw.flops("bf16") == pytest.approx(2 * hw.flops("tf32"), rel=0.05)
    for name in ("h100-sxm", "h100-pcie", "h200", "b200"):
        assert HARDWARE[name].flops("fp8") == pytest.approx(
            2 * HARDWARE[name].flops("bf16"), rel=0.01
        )
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype='fp8'"):
        HARDWARE["a100-80gb"].flops("fp8")


def test_seed_numbers():
    # Book of LLMs §4.1 “HBM and SRAM”: A100 HBM 40 or 80 GB; SRAM about 20 MB
    assert get_hardware("a100-40gb").hbm_bytes == 40e9 and get_hardware("a100").hbm_bytes == 80e9
    assert get_hardware("a100").sram_bytes == pytest.approx(20e6, rel=0.1)
    # CS336 notes: H100 9.89e14 FLOP/s, 3.35e12 B/s
    h = get_hardware("h100")
    assert h.flops("bf16") == pytest.approx(9.89e14, rel=1e-3) and h.hbm_bandwidth == 3.35e12


def test_links_and_lookup():
    h = get_hardware("H100_SXM")
    assert h.link_bandwidth("nvlink") == 450e9 and h.link_bandwidth("ib") == 50e9
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        get_hardware("tpu")


def test_measure_cpu_quick():
    t0 = time.perf_counter()
    hw = measure_cpu(quick=True, threads=1)
    assert time.perf_counter() - t0 < 10
    assert hw.hbm_bandwidth > 1e8  # > 0.1 GB/s on any machine
    assert hw.flops("fp32") > 1e7 and hw.flops("bf16") > 1e6
    assert hw.ridge_point("fp32") > 0


@pytest.mark.parametrize(
    "d,b",
    [
        ("fp32", 4),
        ("float32", 4),
        ("tf32", 4),
        ("bf16", 2),
        ("torch.bfloat16", 2),
        ("fp16", 2),
        ("int8", 1),
        ("fp8", 1),
        ("int4", 0.5),
    ],
)
def test_bytes_per_element(d, b):
    assert bytes_per_element(d) == b


def test_bytes_per_element_torch_and_bad():
    import torch

    assert bytes_per_element(torch.float16) == 2
    with pytest.raises(ValueError, match="dtype='fp64'"):
        bytes_per_element("fp64")
