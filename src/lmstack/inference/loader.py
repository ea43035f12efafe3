"""Load a model for inference: the weights in the asked format, its tokenizer, checked to belong together.

The one loader behind ``LLM(...)`` and ``lmstack generate`` / ``lmstack chat``. ``dtype`` "int8"/"int4"
means fp32 weights with weight-only quantised linears (:mod:`lmstack.quant`).
"""

from __future__ import annotations

import os

import torch

from lmstack.model.io import NAMED_MODELS, find_named_model, load_model
from lmstack.quant import quantize_model
from lmstack.tokenizer import load_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANT = ("int8", "int4")


def weight_format(dtype: str, quant: str | None = None) -> tuple[torch.dtype, str | None]:
    """``--dtype`` / ``--quant`` -> (floating dtype to load in, quantisation method or None)."""
    if dtype in QUANT:
        if quant not in (None, dtype):
            raise ValueError(f"--dtype {dtype} conflicts with --quant {quant}")
        return torch.float32, dtype
    if dtype not in DTYPES:
        raise ValueError(
            f"dtype={dtype!r}; expected one of {sorted(DTYPES) + list(QUANT)} or a torch dtype"
        )
    return DTYPES[dtype], quant


def model_tokenizer(model_source, tokenizer_path=None):
    """The tokenizer of a model: its GGUF, or a tokenizer file/dir (tokenizer.json, vocab+merges); a model
    name (``smollm2-135m``) resolves to its file as ``load_model`` resolves it."""
    path = tokenizer_path or model_source
    if tokenizer_path is None and not os.path.exists(path) and str(path).lower() in NAMED_MODELS:
        path = find_named_model(str(path))
    try:
        return load_tokenizer(path)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{path}: no tokenizer found ({e}); pass --tokenizer FILE") from None


def check_tokenizer(tokenizer, model) -> None:
    """A tokenizer with ids the model has no embedding for does not belong to it."""
    n, V = getattr(tokenizer, "vocab_size", None), model.config.vocab_size
    if n is not None and n > V:
        raise ValueError(
            f"the tokenizer has {n} tokens but the model's vocabulary has {V}: they do not belong "
            "together (--tokenizer: pass the model's own)"
        )


def load_for_inference(
    model="smollm2-135m",
    tokenizer=None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    quant: str | None = None,
):
    """-> (model in eval mode, tokenizer). ``model``: a name, .gguf file, checkpoint dir or a Transformer;
    ``tokenizer``: a tokenizer, a file/dir, or None (the model's own when ``model`` is a path)."""
    if isinstance(dtype, str):
        dtype, quant = weight_format(dtype, quant)
    source = None
    if isinstance(model, (str, os.PathLike)):
        lm = load_model(model, dtype=dtype, device=device)
        model, source = lm.model, lm.source
    if isinstance(tokenizer, (str, os.PathLike)) or (tokenizer is None and source is not None):
        tokenizer = model_tokenizer(source, tokenizer)
    model = model.eval()
    if quant is not None:  # weight-only int8/int4 linears, in place
        quantize_model(model, quant)
    if tokenizer is not None:
        check_tokenizer(tokenizer, model)
    return model, tokenizer
