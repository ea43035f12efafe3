"""HF-format checkpoints (``config.json`` + ``model.safetensors`` or a sharded index) in and out.

This module is the safetensors I/O (header checks, shards, atomic writes) and the model loading and saving;
what differs between HF families — their config fields and tensor names, both ways — is one adapter per
family in ``lmstack.model.families``, chosen by ``model_type``. Only safetensors are read: nothing is ever
unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmstack.model.config import ConfigError, ModelConfig, read_json_object
from lmstack.model.families import FAMILIES, family_for, family_of
from lmstack.model.families.base import LM_BLOCK as _LM_BLOCK
from lmstack.model.families.base import WeightsError
from lmstack.model.families.deepseek import split_yarn
from lmstack.model.families.mamba2 import MAMBA2_MAX_SEQ_LEN
from lmstack.model.families.qwen3_next import (
    gated_deltanet_from_qwen3_next,
    gated_deltanet_to_qwen3_next,
)
from lmstack.model.transformer import Transformer
from lmstack.utils import atomic_path, atomic_write_text

#: HF model_type -> the HF class name, every family lmstack loads and saves
HF_MODEL_TYPES = {t: f.hf_class for t, f in FAMILIES.items()}

__all__ = [
    "HF_MODEL_TYPES",
    "MAMBA2_MAX_SEQ_LEN",
    "WeightsError",
    "check_float_weights",
    "check_layer_count",
    "check_weights_finite",
    "config_from_hf",
    "config_to_hf",
    "from_hf_name",
    "gated_deltanet_from_qwen3_next",
    "gated_deltanet_to_qwen3_next",
    "load_config",
    "load_hf",
    "load_state_into",
    "read_hf_state",
    "save_hf",
    "split_yarn",
    "to_hf_name",
]


# ---- config ---------------------------------------------------------------------------------
def config_from_hf(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate an HF ``config.json`` dict into a ModelConfig, through its family's adapter.

    Every field is type-checked under its HF name: ``hidden_size: null``, ``"64"``, ``64.9``,
    ``rope_scaling: "linear"`` or ``tie_word_embeddings: "false"`` are ConfigErrors naming it.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    family = family_for(d, source)
    try:
        return family.config_from_hf(d, source)
    except ConfigError as e:
        msg = family.name_hf_fields(str(e))
        raise ConfigError(msg if msg.startswith(f"{source}:") else f"{source}: {msg}") from None


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` dict for ``c`` (raises if the family cannot express it)."""
    return family_of(c).config_to_hf(c)


# ---- names ----------------------------------------------------------------------------------
def to_hf_name(name: str, architecture: str = "llama") -> str:
    """HF name of an lmstack parameter (not a stacked expert weight) in an ``architecture`` checkpoint."""
    return FAMILIES[architecture].hf_name(name)


def from_hf_name(name: str, architecture: str = "llama") -> str | None:
    """lmstack name for an HF tensor name; None for tensors lmstack does not use (rotary caches)."""
    return FAMILIES[architecture].lmstack_name(name)


# ---- loading into a model -------------------------------------------------------------------
def check_weights_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights holding NaN or inf (a corrupt file, or one altered on purpose), naming the tensor.

    One vectorised pass per tensor (``isfinite(...).all()``).
    """
    for name, t in state.items():
        if not bool(torch.isfinite(t).all()):
            bad = (~torch.isfinite(t)).nonzero()
            where = tuple(bad[0].tolist())
            raise WeightsError(
                f"{source}: tensor {name!r} has {len(bad)} non-finite value(s), the first "
                f"{t[where].item()} at index {where}; expected finite weights "
                "(pass check_finite=False to load it anyway)"
            )


def check_layer_count(config: ModelConfig, names, source: str) -> None:
    """Refuse a config whose layer count disagrees with the weights before a model is built from it
    (a corrupt count such as 16 million would otherwise take minutes to build, even on the meta device)."""
    blocks = {int(m.group(1)) for n in names if (m := _LM_BLOCK.fullmatch(n))}
    if blocks != set(range(config.n_layers)):
        held = (
            f"blocks 0..{max(blocks)}"
            if blocks == set(range(len(blocks))) and blocks
            else f"{len(blocks)} blocks"
        )
        raise WeightsError(
            f"{source}: the config says n_layers={config.n_layers}, but the weights hold {held}"
        )


def load_state_into(
    model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, check_finite: bool = True
) -> None:
    """Copy ``state`` (lmstack names) into ``model``, checking names, shapes, completeness and (with
    ``check_finite``) that every weight is finite.

    Works on a model built on the meta device too: parameters are replaced by the loaded tensors.
    """
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing:
        raise WeightsError(
            f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    if unexpected:
        raise WeightsError(
            f"{source}: unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    for name, p in params.items():
        t = state[name]
        if tuple(t.shape) != tuple(p.shape):
            raise WeightsError(
                f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
            )
        if not t.is_floating_point():  # e.g. a safetensors header whose F32 was changed to I32
            raise WeightsError(
                f"{source}: tensor {name!r} has dtype {t.dtype}; expected a floating-point dtype"
            )
    if check_finite:
        check_weights_finite(state, source)
    if any(p.is_meta for p in params.values()):
        # adopt the loaded tensors as the parameters: no allocation, no copy
        model.load_state_dict(
            {n: state[n].to(p.dtype) for n, p in params.items()}, strict=False, assign=True
        )
        for module in (
            model.modules()
        ):  # buffers are caches rebuilt on demand (RoPE tables): allocate them empty
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_meta:
                    setattr(module, name, torch.empty_like(buf, device="cpu"))
        return
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(p.dtype))


_ST_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}


def _st_tensor_end(name: str, info: Any) -> int:
    """End offset (in the data section) of one header entry, checking size = dtype x shape."""
    if not isinstance(info, dict):
        raise WeightsError(
            f"header entry {name!r} is {info!r:.80}; expected an object with dtype, shape, "
            "data_offsets"
        )
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ST_DTYPE_BYTES:
        raise WeightsError(
            f"tensor {name!r} has dtype {dtype!r}; expected one of {sorted(_ST_DTYPE_BYTES)}"
        )
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise WeightsError(f"tensor {name!r} has shape {shape!r}; expected a list of sizes >= 0")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise WeightsError(
            f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end], begin <= end"
        )
    need = _ST_DTYPE_BYTES[dtype] * int(np.prod(shape, dtype=object))
    if offsets[1] - offsets[0] != need:
        raise WeightsError(
            f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, but dtype {dtype} x "
            f"shape {shape} needs {need}; is its dtype or shape altered?"
        )
    return offsets[1]


def _check_safetensors_header(path: Path) -> None:
    """Check a safetensors header before the library maps the file: a truncated file is named as
    "truncated at byte N, expected M", and every tensor's byte size is its dtype x shape.
    Raises WeightsError without the path (``_read_safetensors`` adds it)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or 8 + n > size:
            raise WeightsError(
                f"truncated at byte {size}, expected {8 + n if size >= 8 else 8} bytes or more "
                "(the safetensors header)"
            )
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise WeightsError(f"the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"the safetensors header is {type(header).__name__}; expected an object")
    ends = {k: _st_tensor_end(k, v) for k, v in header.items() if k != "__metadata__"}
    last = max(ends, key=lambda k: ends[k], default=None)
    if last is not None and 8 + n + ends[last] > size:
        raise WeightsError(
            f"truncated at byte {size}, expected {8 + n + ends[last]} (the data of tensor {last!r})"
        )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        _check_safetensors_header(path)
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        detail = str(e) if isinstance(e, WeightsError) else f"({e})"
        raise WeightsError(f"{path}: cannot read safetensors file: {detail}") from None


def _shard_path(d: Path, index: Path, shard: Any) -> Path:
    """The file a sharded index names, refused unless it is a plain file name inside the checkpoint folder."""
    if not isinstance(shard, str) or not shard:
        raise WeightsError(f"{index}: shard name {shard!r} must be a non-empty string")
    p = d / shard
    if (
        Path(shard).is_absolute()
        or ".." in Path(shard).parts
        or d.resolve() not in p.resolve().parents
    ):
        raise WeightsError(
            f"{index}: shard {shard!r} is outside the checkpoint folder {d}; refusing to read it"
        )
    return p


def read_hf_state(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory, single-file or sharded, under HF names."""
    d = Path(directory)
    single, index = d / "model.safetensors", d / "model.safetensors.index.json"
    if single.exists():
        return _read_safetensors(single)
    if index.exists():
        try:
            weight_map = read_json_object(index).get("weight_map")
        except ConfigError as e:
            raise WeightsError(f"not a safetensors index: {e}") from None
        if not isinstance(weight_map, dict):
            raise WeightsError(
                f"{index}: weight_map={weight_map!r:.80}; expected an object tensor name -> shard file"
            )
        shards = {shard: _shard_path(d, index, shard) for shard in weight_map.values()}
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(shards):
            state.update(_read_safetensors(shards[shard]))
        absent = sorted(set(weight_map) - set(state))
        if absent:
            raise WeightsError(f"{index}: tensors listed but absent from shards: {absent[:5]}")
        return state
    if any(d.glob("*.bin")):
        raise WeightsError(f"{d}: only pickle (.bin) weights found; lmstack loads safetensors only")
    raise WeightsError(f"{d}: no model.safetensors or model.safetensors.index.json")


def load_config(path: str | os.PathLike) -> ModelConfig:
    """An lmstack config JSON, or an HF ``config.json`` (detected by ``model_type``)."""
    d = read_json_object(path)
    return config_from_hf(d, source=str(path)) if "model_type" in d else ModelConfig.load(path)


def load_hf(
    directory: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    check_finite: bool = True,
):
    """Load an HF checkpoint directory into an lmstack ``Transformer`` (``check_finite``: refuse NaN/inf)."""
    d = Path(directory)
    if not (d / "config.json").exists():
        raise WeightsError(f"{d}: no config.json (is this an HF checkpoint directory?)")
    config = load_config(d / "config.json")
    family = family_of(config)
    state, hf_names = family.state_from_hf(read_hf_state(d), config, str(d))
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the copy too
    check_layer_count(config, state, str(d))
    with torch.device("meta"):
        model = Transformer(config)
    family.check_state(model, state, hf_names, str(d))
    load_state_into(model, state, str(d), check_finite=check_finite)
    return model.to(device=device, dtype=dtype)


def check_float_weights(model) -> None:
    """Refuse to save a model whose linears ``lmstack.quant`` replaced: their int8/int4 weights are
    buffers, not parameters, so a float checkpoint of ``named_parameters()`` would silently lack them.
    A quantised linear is recognised by its ``qweight`` buffer (the model does not import ``lmstack.quant``)."""
    quantised = [
        n for n, m in model.named_modules() if "qweight" in dict(m.named_buffers(recurse=False))
    ]
    if quantised:
        raise ValueError(
            f"model has {len(quantised)} quantised linears (e.g. {quantised[0]!r}, lmstack.quant); "
            "save the float model before quantize_model, and quantise again after loading"
        )


def save_hf(model, directory: str | os.PathLike, max_shard_bytes: int | None = None) -> None:
    """Write ``model`` as an HF checkpoint (config.json + model.safetensors, or shards + index)."""
    check_float_weights(model)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    hf_config = config_to_hf(model.config)
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    state = family_of(model.config).state_to_hf(params, model.config)
    hf_config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    if (
        max_shard_bytes is None
        or sum(t.numel() * t.element_size() for t in state.values()) <= max_shard_bytes
    ):
        with atomic_path(d / "model.safetensors") as tmp:
            save_file(state, str(tmp), metadata={"format": "pt"})
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            with atomic_path(d / fname) as tmp:
                save_file(shard, str(tmp), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        atomic_write_text(
            d / "model.safetensors.index.json",
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
        )
    atomic_write_text(d / "config.json", json.dumps(hf_config, indent=2) + "\n")
