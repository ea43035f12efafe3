"""fp8 / MX / NF4 against hand-worked blocks and independent constructions; NF4 against bitsandbytes."""

import importlib.util

import pytest
import torch

from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.quant.formats import (
    NF4_VALUES,
    SimQuantLinear,
    fp4_e2m1_decode,
    fp4_e2m1_encode,
    fp8_dequantize,
    fp8_quantize,
    mx_dequantize,
    mx_quantize,
    nf4_dequantize,
    nf4_quantize,
    simulate_model,
)


def test_fp8_per_tensor_and_per_channel_hand_worked():
    W = torch.tensor([[448.0, 1.0, -3.0, 0.0], [0.5, -0.25, 0.125, 0.0625]])
    codes, s = fp8_quantize(W, "e4m3", "tensor")
    assert float(s) == 1.0 and codes.dtype == torch.float8_e4m3fn  # amax 448 = e4m3's max
    assert torch.equal(fp8_dequantize(codes, s), W)  # all exactly representable
    codes, s = fp8_quantize(W, "e4m3", "channel")
    assert s.flatten().tolist() == pytest.approx([1.0, 0.5 / 448], rel=1e-7)
    torch.testing.assert_close(fp8_dequantize(codes, s), W)  # row 2 / s = 448, 224, 112, 56: exact
    # e5m2 has 2 mantissa bits: 1.1 -> 1.0 (steps of 0.25 in [1, 2)), 1.2 -> 1.25; max 57344
    codes, s = fp8_quantize(torch.tensor([[57344.0, 1.1 * 57344 / 57344, 1.2]]), "e5m2", "tensor")
    assert float(s) == 1.0 and fp8_dequantize(codes, s).tolist() == [[57344.0, 1.0, 1.25]]
    with pytest.raises(ValueError, match="e3m4"):
        fp8_quantize(W, "e3m4")


def test_fp4_e2m1_rounding_hand_worked():
    v = torch.tensor([0.1, 0.25, -0.7, 0.75, 1.25, 2.5, 3.5, 5.0, 6.5, -100.0])
    # nearest; ties to the even code: 0.25 -> 0 (code 0), 0.75 -> 1.0 (code 2), 1.25 -> 1.0 (code 2),
    # 2.5 -> 2 (code 4), 3.5 -> 4 (code 6), 5 -> 4 (code 6, between 4 and 6), saturate at ±6
    assert fp4_e2m1_decode(fp4_e2m1_encode(v)).tolist() == [
        0.0,
        0.0,
        -0.5,
        1.0,
        1.0,
        2.0,
        4.0,
        4.0,
        6.0,
        -6.0,
    ]
    assert fp4_e2m1_encode(torch.tensor([-6.0, 0.5])).tolist() == [0b1111, 0b0001]


def test_mxfp4_block_hand_worked():
    block = torch.zeros(2, 32)
    block[0, :4] = torch.tensor(
        [0.1, -0.7, 3.0, 6.5]
    )  # amax 6.5: floor(log2 6.5) = 2, e = 2 − 2 = 0, X = 1
    block[1, :3] = torch.tensor([100.0, -20.0, 1.0])  # amax 100: floor(log2 100) = 6, e = 4, X = 16
    elems, scales = mx_quantize(block.reshape(1, 64), "mxfp4")
    assert scales.tolist() == [[127, 131]]  # E8M0 = e + 127
    out = mx_dequantize(elems, scales).reshape(2, 32)
    assert out[0, :4].tolist() == [0.0, -0.5, 3.0, 6.0]  # 6.5 saturates to 6
    assert out[1, :3].tolist() == [96.0, -16.0, 0.0]  # 100/16 = 6.25 -> 6; −1.25 -> −1; 1/16 -> 0
    assert (out[:, 4:] == 0).all() and (out[1, 3:] == 0).all()


def test_mxfp8_block_hand_worked():
    block = torch.zeros(1, 32)
    block[0, :3] = torch.tensor([100.0, 0.3, -7.0])  # e = 6 − 8 = −2, X = 1/4: 400, 1.2, −28
    elems, scales = mx_quantize(block, "mxfp8")
    assert scales.tolist() == [[125]]
    out = mx_dequantize(elems, scales)
    # e4m3: 400 lies between 384 (1.100b·2^8) and 416 (1.101b·2^8): tie -> even mantissa 384 -> 96;
    # 1.2 -> 1.25 (steps of 1/8 in [1, 2)) -> 0.3125; −28 exact -> −7
    assert out[0, :3].tolist() == [96.0, 0.3125, -7.0]
    with pytest.raises(ValueError, match="multiple of the MX block size 32"):
        mx_quantize(torch.zeros(2, 48), "mxfp4")


def test_nf4_code_book_is_normal_quantiles():
    """QLoRA's construction: 8 positive quantiles of N(0,1) from offset 0.9677083 down to 1/2, 7 negative
    ones, and an exact 0, each side scaled so the extremes are ±1."""
    off = 0.9677083
    pos = torch.special.ndtri(torch.linspace(off, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(off, 0.5, 8, dtype=torch.float64)[:-1])
    v = torch.sort(torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg])).values
    torch.testing.assert_close(NF4_VALUES.double(), v / v.max(), atol=1e-6, rtol=0)


def test_nf4_block_hand_worked():
    x = torch.zeros(64)
    x[:4] = torch.tensor([2.0, -1.0, 0.5, 0.1])  # absmax 2: 1, −0.5, 0.25, 0.05
    codes, absmax = nf4_quantize(x)
    assert absmax.tolist() == [2.0]
    assert codes[0, :4].tolist() == [15, 2, 10, 8]  # 1.0; −0.5251; 0.2461; 0.0796 (nearer than 0)
    assert codes[0, 4:].tolist() == [7] * 60
    torch.testing.assert_close(
        nf4_dequantize(codes, absmax)[:4],
        2 * torch.tensor([1.0, -0.5250730514526367, 0.24611230194568634, 0.07958029955625534]),
    )


def _bnb_nf4():
    if importlib.util.find_spec("bitsandbytes") is None:
        return False
    try:
        import bitsandbytes.functional as bf

        bf.quantize_4bit(torch.randn(64, 64), blocksize=64, quant_type="nf4")
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _bnb_nf4(), reason="bitsandbytes' CPU quantize_4bit does not run here")
def test_nf4_equals_bitsandbytes():
    import bitsandbytes.functional as bf

    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    packed, state = bf.quantize_4bit(W, blocksize=64, quant_type="nf4")
    ref = bf.dequantize_4bit(packed, state).float()
    codes, absmax = nf4_quantize(W)
    torch.testing.assert_close(absmax, state.absmax.float())
    ours = nf4_dequantize(codes, absmax, W.shape)
    assert (ours != ref).float().mean() < 1e-3  # a value on a midpoint may round either way
    torch.testing.assert_close(ours, ref, atol=0.2, rtol=0)


@pytest.mark.parametrize(
    "fmt,max_rel",
    [
        ("fp8-e4m3", 0.05),
        ("fp8-e5m2", 0.1),
        ("fp8-e4m3-w8a8", 0.06),
        ("mxfp8", 0.05),
        ("mxfp4", 0.25),
        ("nf4", 0.2),
    ],
)
def test_sim_linear_and_model(fmt, max_rel):
    W = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    lin = SimQuantLinear(W, fmt)
    err = (lin(x) - x @ W.t()).norm() / (x @ W.t()).norm()
    assert 0 < err < max_rel
    cfg = ModelConfig(
        vocab_size=128, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32
    )
    model = Transformer(cfg, seed=0).eval()
    tokens = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        out = simulate_model(model, fmt)(tokens)
    assert torch.nn.functional.cosine_similarity(out[0], ref[0], -1).min() > 0.9
    with pytest.raises(ValueError, match="fp6"):
        simulate_model(model, "fp6")
