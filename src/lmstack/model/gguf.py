"""GGUF files of the llama architecture.

The header is parsed by :func:`lmstack.tokenizer.gguf_io.read_gguf_layout`, which trusts no count or
length ("truncated at byte N, expected M"); before any weight is read, every tensor's type, size
(type x shape), alignment and place in the file is checked (``read_gguf_header``), and after
dequantization the weights must be finite (``check_finite``). The ``gguf`` package supplies the
type sizes and the dequantizers.

Tensors are dequantized (F32, F16, BF16, Q8_0, Q4_0, Q4_1, and whatever else ``gguf.quants`` knows)
to the requested dtype. llama.cpp's converter permutes the rows of W_Q and W_K so that
its interleaved-pair RoPE reproduces HF's half-split RoPE; ``load_gguf`` undoes that permutation
(rope_layout="half", the default) or keeps it and uses interleaved RoPE (rope_layout="interleaved")
— both give the same logits (Book of LLMs §1.3 “implementation details in PyTorch”: the two layouts differ by a fixed permutation).
The tokenizer metadata and chat template are kept for the tokenizer and inference chapters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmstack.model.config import MAX_SEQ_LEN, MAX_SIZE, ConfigError, ModelConfig
from lmstack.model.families.base import LLAMA_BLOCK, LLAMA_TOP
from lmstack.model.hf import WeightsError, check_layer_count, load_state_into
from lmstack.model.transformer import Transformer
from lmstack.tokenizer.gguf_io import GGUFFormatError, read_gguf_layout
from lmstack.utils import check_float, check_int

#: HF name -> GGUF name (llama.cpp's tensor names); lmstack's names come from the Llama family's table
#: (``model.families.base``), so GGUF, HF and lmstack names are one table
_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{w}": f"attn_{p}.{w}" for p in "qkv" for w in ("weight", "bias")},
    "self_attn.o_proj.weight": "attn_output.weight",
    **{f"mlp.{w}_proj.weight": f"ffn_{w}.weight" for w in ("gate", "up", "down")},
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# GGUF name inside blk.{i} -> lmstack name inside blocks.{i}; top-level GGUF name -> lmstack name
_BLOCK_NAMES = {_HF_TO_GGUF[hf]: lm for lm, hf in LLAMA_BLOCK.items()}
_TOP_NAMES = {_HF_TO_GGUF[hf]: lm for lm, hf in LLAMA_TOP.items()}


@dataclass
class GGUFModel:
    """A model loaded from GGUF with the file's metadata (tokenizer fields, chat template, ...)."""

    model: Any
    metadata: dict[str, Any] = field(repr=False)
    path: Path

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")


def _open(path: Path):
    """The file's header (metadata and tensor table), parsed without trusting any count or length."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return read_gguf_layout(path)
    except GGUFFormatError as e:
        raise WeightsError(str(e)) from None


def _meta_int(
    meta: dict[str, Any], key: str, source: str, default: int | None = None, maximum: int = MAX_SIZE
) -> int:
    if key not in meta and default is None:
        raise ConfigError(f"{source}: missing metadata {key!r}")
    return check_int(key, meta.get(key, default), ConfigError, 1, maximum)


def config_from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(
            f"{source}: unknown architecture general.architecture={arch!r}; supported: 'llama'"
        )
    try:
        n_heads = _meta_int(meta, "llama.attention.head_count", source)
        d_model = _meta_int(meta, "llama.embedding_length", source)
        vocab = meta.get("llama.vocab_size")
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if not isinstance(tokens, list):
                raise ConfigError(
                    f"{source}: missing metadata 'llama.vocab_size' (and no tokenizer.ggml.tokens list)"
                )
            vocab = len(tokens)
        return ModelConfig(
            vocab_size=check_int("llama.vocab_size", vocab, ConfigError, 1, MAX_SIZE),
            d_model=d_model,
            n_layers=_meta_int(meta, "llama.block_count", source),
            n_heads=n_heads,
            n_kv_heads=_meta_int(meta, "llama.attention.head_count_kv", source, n_heads),
            d_ff=_meta_int(meta, "llama.feed_forward_length", source),
            head_dim=_meta_int(
                meta, "llama.rope.dimension_count", source, max(d_model // n_heads, 1)
            ),
            max_seq_len=_meta_int(meta, "llama.context_length", source, 4096, MAX_SEQ_LEN),
            rope_theta=check_float(
                "llama.rope.freq_base", meta.get("llama.rope.freq_base", 10000.0), ConfigError
            ),
            norm_eps=check_float(
                "llama.attention.layer_norm_rms_epsilon",
                meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
                ConfigError,
            ),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            name=str(meta.get("general.name", "gguf")),
        )
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(f"{source}:") else f"{source}: {msg}") from None


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (pair i, member j) -> (member j, pair i).

    llama.cpp stores row h·H + 2i + j of the HF weight's row h·H + j·H/2 + i, so that rotating
    adjacent pairs equals HF's rotation of (i, i + H/2).
    """
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


@dataclass(frozen=True)
class _TensorSpan:
    """A tensor-table entry checked against the file: its type, shape (slowest-first) and byte range."""

    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    start: int
    end: int


_INTEGER_TYPES = ("I8", "I16", "I32", "I64")


def _span(info, layout, source: Path) -> _TensorSpan:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise WeightsError(
            f"{source}: tensor {info.name!r} has unknown ggml type {info.ggml_type}"
        ) from None
    if qtype.name in _INTEGER_TYPES:
        raise WeightsError(
            f"{source}: tensor {info.name!r} has integer type {qtype.name}; expected a float or "
            "quantized type"
        )
    block, type_size = GGML_QUANT_SIZES[qtype]
    if min(info.dims) < 1 or info.dims[0] % block:
        raise WeightsError(
            f"{source}: tensor {info.name!r} has dims {list(info.dims)}; expected positive sizes "
            f"with the first a multiple of {qtype.name}'s block of {block}"
        )
    if info.offset % layout.alignment:
        raise WeightsError(
            f"{source}: tensor {info.name!r} starts at data offset {info.offset}, which is not a "
            f"multiple of the alignment {layout.alignment}"
        )
    start = layout.data_offset + info.offset
    end = start + int(np.prod(info.dims, dtype=object)) // block * type_size
    if end > layout.file_size:
        altered = "; or its offset is altered" if start >= layout.file_size else ""
        raise WeightsError(
            f"{source}: truncated at byte {layout.file_size}, expected {end} "
            f"(tensor {info.name!r}, {qtype.name}, dims {list(info.dims)}, from byte {start}{altered})"
        )
    return _TensorSpan(info.name, qtype, tuple(reversed(info.dims)), start, end)


def _tensor_spans(layout, data: np.ndarray, source: Path) -> list[_TensorSpan]:
    """Every tensor's byte range, checked: types known, sizes = type x shape, aligned, inside the file, and
    tiling the data section in order with zero padding between them, as GGUF writers lay it out (a gap, an
    overlap or non-zero padding means a type, shape or offset was altered)."""
    spans = [_span(info, layout, source) for info in layout.tensors]
    expected, previous = layout.data_offset, None
    for s in sorted(spans, key=lambda s: s.start):
        if s.start != expected:
            after = (
                f"the previous tensor {previous.name!r} ends at byte {previous.end}"
                if previous
                else "the data section starts there"
            )
            raise WeightsError(
                f"{source}: tensor {s.name!r} starts at byte {s.start}, expected {expected} ({after}; "
                "is a tensor's type, shape or offset altered?)"
            )
        _check_padding(data, previous, s.start, source)
        expected, previous = -(-s.end // layout.alignment) * layout.alignment, s
    if previous is not None:
        if layout.file_size > expected:
            raise WeightsError(
                f"{source}: {layout.file_size - previous.end} bytes follow the last tensor "
                f"{previous.name!r} (ends at byte {previous.end}); is a tensor's type or shape altered?"
            )
        _check_padding(data, previous, layout.file_size, source)
    return spans


def _check_padding(data: np.ndarray, previous: _TensorSpan | None, stop: int, source: Path) -> None:
    if previous is not None and data[previous.end : stop].any():
        raise WeightsError(
            f"{source}: the padding after tensor {previous.name!r} (bytes {previous.end}..{stop}) is "
            "not zero; is its type or shape altered?"
        )


def _dequantize(data: np.ndarray, s: _TensorSpan, source: Path) -> np.ndarray:
    from gguf.quants import dequantize

    raw = data[s.start : s.end].reshape(*s.shape[:-1], -1)  # (..., bytes per row)
    try:
        arr = dequantize(raw, s.qtype)
    except NotImplementedError:
        raise WeightsError(
            f"{source}: tensor {s.name!r} has unsupported type {s.qtype.name}"
        ) from None
    return arr.reshape(s.shape)


def _lmstack_name(gguf_name: str, source: Path) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _BLOCK_NAMES:
        if gguf_name.endswith("rope_freqs.weight"):
            raise WeightsError(f"{source}: rope frequency scaling ({gguf_name}) is not supported")
        raise WeightsError(f"{source}: unexpected tensor {gguf_name!r} in a llama GGUF")
    return f"blocks.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"


@dataclass
class GGUFHeader:
    """A GGUF file's header, checked: metadata, the ModelConfig it describes, and each tensor's checked span
    under its lmstack name. Everything ``load_gguf`` refuses before reading a weight is refused here."""

    metadata: dict[str, Any]
    config: ModelConfig
    spans: dict[str, _TensorSpan]
    data: np.ndarray  # the file, memory-mapped as bytes


def read_gguf_header(path: str | os.PathLike, rope_layout: str = "half") -> GGUFHeader:
    path = Path(path)
    layout = _open(path)
    meta = {k: v for k, v in layout.metadata.items() if not k.startswith("GGUF.")}
    config = config_from_gguf(meta, str(path))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    spans = {_lmstack_name(s.name, path): s for s in _tensor_spans(layout, data, path)}
    config = config.replace(
        tie_embeddings="lm_head.weight" not in spans,
        rope_layout=rope_layout,
        qkv_bias="blocks.0.attn.q_proj.bias" in spans,
    )
    check_layer_count(config, spans, str(path))
    return GGUFHeader(meta, config, spans, data)


def load_gguf(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    rope_layout: str = "half",
    check_finite: bool = True,
) -> GGUFModel:
    """Read a llama-architecture GGUF file into an lmstack ``Transformer``.

    The header is checked before any tensor is read (``read_gguf_header``) and, unless ``check_finite``
    is False, every weight is checked for NaN/inf; failures are ``WeightsError``/``ConfigError`` naming the
    tensor or metadata key.
    """
    path = Path(path)
    header = read_gguf_header(path, rope_layout)
    config = header.config
    state: dict[str, torch.Tensor] = {}
    for name, s in header.spans.items():
        arr = _dequantize(header.data, s, path)
        w = torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy())
        heads = (
            config.n_heads if ".q_proj." in name else config.n_kv_heads if ".k_proj." in name else 0
        )
        if (
            rope_layout == "half" and heads and w.shape[0] % (2 * heads) == 0
        ):  # else the shape check refuses it
            w = unpermute_rope_rows(w, heads)
        state[name] = w
    with torch.device("meta"):
        model = Transformer(config)
    load_state_into(model, state, str(path), check_finite=check_finite)
    return GGUFModel(
        model=model.to(device=device, dtype=dtype), metadata=header.metadata, path=path
    )
