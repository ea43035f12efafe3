"""GGUF files of the llama architecture, read through the ``gguf`` package.

Tensors are dequantized (F32, F16, BF16, Q8_0, Q4_0, Q4_1, and whatever else ``gguf.quants``
knows) to the requested dtype. llama.cpp's converter permutes the rows of W_Q and W_K so that
its interleaved-pair RoPE reproduces HF's half-split RoPE; ``load_gguf`` undoes that permutation
(rope_layout="half", the default) or keeps it and uses interleaved RoPE (rope_layout="interleaved")
— both give the same logits (seed 000 §1.3: the two layouts differ by a fixed permutation).
The tokenizer metadata and chat template are kept for the tokenizer and inference chapters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.hf import WeightsError, load_state_into

_BLOCK_NAMES = {  # GGUF name inside blk.{i}  ->  lmstack name inside blocks.{i}
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "attn.q_proj.weight",
    "attn_k.weight": "attn.k_proj.weight",
    "attn_v.weight": "attn.v_proj.weight",
    "attn_q.bias": "attn.q_proj.bias",
    "attn_k.bias": "attn.k_proj.bias",
    "attn_v.bias": "attn.v_proj.bias",
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_gate.weight": "ffn.gate_proj.weight",
    "ffn_up.weight": "ffn.up_proj.weight",
    "ffn_down.weight": "ffn.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
              "output.weight": "lm_head.weight"}


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
    from gguf import GGUFReader

    if not path.exists():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad files
        raise WeightsError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_metadata(reader, skip_arrays_over: int | None = None) -> dict[str, Any]:
    """Key -> Python value for every metadata field (token lists included unless skipped)."""
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if skip_arrays_over is not None and len(f.data) > skip_arrays_over:
            continue
        meta[key] = f.contents()
    return meta


def config_from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{source}: unknown architecture general.architecture={arch!r}; supported: 'llama'")

    def need(key: str):
        if key not in meta:
            raise ConfigError(f"{source}: missing metadata {key!r}")
        return meta[key]

    n_heads = int(need("llama.attention.head_count"))
    d_model = int(need("llama.embedding_length"))
    head_dim = int(meta.get("llama.rope.dimension_count", d_model // n_heads))
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        vocab = len(need("tokenizer.ggml.tokens"))
    try:
        return ModelConfig(
            vocab_size=int(vocab),
            d_model=d_model,
            n_layers=int(need("llama.block_count")),
            n_heads=n_heads,
            n_kv_heads=int(meta.get("llama.attention.head_count_kv", n_heads)),
            d_ff=int(need("llama.feed_forward_length")),
            head_dim=head_dim,
            max_seq_len=int(meta.get("llama.context_length", 4096)),
            rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
            norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            name=str(meta.get("general.name", "gguf")),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (pair i, member j) -> (member j, pair i).

    llama.cpp stores row h·H + 2i + j of the HF weight's row h·H + j·H/2 + i, so that rotating
    adjacent pairs equals HF's rotation of (i, i + H/2).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(t, source: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise WeightsError(f"{source}: tensor {t.name!r} has unsupported type {t.tensor_type.name}") from None
    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest-first
    if arr.size != int(np.prod(shape)):
        raise WeightsError(f"{source}: tensor {t.name!r} holds {arr.size} values, expected shape {shape}")
    return arr.reshape(shape)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              rope_layout: str = "half") -> GGUFModel:
    """Read a llama-architecture GGUF file into an lmstack ``Transformer``."""
    from lmstack.model.transformer import Transformer

    path = Path(path)
    reader = _open(path)
    meta = read_metadata(reader)
    config = config_from_gguf(meta, str(path))
    names = {t.name for t in reader.tensors}
    config = config.replace(tie_embeddings="output.weight" not in names, rope_layout=rope_layout,
                            qkv_bias="blk.0.attn_q.bias" in names)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _TOP_NAMES:
            name = _TOP_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _BLOCK_NAMES:
                if t.name.endswith("rope_freqs.weight"):
                    raise WeightsError(f"{path}: rope frequency scaling ({t.name}) is not supported")
                raise WeightsError(f"{path}: unexpected tensor {t.name!r} in a llama GGUF")
            name = f"blocks.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
        arr = _dequantize(t, path)
        w = torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy())
        if rope_layout == "half" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, config.n_heads)
        elif rope_layout == "half" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, config.n_kv_heads)
        state[name] = w
    with torch.device("meta"):
        model = Transformer(config)
    load_state_into(model, state, str(path))
    return GGUFModel(model=model.to(device=device, dtype=dtype), metadata=meta, path=path)
