"""Load a model for inference: the weights in the asked format, its tokenizer, checked to belong together.

The one loader behind ``LLM(...)`` and ``lmstack generate`` / ``lmstack chat`` / ``lmstack serve``.
``dtype`` "int8"/"int4" (any of ``quant.model.FORMATS``) means fp32 weights with weight-only quantised linears;
"auto" (``lmstack serve``'s default) keeps a quantised GGUF quantised: Q4_0/Q4_1/Q4_K block linears
become int4 linears (groups of 32, as the file's blocks), Q8_0 ones int8, and the unembedding follows
the file's output (or tied embedding) tensor; any other model loads in fp32 (``native_weight_format``).
"""

from __future__ import annotations

import os

import torch

from lmstack.model.io import NAMED_MODELS, find_named_model, load_model
from lmstack.quant import QUANT_METHODS, quantize_model
from lmstack.tokenizer import load_tokenizer
from lmstack.utils import FLOAT_DTYPES, torch_dtype

QUANT = QUANT_METHODS  # the weight-only formats (quant.model.FORMATS, registered ones too)
AUTO = "auto"  # the file's own format (``native_weight_format``)


def weight_format(dtype: str, quant: str | None = None) -> tuple[torch.dtype, str | None]:
    """``--dtype`` / ``--quant`` -> (floating dtype to load in, quantisation method or None)."""
    if dtype in QUANT:
        if quant not in (None, dtype):
            raise ValueError(f"--dtype {dtype} conflicts with --quant {quant}")
        return torch.float32, dtype
    if dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"dtype={dtype!r}; expected one of {sorted(FLOAT_DTYPES) + list(QUANT)} or a torch dtype"
        )
    return torch_dtype(dtype), quant


def native_weight_format(source) -> tuple[str, str | bool]:
    """(weight format of the block linears, of the unembedding) that keeps a GGUF's quantisation:
    ("int4", "int8") for SmolLM2's Q4_1 file with its Q8_0 tied embedding; ("fp32", False) for a
    float GGUF, a checkpoint directory or anything that is not a file path."""
    from lmstack.model.gguf import read_gguf_header
    from lmstack.quant.gguf_blocks import INT4_TYPES

    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else ""
    if not path.endswith(".gguf") or not os.path.isfile(path):
        return "fp32", False

    def fmt(qtype) -> str:
        name = getattr(qtype, "name", str(qtype))
        return "int4" if name in INT4_TYPES else "int8" if name in ("Q8_0", "Q6_K") else "fp32"

    spans = read_gguf_header(path).spans
    blocks = {
        fmt(s.qtype) for n, s in spans.items() if n.startswith("blocks.") and len(s.shape) > 1
    }
    body = blocks.pop() if len(blocks) == 1 else "int8" if blocks <= {"int4", "int8"} else "fp32"
    head_span = spans.get("lm_head.weight", spans.get("embed.weight"))
    head = fmt(head_span.qtype) if head_span is not None else "fp32"
    return body, (head if body != "fp32" and head != "fp32" else False)


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
    ``tokenizer``: a tokenizer, a file/dir, or None (the model's own when ``model`` is a path).
    ``dtype="auto"``: the format the file is stored in (``native_weight_format``)."""
    auto = dtype == AUTO and quant is None
    head: str | bool = True
    if auto:
        dtype = torch.float32
    elif isinstance(dtype, str):
        dtype, quant = weight_format(dtype, quant)
    source = None
    if isinstance(model, (str, os.PathLike)):
        lm = load_model(model, dtype=dtype, device=device)
        model, source = lm.model, lm.source
    if isinstance(tokenizer, (str, os.PathLike)) or (tokenizer is None and source is not None):
        tokenizer = model_tokenizer(source, tokenizer)
    model = model.eval()
    if auto:
        body, head = native_weight_format(source)
        quant = body if body in QUANT else None
    if quant is not None:  # weight-only int8/int4 linears, in place
        quantize_model(model, quant, lm_head=head)
    if tokenizer is not None:
        check_tokenizer(tokenizer, model)
    return model, tokenizer


MODEL_HELP = "model name (smollm2-135m), .gguf file or checkpoint dir"
TOKENIZER_HELP = "tokenizer file or dir (default: the model's own)"


def add_model_arguments(
    parser,
    *,
    model: str | None = "smollm2-135m",
    model_flag: str | None = "--model",
    model_help: str = MODEL_HELP,
    tokenizer: bool = True,
    tokenizer_help: str = TOKENIZER_HELP,
    dtype: str | None = "fp32",
    dtype_help: str | None = "weights: fp32/bf16/fp16, or int8/int4 weight-only quantised linears",
    auto: bool = False,
) -> None:
    """The flags ``load_for_inference`` resolves, one way for every command that loads a model:
    ``model_flag`` (``model=None``: required), ``--tokenizer`` and ``--dtype`` (``dtype=None``: no such
    flag; ``auto``: "auto" is a choice, the file's own format). Each command passes its own default and
    help text."""
    if model_flag is not None:
        if model is None:
            parser.add_argument(model_flag, required=True, help=model_help)
        else:
            parser.add_argument(model_flag, default=model, help=model_help)
    if dtype is not None:
        choices = [*([AUTO] if auto else []), *sorted(FLOAT_DTYPES), *QUANT]
        parser.add_argument("--dtype", choices=choices, default=dtype, help=dtype_help)
    if tokenizer:
        parser.add_argument("--tokenizer", default=None, help=tokenizer_help)
