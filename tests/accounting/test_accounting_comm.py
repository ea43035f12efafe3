"""Collectives (Book of LLMs §6.2 “collectives”), DDP/ZeRO per-step bytes (§6.4), TP ratio (CS336 notes "张量并行")."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmstack.accounting.comm import (
    all_gather_bytes,
    all_reduce_bytes,
    all_reduce_time,
    data_parallel_step_bytes,
    reduce_scatter_bytes,
    tp_comm_volume,
    tp_compute_comm_ratio,
    tp_compute_flops,
    tp_layer_bytes,
)
from lmstack.model.config import ModelConfig


def _simulate_ring_all_reduce(M: int, chunk: int):
    """Independent reference: run a ring all-reduce on M lists of M chunks and count the
    elements each rank sends (reduce-scatter phase, then all-gather phase)."""
    data = [[[r * 100 + c] * chunk for c in range(M)] for r in range(M)]
    sent = [0] * M
    # reduce-scatter: at step t rank r sends chunk (r - t) % M to rank r+1, which adds it
    for t in range(M - 1):
        msgs = [(r, (r - t) % M, list(data[r][(r - t) % M])) for r in range(M)]
        for r, c, payload in msgs:
            dst = (r + 1) % M
            data[dst][c] = [a + b for a, b in zip(data[dst][c], payload)]
            sent[r] += len(payload)
    rs_sent = list(sent)
    # all-gather: rank r now owns chunk (r + 1) % M; pass owned chunks around the ring
    for t in range(M - 1):
        msgs = [(r, (r + 1 - t) % M, list(data[r][(r + 1 - t) % M])) for r in range(M)]
        for r, c, payload in msgs:
            data[(r + 1) % M][c] = payload
            sent[r] += len(payload)
    expected = [[sum(rr * 100 + c for rr in range(M))] * chunk for c in range(M)]
    assert all(d == expected for d in data)
    return rs_sent, sent


@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
def test_ring_volumes_match_simulation(M):
    chunk = 5
    n = M * chunk  # elements per device
    rs, total = _simulate_ring_all_reduce(M, chunk)
    assert all(x == reduce_scatter_bytes(n, M) for x in rs)
    assert all(x == all_reduce_bytes(n, M) for x in total)
    assert all_reduce_bytes(n, M) == reduce_scatter_bytes(n, M) + all_gather_bytes(n, M)


def test_all_reduce_time_hand():
    # 1 GB over 8 GPUs at 450 GB/s one-way: 2·7/8·1e9 / 450e9 s, + 14 steps of 5 µs.
    assert all_reduce_time(1e9, 8, 450e9, latency_s=5e-6) == pytest.approx(
        1.75e9 / 450e9 + 14 * 5e-6
    )


def test_ddp_and_zero_step_bytes():
    P, M = 7e9, 8
    ddp = data_parallel_step_bytes(P, M, "ddp", "bf16")
    assert ddp == 2 * 7 / 8 * 2 * P
    # §6.4: ZeRO-1/2 = reduce-scatter + all-gather = the same as one all-reduce ("free memory wins")
    assert data_parallel_step_bytes(P, M, "zero1") == data_parallel_step_bytes(P, M, "zero2") == ddp
    # ZeRO-3: params all-gathered for forward and backward plus the gradient reduce-scatter
    assert data_parallel_step_bytes(P, M, "zero3") == pytest.approx(1.5 * ddp)
    with pytest.raises(ValueError, match="strategy='tp'"):
        data_parallel_step_bytes(P, M, "tp")


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 64),
    s=st.integers(1, 8192),
    h=st.integers(64, 16384),
    tp=st.sampled_from([1, 2, 4, 8]),
)
def test_tp_ratio(b, s, h, tp):
    # CS336 notes: (16bsh²/tp) / (4bsh) = 4h/tp, independent of b and s
    assert tp_compute_flops(b, s, h, tp) == pytest.approx(16 * b * s * h * h / tp)
    assert tp_comm_volume(b, s, h) == 4 * b * s * h
    assert tp_compute_comm_ratio(h, tp) == pytest.approx(4 * h / tp)


def test_tp_ratio_worked_numbers():
    # b = 1, s = 2048, h = 4096 (Llama-2-7B width), tp = 8, multiplied out by hand:
    # 16·2048·4096²/8 = 2^4·2^11·2^24/2^3 = 2^36; 4·2048·4096 = 2^2·2^11·2^12 = 2^25; ratio 2^11 = 2048
    assert tp_compute_flops(1, 2048, 4096, 8) == 68_719_476_736
    assert tp_comm_volume(1, 2048, 4096) == 33_554_432
    assert tp_compute_comm_ratio(4096, 8) == 2048


def test_tp_layer_bytes_hand():
    cfg = ModelConfig.from_preset("llama2-13b")
    n = 2 * 1024 * 5120 * 2  # B=2, S=1024, D=5120, bf16
    assert tp_layer_bytes(cfg, 2, 1024, 4) == 4 * 2 * 3 / 4 * n
    assert tp_layer_bytes(cfg, 2, 1024, 4, backward=False) == 2 * 2 * 3 / 4 * n
