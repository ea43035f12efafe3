"""Decoding roofline vs CS336 notes "性能指标分析" (the Llama-2-13B table) and prefill/TTFT by hand."""

import pytest

from lmstack.accounting.hardware import Hardware, get_hardware
from lmstack.accounting.roofline import (
    attainable_flops,
    decode_latency,
    decode_point,
    decode_sweep,
    plot_roofline,
    prefill_point,
)
from lmstack.model.config import ModelConfig

# CS336 notes table: S = 1024, bf16, 3.35e12 B/s.
SEED_TABLE = {
    1: (13_015_449_600, 26_869_760_000, 0.0080, 124.6755),
    64: (13_015_449_600, 79_717_990_400, 0.0238, 2689.4807),
    256: (13_015_449_600, 240_779_264_000, 0.0719, 3561.7685),
}


@pytest.mark.parametrize("B", sorted(SEED_TABLE))
def test_llama2_13b_seed_table(B):
    hw = get_hardware("h100")
    assert hw.hbm_bandwidth == 3.35e12
    p = decode_point(ModelConfig.from_preset("llama2-13b"), hw, B, 1024, "bf16")
    params, mem, lat, thr = SEED_TABLE[B]
    assert p.num_params == params
    assert p.memory_bytes == mem
    assert round(p.latency_s, 4) == lat
    assert round(p.throughput_tok_s, 4) == thr
    assert round(p.throughput_tok_s, 2) == {1: 124.68, 64: 2689.48, 256: 3561.77}[B]


def test_trade_off_latency_vs_throughput():
    pts = decode_sweep(
        ModelConfig.from_preset("llama2-13b"), get_hardware("h100"), [1, 2, 8, 32, 128, 512], 1024
    )
    lat = [p.latency_s for p in pts]
    thr = [p.throughput_tok_s for p in pts]
    assert lat == sorted(lat) and thr == sorted(thr)  # both grow with B (CS336 notes: 矛盾)
    assert [p.fits for p in pts] == [True, True, True, True, False, False]  # 80 GB HBM


def test_decode_latency_formula():
    assert decode_latency(2e9, 1e9, 3e12) == 1e-3


def test_decode_compute_bound_when_batch_large():
    # At B far above the ridge point the step's compute time exceeds its memory time.
    cfg = ModelConfig.from_preset("llama3-8b")
    hw = get_hardware("h100")
    assert decode_point(cfg, hw, 1, 128).bound == "memory-bound"
    assert decode_point(cfg, hw, 4096, 128).bound == "compute-bound"


def test_prefill_ttft_hand():
    # B=1, S=1024 Llama-2-13B on H100: FLOPs by hand, compute-bound, TTFT = prefill + 1 step.
    cfg = ModelConfig.from_preset("llama2-13b")
    hw = get_hardware("h100")
    D, F, L, V, S = 5120, 13824, 40, 32000, 1024
    flops = L * (8 * S * D * D + 4 * S * S * D + 6 * S * D * F) + 2 * D * V
    p = prefill_point(cfg, hw, 1, S)
    assert p.flops == flops
    assert p.compute_s == pytest.approx(flops / 989.4e12)
    assert p.bound == "compute-bound"
    assert p.ttft_s == pytest.approx(flops / 989.4e12 + 26_869_760_000 / 3.35e12)


def test_attainable():
    assert attainable_flops(10, 1000, 2) == 20
    assert attainable_flops(1e6, 1000, 2) == 1000


def test_plot_writes_png(tmp_path):
    hw = Hardware(name="toy", peak_flops={"bf16": 1e12}, hbm_bandwidth=1e10, hbm_bytes=1e9)
    out = tmp_path / "r.png"
    plot_roofline(hw, [("decode", 1.0), ("prefill", 500.0)], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
