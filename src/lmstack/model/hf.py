"""HF-format checkpoints (``config.json`` + ``model.safetensors`` or a sharded index) in and out.

Supports the Llama, Mistral and Qwen2 families; the MoE / MLA families (Mixtral, OLMoE, Qwen2/3-MoE, DeepSeek-V2/V3)
and the recurrent / hybrid / interleaved ones (Mamba2, Gemma-2, Gemma-3 text, Qwen3-Next) have their own sections
at the end of this file. Names map both ways through one table per family; HF
stores q/k rows in the "half" RoPE layout, which is lmstack's default, so weights copy as-is.
Only safetensors are read: nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmstack.model.config import MAX_SEQ_LEN, MAX_SIZE, ConfigError, ModelConfig, read_json_object
from lmstack.model.transformer import Transformer
from lmstack.utils import atomic_path, atomic_write_text, check_bool, check_float, check_int

HF_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# mixture-of-experts / MLA families (model/moe.py, model/mla.py); their config and names: end of this file
MOE_MODEL_TYPES = {
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
HF_MODEL_TYPES.update(MOE_MODEL_TYPES)
# recurrent / hybrid / interleaved local-global families (model/variants.py, mamba2.py, deltanet.py): end of this file
HYBRID_MODEL_TYPES = {
    "mamba2": "Mamba2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
HF_MODEL_TYPES.update(HYBRID_MODEL_TYPES)


class WeightsError(ValueError):
    """A weights file that is missing, truncated, corrupted or does not fit the model."""


# ---- config ---------------------------------------------------------------------------------
def _dict_or_none(d: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    v = d.get(key)
    if v is not None and not isinstance(v, dict):
        raise ConfigError(
            f"{source}: {key}={v!r} must be an object (or null), got {type(v).__name__}"
        )
    return v or {}


def _rope_theta(d: dict[str, Any], source: str) -> float:
    params = _dict_or_none(d, "rope_parameters", source)
    scaling = _dict_or_none(d, "rope_scaling", source) or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in ("default", None):
        raise ConfigError(
            f"{source}: rope scaling type {rope_type!r} is not supported (only plain RoPE)"
        )
    key = "rope_parameters.rope_theta" if "rope_theta" in params else "rope_theta"
    return check_float(key, params.get("rope_theta", d.get("rope_theta", 10000.0)), ConfigError)


def _first_id(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if isinstance(v, list):
        v = v[0] if v else None
    return None if v is None else check_int(key, v, ConfigError, minimum=0)


def _flag(d: dict[str, Any], key: str) -> bool:
    """An HF boolean field; absent or null is False."""
    v = d.get(key)
    return False if v is None else check_bool(key, v, ConfigError)


def _int(d: dict[str, Any], key: str, default: int | None = None, maximum: int = MAX_SIZE) -> int:
    """A positive HF integer field; absent (or null, for fields with a default) is ``default``."""
    if key not in d and default is None:
        raise ConfigError(f"missing required field {key!r}")
    v = d.get(key)
    return check_int(
        key, default if v is None and default is not None else v, ConfigError, 1, maximum
    )


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate an HF ``config.json`` dict of a Llama / Mistral / Qwen2 model into a ModelConfig.

    Every field is type-checked under its HF name: ``hidden_size: null``, ``"64"``, ``64.9``,
    ``rope_scaling: "linear"`` or ``tie_word_embeddings: "false"`` are ConfigErrors naming it.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type")
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        raise ConfigError(
            f"{source}: unknown architecture model_type={model_type!r}; supported: {sorted(HF_MODEL_TYPES)}"
        )
    if model_type in HYBRID_MODEL_TYPES:
        return hybrid_config_from_hf(d, model_type, source)
    yarn = None
    if model_type in (
        "deepseek_v2",
        "deepseek_v3",
    ):  # MLA models may carry YaRN RoPE scaling (model/mla.py)
        d, yarn = split_yarn(d, source)
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act={act!r}; lmstack's SwiGLU needs 'silu'")
    try:
        if _flag(d, "mlp_bias"):
            raise ConfigError("mlp_bias=True is not supported")
        if model_type == "llama" and _flag(d, "attention_bias"):
            raise ConfigError("attention_bias=True (a bias on o_proj too) is not supported")
        window = None
        if model_type in ("mistral", "mixtral") and d.get("sliding_window") is not None:
            window = check_int("sliding_window", d["sliding_window"], ConfigError, minimum=1)
        layer_types, local_window = None, None
        if model_type == "qwen2" and _flag(d, "use_sliding_window"):
            layer_types, local_window = _qwen2_local_global(d)
        elif model_type in ("qwen2", "qwen2_moe", "qwen3_moe") and _flag(d, "use_sliding_window"):
            raise ConfigError("Qwen2 use_sliding_window=True (per-layer windows) is not supported")
        n_heads = _int(d, "num_attention_heads")
        head_dim = d.get("head_dim")
        name = d.get("_name_or_path") or model_type
        kw = dict(
            vocab_size=_int(d, "vocab_size"),
            d_model=_int(d, "hidden_size"),
            n_layers=_int(d, "num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=_int(d, "num_key_value_heads", n_heads),
            d_ff=_int(d, "intermediate_size"),
            head_dim=None if head_dim is None else _int(d, "head_dim"),
            max_seq_len=_int(d, "max_position_embeddings", 4096, MAX_SEQ_LEN),
            rope_theta=_rope_theta(d, source),
            norm_eps=check_float("rms_norm_eps", d.get("rms_norm_eps", 1e-6), ConfigError),
            tie_embeddings=_flag(d, "tie_word_embeddings"),
            qkv_bias=model_type == "qwen2",
            sliding_window=window,
            layer_types=layer_types,
            local_window=local_window,
            architecture=model_type,
            bos_token_id=_first_id(d, "bos_token_id"),
            eos_token_id=_first_id(d, "eos_token_id"),
            name=name if isinstance(name, str) else model_type,
        )
        if model_type in MOE_MODEL_TYPES:
            kw.update(moe_config_from_hf(d, model_type))
            if yarn is not None:
                kw["rope_yarn"] = yarn
        return ModelConfig(**kw)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(f"{source}:") else f"{source}: {msg}") from None


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` dict for ``c`` (raises if the family cannot express it)."""
    if c.architecture in MOE_MODEL_TYPES:
        return moe_config_to_hf(c)
    if c.architecture in HYBRID_MODEL_TYPES:
        return hybrid_config_to_hf(c)
    variant = [f for f, v in _VARIANT_DEFAULTS.items() if getattr(c, f) != v]
    if variant:
        raise ConfigError(
            f"{variant} set on architecture={c.architecture!r}, whose HF family has no such option; "
            f"these belong to {sorted(HYBRID_MODEL_TYPES)}"
        )
    if c.qk_norm or c.parallel_block:
        raise ConfigError(
            "qk_norm / parallel_block models have no Llama/Mistral/Qwen2 HF equivalent"
        )
    if c.rope_layout != "half":
        raise ConfigError("HF checkpoints use rope_layout='half'; convert the model first")
    arch = c.architecture
    if c.sliding_window is not None and arch != "mistral":
        raise ConfigError(
            f"sliding_window={c.sliding_window} needs architecture='mistral', got {arch!r}"
        )
    if c.layer_types is not None and (arch != "qwen2" or set(c.layer_types) - set(_HF_LAYER_TYPES)):
        raise ConfigError(
            f"layer_types={c.layer_types} has no {arch!r} HF equivalent (only qwen2 with "
            f"{sorted(_HF_LAYER_TYPES)} layers, i.e. interleaved local/global attention)"
        )
    if c.qkv_bias != (arch == "qwen2"):
        raise ConfigError(
            f"qkv_bias={c.qkv_bias} does not fit architecture={arch!r} (only qwen2 has q/k/v bias)"
        )
    d: dict[str, Any] = {
        "architectures": [HF_MODEL_TYPES[arch]],
        "model_type": arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        d.update(attention_bias=False, mlp_bias=False)
    elif arch == "mistral":
        d["sliding_window"] = c.sliding_window
    elif c.layer_types is not None:  # interleaved local/global windows (HF layer_types)
        d.update(
            use_sliding_window=True,
            sliding_window=c.local_window,
            max_window_layers=c.n_layers,
            layer_types=[_HF_LAYER_TYPES[t] for t in c.layer_types],
        )
    else:
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layers)
    return d


# Qwen2's per-layer attention kinds <-> lmstack mixers (model.mixers): interleaved local/global models.
_HF_LAYER_TYPES = {"attention": "full_attention", "local_attention": "sliding_attention"}


def _qwen2_local_global(d: dict[str, Any]) -> tuple[list[str], int]:
    """Qwen2 with ``use_sliding_window``: per-layer windows from ``layer_types`` (or, in older configs,
    sliding from layer ``max_window_layers`` on) -> (lmstack layer_types, local_window)."""
    n = _int(d, "num_hidden_layers")
    window = check_int("sliding_window", d.get("sliding_window"), ConfigError, minimum=1)
    kinds = d.get("layer_types")
    if kinds is None:
        first = check_int(
            "max_window_layers", d.get("max_window_layers", 28), ConfigError, minimum=0
        )
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ConfigError(
            f"layer_types={kinds!r:.80} must list one attention kind for each of the {n} layers"
        )
    back = {v: k for k, v in _HF_LAYER_TYPES.items()}
    for i, t in enumerate(kinds):
        if t not in back:
            raise ConfigError(f"layer_types[{i}]={t!r} (layer {i}); expected one of {sorted(back)}")
    return [back[t] for t in kinds], window


# ---- names ----------------------------------------------------------------------------------
_BLOCK_NAMES = {  # lmstack name inside blocks.{i}  ->  HF name inside model.layers.{i}
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.q_proj.bias": "self_attn.q_proj.bias",
    "attn.k_proj.bias": "self_attn.k_proj.bias",
    "attn.v_proj.bias": "self_attn.v_proj.bias",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "ffn.gate_proj.weight": "mlp.gate_proj.weight",
    "ffn.up_proj.weight": "mlp.up_proj.weight",
    "ffn.down_proj.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_BLOCK_NAMES = {v: k for k, v in _BLOCK_NAMES.items()}
_HF_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}
_LM_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_hf_name(name: str, architecture: str = "llama") -> str:
    if architecture in MOE_MODEL_TYPES:
        return moe_to_hf_name(name, architecture)
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LM_BLOCK.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise KeyError(f"lmstack parameter {name!r} has no HF name")


def from_hf_name(name: str) -> str | None:
    """lmstack name for an HF tensor name; None for tensors lmstack does not use (rotary caches)."""
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    m = _HF_BLOCK.fullmatch(name)
    if m and m.group(2) in _HF_BLOCK_NAMES:
        return f"blocks.{m.group(1)}.{_HF_BLOCK_NAMES[m.group(2)]}"
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if m and m.group(2) in _HF_MOE_BLOCK_NAMES:
        return f"blocks.{m.group(1)}.{_HF_MOE_BLOCK_NAMES[m.group(2)]}"
    raise KeyError(name)


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
    last = max(ends, key=ends.get, default=None)
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
    hf_state = read_hf_state(d)
    if config.architecture in HYBRID_MODEL_TYPES:
        return load_hybrid(config, hf_state, str(d), check_finite).to(device=device, dtype=dtype)
    if config.architecture in MOE_MODEL_TYPES:
        hf_state = stack_experts(hf_state, config, str(d))
    state = {}
    for name, t in hf_state.items():
        try:
            lm = from_hf_name(name)
        except KeyError:
            raise WeightsError(
                f"{d}: unexpected tensor {name!r} for a {config.architecture} model"
            ) from None
        if lm is not None:
            state[lm] = t
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the copy too
    check_layer_count(config, state, str(d))
    with torch.device("meta"):
        model = Transformer(config)
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
    state = {}
    if model.config.architecture in HYBRID_MODEL_TYPES:
        state = hybrid_state_to_hf(model)
    for n, p in [] if state else model.named_parameters():
        if (
            model.config.architecture in MOE_MODEL_TYPES
            and n.endswith(_EXPERT_PARAMS)
            and p.dim() == 3
        ):
            state.update(unstack_experts(n, p.detach().cpu(), model.config.architecture))
        else:
            state[to_hf_name(n, model.config.architecture)] = p.detach().contiguous().cpu()
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


def gated_deltanet_from_qwen3_next(
    state: dict[str, torch.Tensor],
    n_k: int,
    n_v: int,
    h_k: int,
    h_v: int,
    source: str = "Qwen3-Next linear_attn",
) -> dict[str, torch.Tensor]:
    """One Qwen3-Next ``linear_attn`` layer's tensors -> ``model.deltanet.GatedDeltaNet`` names (Qwen3.5's layout).

    Qwen3-Next fuses the projections per q/k head group: ``in_proj_qkvz`` rows are, for each of the n_k groups,
    [q (h_k) | k (h_k) | v (r·h_v) | z (r·h_v)] with r = n_v / n_k, and ``in_proj_ba`` rows [b (r) | a (r)];
    lmstack (and Qwen3.5) keep [all q | all k | all v], z, b, a as separate projections. conv1d, dt_bias, A_log,
    norm and out_proj carry over. A tensor whose shape disagrees with the head sizes is a WeightsError naming it."""
    if n_v % n_k:
        raise WeightsError(
            f"{source}: n_v={n_v} value heads is not a multiple of n_k={n_k} key heads"
        )
    r = n_v // n_k
    qkvz, ba = state["in_proj_qkvz.weight"], state["in_proj_ba.weight"]
    per_group = 2 * h_k + 2 * r * h_v
    if qkvz.shape[0] != n_k * per_group:
        raise WeightsError(
            f"{source}: in_proj_qkvz.weight has {qkvz.shape[0]} rows; n_k={n_k} groups of "
            f"2·h_k + 2·(n_v/n_k)·h_v = {per_group} need {n_k * per_group}"
        )
    if ba.shape[0] != 2 * n_v:
        raise WeightsError(
            f"{source}: in_proj_ba.weight has {ba.shape[0]} rows; expected 2·n_v = {2 * n_v}"
        )
    D = qkvz.shape[1]
    q, k, v, z = qkvz.view(n_k, per_group, D).split([h_k, h_k, r * h_v, r * h_v], dim=1)
    b, a = ba.view(n_k, 2 * r, D).split([r, r], dim=1)
    out = {
        "in_proj_qkv.weight": torch.cat([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)]),
        "in_proj_z.weight": z.reshape(-1, D),
        "in_proj_b.weight": b.reshape(-1, D),
        "in_proj_a.weight": a.reshape(-1, D),
    }
    for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"):
        out[name] = state[name]
    return out


# ---- mixture of experts / MLA families (model/moe.py, model/mla.py) -----------------------------------
_HF_MOE_BLOCK_NAMES = {  # HF name inside model.layers.{i} -> lmstack name inside blocks.{i} (load direction)
    "mlp.gate.weight": "ffn.router.weight",
    "block_sparse_moe.gate.weight": "ffn.router.weight",
    "mlp.gate.e_score_correction_bias": "ffn.router.bias",
    "mlp.shared_expert_gate.weight": "ffn.shared_gate.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "self_attn.q_a_proj.weight": "attn.q_a_proj.weight",
    "self_attn.q_a_layernorm.weight": "attn.q_a_layernorm.weight",
    "self_attn.q_b_proj.weight": "attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.kv_a_proj.weight",
    "self_attn.kv_a_layernorm.weight": "attn.kv_a_layernorm.weight",
    "self_attn.kv_b_proj.weight": "attn.kv_b_proj.weight",
    **{
        f"mlp.{shared}.{w}_proj.weight": f"ffn.shared.{w}_proj.weight"
        for shared in ("shared_expert", "shared_experts")
        for w in ("gate", "up", "down")
    },
    **{
        f"mlp.stacked_experts.{w}_proj.weight": f"ffn.{w}_proj.weight"
        for w in ("gate", "up", "down")
    },
}
_EXPERT_PARAMS = ("ffn.gate_proj.weight", "ffn.up_proj.weight", "ffn.down_proj.weight")
_MIXTRAL_W = {"w1": "gate", "w3": "up", "w2": "down"}
_HF_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+?)(?:_proj)?\.weight"
)


def _expert_prefix(arch: str) -> str:
    return "block_sparse_moe" if arch == "mixtral" else "mlp"


def stack_experts(
    hf_state: dict[str, torch.Tensor], config: ModelConfig, source: str
) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors ``...experts.{j}.{w}.weight`` -> one (E, out, in) tensor per layer and weight,
    under the internal name ``model.layers.{i}.mlp.stacked_experts.{w}_proj.weight``. A missing expert is a
    WeightsError naming the layer, the weight, the experts absent and ``n_experts``."""
    if (
        config.architecture == "deepseek_v3"
    ):  # multi-token-prediction layers past n_layers: not part of the model
        hf_state = {
            n: t
            for n, t in hf_state.items()
            if not ((m := _HF_BLOCK.fullmatch(n)) and int(m.group(1)) >= config.n_layers)
        }
    groups: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    out = {}
    for name, t in hf_state.items():
        m = _HF_EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        w = _MIXTRAL_W.get(m.group(3), m.group(3))
        groups.setdefault((int(m.group(1)), w), {})[int(m.group(2))] = (name, t)
    E = config.n_experts
    moe_layers = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
    for i in moe_layers:
        for w in ("gate", "up", "down"):
            got = groups.pop((i, w), {})
            missing = sorted(set(range(E)) - set(got))
            extra = sorted(set(got) - set(range(E)))
            if missing or extra:
                what = (
                    f"missing for experts {missing[:8]}"
                    if missing
                    else f"present for experts {extra[:8]}"
                )
                raise WeightsError(
                    f"{source}: layer {i} expert weight {w}_proj is {what}, but the config says "
                    f"n_experts={E} (experts 0..{E - 1})"
                )
            F, D = config.d_ff_expert or config.d_ff, config.d_model
            want = (D, F) if w == "down" else (F, D)
            for n, t in got.values():  # torch.stack would promote an int32 expert and name none
                if not t.is_floating_point() or tuple(t.shape) != want:
                    raise WeightsError(
                        f"{source}: tensor {n!r} has dtype {t.dtype}, shape {tuple(t.shape)}; "
                        f"expected a floating-point dtype, shape {want} (d_model={D}, d_ff_expert={F})"
                    )
            out[f"model.layers.{i}.mlp.stacked_experts.{w}_proj.weight"] = torch.stack(
                [got[j][1] for j in range(E)]
            )
    if groups:
        (i, w), _ = next(iter(groups.items()))
        raise WeightsError(
            f"{source}: layer {i} holds expert weights ({w}_proj), but the config makes it a dense "
            f"layer (moe_first_dense={config.moe_first_dense}, moe_layer_step={config.moe_layer_step})"
        )
    return out


def unstack_experts(name: str, t: torch.Tensor, arch: str) -> dict[str, torch.Tensor]:
    """lmstack ``blocks.{i}.ffn.{w}_proj.weight`` (E, out, in) -> the family's per-expert HF tensors."""
    i = _LM_BLOCK.fullmatch(name).group(1)
    w = name.split(".")[-2].removesuffix("_proj")
    hf_w = {v: k for k, v in _MIXTRAL_W.items()}[w] if arch == "mixtral" else f"{w}_proj"
    prefix = f"model.layers.{i}.{_expert_prefix(arch)}.experts"
    return {f"{prefix}.{j}.{hf_w}.weight": t[j].contiguous() for j in range(t.shape[0])}


def moe_to_hf_name(name: str, arch: str) -> str:
    m = _LM_BLOCK.fullmatch(name)
    if m is None or m.group(2) in _BLOCK_NAMES:
        return to_hf_name(name)
    rest = m.group(2)
    table = {v: k for k, v in _HF_MOE_BLOCK_NAMES.items() if "stacked" not in k}
    table["ffn.router.weight"] = (
        "block_sparse_moe.gate.weight" if arch == "mixtral" else "mlp.gate.weight"
    )
    if rest.startswith("ffn.shared."):
        shared = "shared_experts" if arch.startswith("deepseek") else "shared_expert"
        return f"model.layers.{m.group(1)}.mlp.{shared}.{rest.removeprefix('ffn.shared.')}"
    if rest not in table:
        raise KeyError(f"lmstack parameter {name!r} has no HF name in a {arch} checkpoint")
    return f"model.layers.{m.group(1)}.{table[rest]}"


def _none_or_int(d: dict[str, Any], key: str) -> int | None:
    return None if d.get(key) is None else check_int(key, d[key], ConfigError, 1, MAX_SIZE)


def moe_config_from_hf(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE / MLA ModelConfig fields of an HF Mixtral / OLMoE / Qwen2-MoE / DeepSeek-V2/V3 config.
    Fields this loader cannot honour are ConfigErrors naming the field and its value."""
    kw: dict[str, Any] = {"n_experts_per_token": _int(d, "num_experts_per_tok")}
    if model_type == "mixtral":
        kw.update(n_experts=_int(d, "num_local_experts"), router_norm_topk=True)
    elif model_type == "olmoe":
        if _flag(d, "attention_bias"):
            raise ConfigError(
                f"attention_bias={d['attention_bias']!r} is not supported for olmoe (expected false)"
            )
        clip = d.get("clip_qkv")
        kw.update(
            n_experts=_int(d, "num_experts"),
            router_norm_topk=_flag(d, "norm_topk_prob"),
            qk_norm_full=True,
            qkv_clip=None if clip is None else check_float("clip_qkv", clip, ConfigError),
        )
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        only = d.get("mlp_only_layers") or []
        if only:
            raise ConfigError(
                f"mlp_only_layers={only!r} is not supported (expected []); "
                "use decoder_sparse_step for regular dense/MoE interleaving"
            )
        shared = _none_or_int(d, "shared_expert_intermediate_size")
        if model_type == "qwen3_moe":  # per-head QK-norm, no q/k/v bias, no shared expert
            if _flag(d, "attention_bias"):
                raise ConfigError(
                    f"attention_bias={d['attention_bias']!r} is not supported for qwen3_moe "
                    "(a bias on o_proj too); expected false"
                )
            kw.update(qk_norm=True, qkv_bias=False)
            shared = None
        else:
            kw["qkv_bias"] = True
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the hub configs say num_experts
        n_key = (
            "num_local_experts"
            if model_type == "qwen3_moe" and "num_experts" not in d
            else "num_experts"
        )
        kw.update(
            n_experts=_int(d, n_key),
            d_ff_expert=_int(d, "moe_intermediate_size"),
            router_norm_topk=_flag(d, "norm_topk_prob"),
            moe_layer_step=_int(d, "decoder_sparse_step", 1),
            n_shared_experts=1 if shared else 0,
            d_ff_shared=shared,
            shared_expert_gate=bool(shared),
        )
    else:  # deepseek_v2 / deepseek_v3
        if _flag(d, "attention_bias"):
            raise ConfigError(
                f"attention_bias={d['attention_bias']!r} is not supported for {model_type}"
            )
        freq = d.get("moe_layer_freq", 1)
        if freq != 1:
            raise ConfigError(f"moe_layer_freq={freq!r} is not supported (expected 1)")
        n_shared = d.get("n_shared_experts") or 0
        e_ff = _int(d, "moe_intermediate_size")
        kw.update(
            n_experts=_int(d, "n_routed_experts"),
            d_ff_expert=e_ff,
            n_shared_experts=check_int("n_shared_experts", n_shared, ConfigError, 0, MAX_SIZE),
            d_ff_shared=n_shared * e_ff or None,
            moe_first_dense=check_int(
                "first_k_dense_replace", d.get("first_k_dense_replace", 0), ConfigError, 0, MAX_SIZE
            ),
            router_scale=check_float(
                "routed_scaling_factor", d.get("routed_scaling_factor", 1.0), ConfigError
            ),
            kv_lora_rank=_int(d, "kv_lora_rank"),
            q_lora_rank=_none_or_int(d, "q_lora_rank") or 0,
            qk_nope_head_dim=_int(d, "qk_nope_head_dim"),
            qk_rope_head_dim=_int(d, "qk_rope_head_dim"),
            v_head_dim=_int(d, "v_head_dim"),
            head_dim=_int(d, "qk_nope_head_dim") + _int(d, "qk_rope_head_dim"),
            n_kv_heads=_int(d, "num_attention_heads"),
            rope_layout="interleaved",
        )
        if model_type == "deepseek_v2":
            method = d.get("topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy"):
                raise ConfigError(
                    f"topk_method={method!r} is not supported for deepseek_v2; "
                    "expected 'greedy' or 'group_limited_greedy'"
                )
            if method == "group_limited_greedy":
                kw.update(
                    router_groups=_int(d, "n_group"), router_topk_groups=_int(d, "topk_group")
                )
        else:
            method = d.get("topk_method", "noaux_tc")
            if method != "noaux_tc":
                raise ConfigError(
                    f"topk_method={method!r} is not supported for deepseek_v3 (expected 'noaux_tc')"
                )
            if d.get("scoring_func", "sigmoid") != "sigmoid":
                raise ConfigError(
                    f"scoring_func={d['scoring_func']!r} is not supported (expected 'sigmoid')"
                )
            kw.update(
                router_score="sigmoid",
                router_aux_free_bias=True,
                router_norm_topk=_flag(d, "norm_topk_prob"),
                router_groups=_int(d, "n_group", 1),
                router_topk_groups=_int(d, "topk_group", 1),
                rope_layout="interleaved" if d.get("rope_interleave", True) else "half",
            )
    return kw


def moe_config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` of a Mixtral / OLMoE / Qwen2-MoE / DeepSeek-V2/V3 ModelConfig."""
    arch = c.architecture
    d: dict[str, Any] = {
        "architectures": [MOE_MODEL_TYPES[arch]],
        "model_type": arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "num_experts_per_tok": c.n_experts_per_token,
        "torch_dtype": "float32",
    }
    if arch == "mixtral":
        d.update(
            num_local_experts=c.n_experts, head_dim=c.head_dim, sliding_window=c.sliding_window
        )
    elif arch == "olmoe":
        d.update(
            num_experts=c.n_experts,
            norm_topk_prob=c.router_norm_topk,
            clip_qkv=c.qkv_clip,
            attention_bias=False,
        )
    elif arch in ("qwen2_moe", "qwen3_moe"):
        d.update(
            num_experts=c.n_experts,
            moe_intermediate_size=c.d_ff_expert or c.d_ff,
            norm_topk_prob=c.router_norm_topk,
            decoder_sparse_step=c.moe_layer_step,
            mlp_only_layers=[],
            use_sliding_window=False,
        )
        if arch == "qwen2_moe":
            d.update(shared_expert_intermediate_size=c.d_ff_shared or 0, qkv_bias=True)
        else:
            d.update(head_dim=c.head_dim, attention_bias=False, num_local_experts=c.n_experts)
    else:
        d.update(
            n_routed_experts=c.n_experts,
            moe_intermediate_size=c.d_ff_expert or c.d_ff,
            n_shared_experts=c.n_shared_experts,
            first_k_dense_replace=c.moe_first_dense,
            routed_scaling_factor=c.router_scale,
            kv_lora_rank=c.kv_lora_rank,
            q_lora_rank=c.q_lora_rank or None,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            attention_bias=False,
            head_dim=c.qk_rope_head_dim,
            norm_topk_prob=c.router_norm_topk,
        )
        if c.rope_yarn is not None:
            d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": c.rope_theta, **c.rope_yarn}
        if arch == "deepseek_v2":
            grouped = c.router_groups > 1
            d.update(
                topk_method="group_limited_greedy" if grouped else "greedy",
                n_group=c.router_groups if grouped else None,
                topk_group=c.router_topk_groups if grouped else None,
            )
        else:
            d.update(
                n_group=c.router_groups,
                topk_group=c.router_topk_groups,
                rope_interleave=c.rope_layout == "interleaved",
                num_nextn_predict_layers=0,
            )
    return d


_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


def split_yarn(d: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A DeepSeek config without its YaRN scaling (``rope_scaling`` or ``rope_parameters`` of type yarn), and
    the YaRN parameters for ``ModelConfig.rope_yarn`` (None when the RoPE is plain)."""
    d = dict(d)
    for key in ("rope_scaling", "rope_parameters"):
        v = _dict_or_none(d, key, source)
        kind = v.get("rope_type", v.get("type"))
        if kind == "yarn":
            yarn = {k: v[k] for k in _YARN_KEYS if v.get(k) is not None}
            if "factor" not in yarn:  # DeepSeek-V3 style: the ratio of the context lengths
                yarn["factor"] = _int(d, "max_position_embeddings") / _int(
                    v, "original_max_position_embeddings"
                )
            d[key] = {
                "rope_type": "default",
                **({"rope_theta": v["rope_theta"]} if "rope_theta" in v else {}),
            }
            if key == "rope_scaling":
                d.pop(key)
            return d, yarn
    return d, None


# ---- recurrent / hybrid / interleaved local-global families ------------------------------------------
# Mamba2ForCausalLM (pure Mamba-2 blocks, no FFN), Gemma2ForCausalLM / Gemma3ForCausalLM (text; interleaved
# sliding-window : global attention, GeGLU, (1 + w) sandwich norms) and Qwen3NextForCausalLM (3:1 Gated DeltaNet :
# gated full attention, MoE with a gated shared expert). Config fields this loader does not know are refused by
# name; fields it knows but cannot honour are refused with their value.

#: HF config fields that do not change the forward pass (bookkeeping, training-only, generation defaults)
_HARMLESS_FIELDS = {
    "transformers_version",
    "architectures",
    "output_hidden_states",
    "return_dict",
    "dtype",
    "torch_dtype",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "problem_type",
    "id2label",
    "label2id",
    "_name_or_path",
    "model_type",
    "output_attentions",
    "use_cache",
    "initializer_range",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "attention_dropout",
    "output_router_logits",
    "router_aux_loss_coef",
    "max_position_embeddings",
    "tokenizer_class",
    "_attn_implementation_autoset",
    "use_bidirectional_attention",
    "cache_implementation",
    "residual_in_fp32",
    "time_step_rank",
    "time_step_min",
    "time_step_max",
    "time_step_floor",
    "rescale_prenorm_residual",
    "hidden_act",
    "hidden_activation",
    "attention_bias",
    "use_bias",
    "use_conv_bias",
    "rms_norm",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
}
#: the fields each family's loader reads (besides the harmless ones)
_HYBRID_FIELDS = {
    "mamba2": {
        "state_size",
        "expand",
        "head_dim",
        "num_heads",
        "n_groups",
        "conv_kernel",
        "layer_norm_epsilon",
        "chunk_size",
        "time_step_limit",
        "norm_before_gate",
    },
    "gemma2": {
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "query_pre_attn_scalar",
        "sliding_window",
        "layer_types",
        "final_logit_softcapping",
        "attn_logit_softcapping",
    },
    "qwen3_next": {
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "partial_rotary_factor",
        "layer_types",
        "full_attention_interval",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "decoder_sparse_step",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_experts_per_tok",
        "num_experts",
        "norm_topk_prob",
        "mlp_only_layers",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
    },
}
_HYBRID_FIELDS["gemma3_text"] = _HYBRID_FIELDS["gemma2"] | {
    "rope_local_base_freq",
    "sliding_window_pattern",
    "_sliding_window_pattern",
}
#: the hybrid-family ModelConfig fields at their Llama-block defaults (other families cannot export them)
_VARIANT_DEFAULTS = dict(
    block_ffn=True,
    norm_offset=False,
    sandwich_norm=False,
    ffn_act="silu",
    embed_scale=False,
    query_pre_attn_scalar=None,
    attn_softcap=None,
    final_softcap=None,
    local_rope_theta=None,
    rotary_dim=None,
    attn_output_gate=False,
    ssm_dt_limit=None,
    rope_linear_factor=None,
)
#: no positional limit in a pure Mamba-2 model: lmstack's cap on the sequences it accepts
MAMBA2_MAX_SEQ_LEN = 1 << 20


def _expect(d: dict[str, Any], key: str, allowed: tuple, family: str) -> None:
    """A field this loader supports only at the values ``allowed`` (absent counts as the first)."""
    v = d.get(key, allowed[0])
    if v not in allowed:
        raise ConfigError(
            f"{key}={v!r} is not supported by lmstack's {family} loader (expected one of {allowed})"
        )


def _plain_theta(params: dict[str, Any], where: str) -> float:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise ConfigError(
            f"{where}.rope_type={kind!r} is not supported (only plain RoPE, 'default')"
        )
    return check_float(f"{where}.rope_theta", params.get("rope_theta", 10000.0), ConfigError)


def _hf_kinds(d: dict[str, Any], n: int, table: dict[str, str], default: list[str]) -> list[str]:
    """HF ``layer_types`` (or ``default`` when absent) -> lmstack mixers via ``table``; refuses unknown kinds."""
    kinds = d.get("layer_types") or default
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ConfigError(
            f"layer_types={kinds!r:.80} must list one kind for each of num_hidden_layers={n} layers"
        )
    for i, t in enumerate(kinds):
        if t not in table:
            raise ConfigError(
                f"layer_types[{i}]={t!r} (layer {i}); expected one of {sorted(table)}"
            )
    return [table[t] for t in kinds]


def hybrid_config_from_hf(
    d: dict[str, Any], model_type: str, source: str = "config.json"
) -> ModelConfig:
    """An HF Mamba2 / Gemma-2 / Gemma-3 (text) / Qwen3-Next ``config.json`` dict -> ModelConfig.
    A field this loader does not know, or a value it cannot honour, is a ConfigError naming the field."""
    family = HYBRID_MODEL_TYPES[model_type]
    try:
        unknown = sorted(set(d) - _HARMLESS_FIELDS - _HYBRID_FIELDS[model_type])
        if unknown:
            raise ConfigError(
                f"field(s) {unknown} are not supported by lmstack's {family} loader; known fields: "
                f"{sorted(_HYBRID_FIELDS[model_type])} (and bookkeeping ones)"
            )
        n = _int(d, "num_hidden_layers")
        name = d.get("_name_or_path") or model_type
        kw: dict[str, Any] = dict(
            vocab_size=_int(d, "vocab_size"),
            d_model=_int(d, "hidden_size"),
            n_layers=n,
            tie_embeddings=_flag(d, "tie_word_embeddings"),
            architecture=model_type,
            bos_token_id=_first_id(d, "bos_token_id"),
            eos_token_id=_first_id(d, "eos_token_id"),
            name=name if isinstance(name, str) else model_type,
        )
        if model_type == "mamba2":
            for key, allowed in (
                ("hidden_act", ("silu",)),
                ("use_bias", (False,)),
                ("use_conv_bias", (True,)),
                ("rms_norm", (True,)),
                ("norm_before_gate", (False,)),
            ):
                _expect(d, key, allowed, family)
            D, expand, P = kw["d_model"], _int(d, "expand", 2), _int(d, "head_dim", 64)
            heads = _int(d, "num_heads", max(expand * D // P, 1))
            if heads * P != expand * D:
                raise ConfigError(
                    f"num_heads={heads} x head_dim={P} must equal expand x hidden_size = {expand * D}"
                )
            limit = d.get("time_step_limit", [0.0, float("inf")])
            if not isinstance(limit, (list, tuple)) or len(limit) != 2:
                raise ConfigError(f"time_step_limit={limit!r}; expected [lo, hi]")
            # transformers writes inf as {"__float__": "Infinity"} (JSON has no inf)
            limit = [
                float(v["__float__"])
                if isinstance(v, dict) and isinstance(v.get("__float__"), str)
                else v
                for v in limit
            ]
            if limit[1] != float("inf"):
                check_float("time_step_limit[1]", limit[1], ConfigError)
            kw.update(
                n_heads=1,
                head_dim=2,
                d_ff=1,
                max_seq_len=MAMBA2_MAX_SEQ_LEN,
                layer_types=["mamba2"] * n,
                block_ffn=False,
                ssm_state_size=_int(d, "state_size", 128),
                ssm_expand=expand,
                ssm_head_dim=P,
                ssm_n_groups=_int(d, "n_groups", 1),
                conv_kernel=_int(d, "conv_kernel", 4),
                mixer_chunk_size=_int(d, "chunk_size", 256),
                norm_eps=check_float(
                    "layer_norm_epsilon", d.get("layer_norm_epsilon", 1e-5), ConfigError
                ),
                ssm_dt_limit=None if list(limit) == [0.0, float("inf")] else list(limit),
            )
            return ModelConfig(**kw)
        n_heads = _int(d, "num_attention_heads")
        kw.update(
            n_heads=n_heads,
            n_kv_heads=_int(d, "num_key_value_heads", n_heads),
            d_ff=_int(d, "intermediate_size"),
            head_dim=None if d.get("head_dim") is None else _int(d, "head_dim"),
            max_seq_len=_int(d, "max_position_embeddings", 8192, MAX_SEQ_LEN),
            norm_eps=check_float("rms_norm_eps", d.get("rms_norm_eps", 1e-6), ConfigError),
            norm_offset=True,
            qk_norm=model_type != "gemma2",
        )
        _expect(d, "attention_bias", (False,), family)
        legacy_scaling = _dict_or_none(d, "rope_scaling", source)
        linear = None  # Gemma-3 4B+: linear RoPE scaling of the global layers
        if (
            legacy_scaling
            and model_type == "gemma3_text"
            and legacy_scaling.get("rope_type", legacy_scaling.get("type")) == "linear"
        ):
            linear = check_float("rope_scaling.factor", legacy_scaling.get("factor"), ConfigError)
        elif legacy_scaling:
            raise ConfigError(
                f"rope_scaling={d['rope_scaling']!r} is not supported (only plain RoPE"
                f"{', or linear on the global layers' if model_type == 'gemma3_text' else ''})"
            )
        params = _dict_or_none(d, "rope_parameters", source)
        if model_type in ("gemma2", "gemma3_text"):
            _expect(d, "hidden_activation", ("gelu_pytorch_tanh",), family)
            _expect(d, "hidden_act", ("gelu_pytorch_tanh",), family)
            _expect(d, "use_bidirectional_attention", (None, False), family)
            if model_type == "gemma2":
                theta = _plain_theta(
                    params or {"rope_theta": d.get("rope_theta", 10000.0)}, "rope_parameters"
                )
                local_theta, default = (
                    None,
                    ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)],
                )
            else:
                every = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
                every = check_int("sliding_window_pattern", every, ConfigError, 1, MAX_SIZE)
                default = [
                    "sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)
                ]
                if "full_attention" in params or "sliding_attention" in params:
                    full = _dict_or_none(params, "full_attention", source)
                    if full.get("rope_type") == "linear":
                        linear = check_float(
                            "rope_parameters.full_attention.factor", full.get("factor"), ConfigError
                        )
                        full = {**full, "rope_type": "default"}
                    theta = _plain_theta(full, "rope_parameters.full_attention")
                    local_theta = _plain_theta(
                        _dict_or_none(params, "sliding_attention", source),
                        "rope_parameters.sliding_attention",
                    )
                else:
                    theta = _plain_theta(
                        params or {"rope_theta": d.get("rope_theta", 1e6)}, "rope_parameters"
                    )
                    local_theta = check_float(
                        "rope_local_base_freq", d.get("rope_local_base_freq", 10000.0), ConfigError
                    )
            layer_types = _hf_kinds(
                d,
                n,
                {"sliding_attention": "local_attention", "full_attention": "attention"},
                default,
            )
            softcaps = {
                f: None if d.get(f) is None else check_float(f, d[f], ConfigError)
                for f in ("attn_logit_softcapping", "final_logit_softcapping")
            }
            kw.update(
                rope_theta=theta,
                local_rope_theta=local_theta,
                layer_types=layer_types,
                rope_linear_factor=linear,
                local_window=check_int(
                    "sliding_window", d.get("sliding_window", 4096), ConfigError, 1, MAX_SIZE
                ),
                tie_embeddings=d.get("tie_word_embeddings", True) is not False,
                sandwich_norm=True,
                ffn_act="gelu_tanh",
                embed_scale=True,
                attn_softcap=softcaps["attn_logit_softcapping"],
                final_softcap=softcaps["final_logit_softcapping"],
                query_pre_attn_scalar=check_float(
                    "query_pre_attn_scalar", d.get("query_pre_attn_scalar", 256), ConfigError
                ),
            )
            return ModelConfig(**kw)
        # qwen3_next
        _expect(d, "hidden_act", ("silu",), family)
        _expect(d, "use_sliding_window", (False, None), family)
        only = d.get("mlp_only_layers") or []
        if only:
            raise ConfigError(
                f"mlp_only_layers={only!r} is not supported (expected []); lmstack places dense "
                "layers by decoder_sparse_step only"
            )
        theta = _plain_theta(
            params or {"rope_theta": d.get("rope_theta", 10000.0)}, "rope_parameters"
        )
        factor = check_float(
            "partial_rotary_factor",
            params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)),
            ConfigError,
        )
        head_dim = kw["head_dim"] or kw["d_model"] // n_heads
        every = check_int(
            "full_attention_interval", d.get("full_attention_interval", 4), ConfigError, 1, MAX_SIZE
        )
        layer_types = _hf_kinds(
            d,
            n,
            {"linear_attention": "gated_deltanet", "full_attention": "attention"},
            ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)],
        )
        shared = _none_or_int(d, "shared_expert_intermediate_size")
        kw.update(
            rope_theta=theta,
            rotary_dim=int(head_dim * factor),
            layer_types=layer_types,
            attn_output_gate=True,
            delta_n_heads=_int(d, "linear_num_key_heads"),
            delta_n_v_heads=_int(d, "linear_num_value_heads"),
            delta_head_dim=_int(d, "linear_key_head_dim"),
            delta_v_head_dim=_int(d, "linear_value_head_dim"),
            conv_kernel=_int(d, "linear_conv_kernel_dim", 4),
            n_experts=_int(d, "num_experts"),
            n_experts_per_token=_int(d, "num_experts_per_tok"),
            d_ff_expert=_int(d, "moe_intermediate_size"),
            router_norm_topk=_flag(d, "norm_topk_prob"),
            moe_layer_step=_int(d, "decoder_sparse_step", 1),
            n_shared_experts=1 if shared else 0,
            d_ff_shared=shared,
            shared_expert_gate=bool(shared),
        )
        return ModelConfig(**kw)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(f"{source}:") else f"{source}: {msg}") from None


def hybrid_config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` of a Mamba2 / Gemma-2 / Gemma-3 / Qwen3-Next ModelConfig."""
    arch = c.architecture
    d: dict[str, Any] = {
        "architectures": [HYBRID_MODEL_TYPES[arch]],
        "model_type": arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "torch_dtype": "float32",
    }
    if arch == "mamba2":
        lim = c.ssm_dt_limit or [0.0, float("inf")]
        d.update(
            state_size=c.ssm_state_size,
            expand=c.ssm_expand,
            head_dim=c.ssm_head_dim,
            num_heads=c.ssm_expand * c.d_model // c.ssm_head_dim,
            n_groups=c.ssm_n_groups,
            conv_kernel=c.conv_kernel,
            layer_norm_epsilon=c.norm_eps,
            chunk_size=c.mixer_chunk_size,
            time_step_limit=[
                lim[0],
                {"__float__": "Infinity"} if lim[1] == float("inf") else lim[1],
            ],
            use_bias=False,
            use_conv_bias=True,
            hidden_act="silu",
            rms_norm=True,
        )
        return d
    d.update(
        intermediate_size=c.d_ff,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        attention_bias=False,
    )
    if arch in ("gemma2", "gemma3_text"):
        kinds = {"local_attention": "sliding_attention", "attention": "full_attention"}
        scalar = c.query_pre_attn_scalar
        d.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
            sliding_window=c.local_window,
            layer_types=[kinds[t] for t in c.mixer_types],
            attn_logit_softcapping=c.attn_softcap,
            final_logit_softcapping=c.final_softcap,
        )
        if arch == "gemma2":
            if c.rope_linear_factor is not None:
                raise ConfigError("rope_linear_factor has no Gemma-2 HF equivalent")
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": c.rope_theta}
        else:
            full = {"rope_type": "default", "rope_theta": c.rope_theta}
            if c.rope_linear_factor is not None:
                full.update(rope_type="linear", factor=c.rope_linear_factor)
            d["rope_parameters"] = {
                "full_attention": full,
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": c.local_rope_theta or c.rope_theta,
                },
            }
        return d
    kinds = {"gated_deltanet": "linear_attention", "attention": "full_attention"}
    d.update(
        hidden_act="silu",
        layer_types=[kinds[t] for t in c.mixer_types],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": (c.rotary_dim or c.head_dim) / c.head_dim,
        },
        linear_num_key_heads=c.delta_n_heads,
        linear_num_value_heads=c.delta_n_v_heads,
        linear_key_head_dim=c.delta_head_dim,
        linear_value_head_dim=c.delta_v_head_dim,
        linear_conv_kernel_dim=c.conv_kernel,
        num_experts=c.n_experts,
        num_experts_per_tok=c.n_experts_per_token,
        moe_intermediate_size=c.d_ff_expert,
        shared_expert_intermediate_size=c.d_ff_shared or 0,
        norm_topk_prob=c.router_norm_topk,
        decoder_sparse_step=c.moe_layer_step,
        mlp_only_layers=[],
    )
    return d


_MAMBA2_MIXER = (
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "dt_bias",
    "A_log",
    "D",
    "norm.weight",
    "out_proj.weight",
)
_ATTN = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "q_norm.weight",
    "k_norm.weight",
)
_GDN = (
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "norm.weight",
    "out_proj.weight",
)
_HYBRID_BLOCK_NAMES = {  # per family: HF name inside the layer -> lmstack name inside blocks.{i}
    "mamba2": {
        "norm.weight": "attn_norm.weight",
        **{f"mixer.{n}": f"attn.{n}" for n in _MAMBA2_MIXER},
    },
    "gemma2": {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attn_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
        **{f"self_attn.{n}": f"attn.{n}" for n in _ATTN},
        **{f"mlp.{w}_proj.weight": f"ffn.{w}_proj.weight" for w in ("gate", "up", "down")},
    },
    "qwen3_next": {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        **{f"self_attn.{n}": f"attn.{n}" for n in _ATTN},
        **{
            f"linear_attn.{n}": f"attn.{n}"
            for n in _GDN
            + ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
        },
        **{f"mlp.{w}_proj.weight": f"ffn.{w}_proj.weight" for w in ("gate", "up", "down")},
        "mlp.gate.weight": "ffn.router.weight",
        "mlp.shared_expert_gate.weight": "ffn.shared_gate.weight",
        **{
            f"mlp.shared_expert.{w}_proj.weight": f"ffn.shared.{w}_proj.weight"
            for w in ("gate", "up", "down")
        },
        **{
            f"mlp.stacked_experts.{w}_proj.weight": f"ffn.{w}_proj.weight"
            for w in ("gate", "up", "down")
        },
    },
}
_HYBRID_BLOCK_NAMES["gemma3_text"] = _HYBRID_BLOCK_NAMES["gemma2"]
_HYBRID_TOP_NAMES = {  # HF top-level name -> lmstack
    "mamba2": {
        "backbone.embeddings.weight": "embed.weight",
        "backbone.norm_f.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    },
}
_HYBRID_PREFIX = {"mamba2": re.compile(r"backbone\.layers\.(\d+)\.(.+)")}
#: which config fields size each tensor (for shape-mismatch errors); keys are lmstack names inside a block
_SHAPE_FIELDS = {
    "attn.in_proj.weight": "hidden_size, expand, n_groups, state_size, num_heads",
    "attn.conv1d.weight": "conv_kernel (linear_conv_kernel_dim) and the conv channels (expand·hidden_size + "
    "2·n_groups·state_size, or 2·key heads·key dim + value heads·value dim)",
    "attn.conv1d.bias": "expand, hidden_size, n_groups, state_size",
    "attn.dt_bias": "num_heads (linear_num_value_heads)",
    "attn.A_log": "num_heads (linear_num_value_heads)",
    "attn.D": "num_heads",
    "attn.norm.weight": "expand·hidden_size (linear_value_head_dim)",
    "attn.out_proj.weight": "hidden_size, expand (linear_num_value_heads·linear_value_head_dim)",
    "attn.q_proj.weight": "num_attention_heads, head_dim, hidden_size",
    "attn.k_proj.weight": "num_key_value_heads, head_dim, hidden_size",
    "attn.v_proj.weight": "num_key_value_heads, head_dim, hidden_size",
    "attn.o_proj.weight": "hidden_size, num_attention_heads, head_dim",
    "attn.q_norm.weight": "head_dim",
    "attn.k_norm.weight": "head_dim",
    "attn.in_proj_qkv.weight": "linear_num_key_heads, linear_key_head_dim, linear_num_value_heads, "
    "linear_value_head_dim",
    "attn.in_proj_z.weight": "linear_num_value_heads, linear_value_head_dim",
    "attn.in_proj_b.weight": "linear_num_value_heads",
    "attn.in_proj_a.weight": "linear_num_value_heads",
    "ffn.gate_proj.weight": "intermediate_size / moe_intermediate_size, num_experts",
    "ffn.up_proj.weight": "intermediate_size / moe_intermediate_size, num_experts",
    "ffn.down_proj.weight": "intermediate_size / moe_intermediate_size, num_experts",
    "ffn.router.weight": "num_experts",
    "ffn.shared_gate.weight": "hidden_size",
    "ffn.shared.gate_proj.weight": "shared_expert_intermediate_size",
    "ffn.shared.up_proj.weight": "shared_expert_intermediate_size",
    "ffn.shared.down_proj.weight": "shared_expert_intermediate_size",
}


def _hybrid_from_hf_name(name: str, arch: str) -> str | None:
    """lmstack name of an HF tensor of a hybrid family; None for tensors lmstack does not use; KeyError if unknown."""
    top = _HYBRID_TOP_NAMES.get(arch, _HF_TOP_NAMES)
    if name in top:
        return top[name]
    if name.endswith("rotary_emb.inv_freq"):
        return None
    m = _HYBRID_PREFIX.get(arch, _HF_BLOCK).fullmatch(name)
    table = _HYBRID_BLOCK_NAMES[arch]
    if m and m.group(2) in table:
        return f"blocks.{m.group(1)}.{table[m.group(2)]}"
    raise KeyError(name)


def _check_hybrid_shapes(
    model: torch.nn.Module, state: dict[str, torch.Tensor], hf_names: dict[str, str], source: str
) -> None:
    """A tensor whose shape disagrees with the config: a WeightsError naming the layer, its mixer kind, the HF
    tensor, both shapes and the config fields that size it (load_state_into then checks names and dtypes)."""
    kinds = model.config.mixer_types
    for name, p in model.named_parameters():
        t = state.get(name)
        if t is None or tuple(t.shape) == tuple(p.shape):
            continue
        m = _LM_BLOCK.fullmatch(name)
        where = f"layer {m.group(1)} ({kinds[int(m.group(1))]})" if m else "top level"
        fields = _SHAPE_FIELDS.get(m.group(2) if m else "", "vocab_size, hidden_size")
        raise WeightsError(
            f"{source}: {where}: tensor {hf_names.get(name, name)!r} has shape {tuple(t.shape)}, but "
            f"the config makes it {tuple(p.shape)} (fields: {fields})"
        )


def load_hybrid(
    config: ModelConfig, hf_state: dict[str, torch.Tensor], source: str, check_finite: bool = True
):
    """HF tensors of a Mamba2 / Gemma-2/3 / Qwen3-Next checkpoint -> an lmstack ``Transformer`` on the CPU."""
    arch = config.architecture
    if config.n_experts:
        hf_state = stack_experts(hf_state, config, source)
    if (
        arch == "qwen3_next"
    ):  # re-lay out the fused Gated DeltaNet projections (model/deltanet.py's layout)
        hf_state = dict(hf_state)
        for i, kind in enumerate(config.mixer_types):
            prefix = f"model.layers.{i}.linear_attn."
            if (
                kind != "gated_deltanet"
                or prefix + "in_proj_qkvz.weight" not in hf_state
                or prefix + "in_proj_ba.weight" not in hf_state
            ):
                continue
            layer = {
                n.removeprefix(prefix): hf_state.pop(n)
                for n in list(hf_state)
                if n.startswith(prefix)
            }
            for need in _GDN:
                if need not in layer:
                    raise WeightsError(
                        f"{source}: layer {i} (gated_deltanet): missing tensor {prefix + need!r}"
                    )
            hf_state.update(
                {
                    f"model.layers.{i}.linear_attn.{n}": t
                    for n, t in gated_deltanet_from_qwen3_next(
                        layer,
                        config.delta_n_heads,
                        config.delta_n_v_heads,
                        config.delta_head_dim,
                        config.delta_v_head_dim,
                        source=f"{source}: layer {i} (gated_deltanet; fields linear_num_key_heads, linear_num_value_heads, "
                        "linear_key_head_dim, linear_value_head_dim)",
                    ).items()
                }
            )
    state, hf_names = {}, {}
    for name, t in hf_state.items():
        try:
            lm = _hybrid_from_hf_name(name, arch)
        except KeyError:
            raise WeightsError(f"{source}: unexpected tensor {name!r} for a {arch} model") from None
        if lm is not None:
            state[lm], hf_names[lm] = t, name
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    check_layer_count(config, state, source)
    with torch.device("meta"):
        model = Transformer(config)
    missing = [n for n, _ in model.named_parameters() if n not in state]
    if missing:
        m = _LM_BLOCK.fullmatch(missing[0])
        if m is None:
            top = {v: k for k, v in _HYBRID_TOP_NAMES.get(arch, _HF_TOP_NAMES).items()}
            raise WeightsError(f"{source}: missing tensor {top.get(missing[0], missing[0])!r}")
        block = {
            v: k
            for k, v in _HYBRID_BLOCK_NAMES[arch].items()
            if not k.startswith(
                (
                    "mlp.stacked",
                    "linear_attn.in_proj_qkv.",
                    "linear_attn.in_proj_z.",
                    "linear_attn.in_proj_b.",
                    "linear_attn.in_proj_a.",
                )
            )
        }
        i, kind = int(m.group(1)), config.mixer_types[int(m.group(1))]
        hf_name = block.get(m.group(2), m.group(2))
        prefix = "backbone.layers" if arch == "mamba2" else "model.layers"
        if m.group(2).startswith("attn.in_proj_"):
            hf_name = "linear_attn.in_proj_qkvz.weight / in_proj_ba.weight"
        elif m.group(2) in (
            "ffn.gate_proj.weight",
            "ffn.up_proj.weight",
            "ffn.down_proj.weight",
        ) and config.is_moe_layer(i):
            hf_name = f"mlp.experts.*.{m.group(2).split('.')[1]}.weight"
        raise WeightsError(
            f"{source}: layer {i} ({kind}): missing tensor '{prefix}.{i}.{hf_name}'"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    _check_hybrid_shapes(model, state, hf_names, source)
    load_state_into(model, state, source, check_finite=check_finite)
    return model


def gated_deltanet_to_qwen3_next(
    state: dict[str, torch.Tensor], n_k: int, n_v: int, h_k: int, h_v: int
) -> dict[str, torch.Tensor]:
    """The inverse of ``gated_deltanet_from_qwen3_next``: separate q/k/v, z, b, a -> fused in_proj_qkvz / in_proj_ba."""
    r = n_v // n_k
    D = state["in_proj_qkv.weight"].shape[1]
    q, k, v = state["in_proj_qkv.weight"].split([n_k * h_k, n_k * h_k, n_v * h_v])
    z, b, a = state["in_proj_z.weight"], state["in_proj_b.weight"], state["in_proj_a.weight"]
    qkvz = torch.cat(
        [
            q.view(n_k, h_k, D),
            k.view(n_k, h_k, D),
            v.reshape(n_k, r * h_v, D),
            z.reshape(n_k, r * h_v, D),
        ],
        dim=1,
    ).reshape(-1, D)
    ba = torch.cat([b.reshape(n_k, r, D), a.reshape(n_k, r, D)], dim=1).reshape(-1, D)
    out = {"in_proj_qkvz.weight": qkvz.contiguous(), "in_proj_ba.weight": ba.contiguous()}
    for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"):
        out[name] = state[name]
    return out


def hybrid_state_to_hf(model) -> dict[str, torch.Tensor]:
    """A Mamba2 / Gemma / Qwen3-Next lmstack model's parameters under their HF names (experts per expert, the
    Qwen3-Next Gated DeltaNet projections fused back)."""
    c = model.config
    arch = c.architecture
    top = {v: k for k, v in _HYBRID_TOP_NAMES.get(arch, _HF_TOP_NAMES).items()}
    block = {v: k for k, v in _HYBRID_BLOCK_NAMES[arch].items() if "stacked" not in k}
    prefix = "backbone.layers" if arch == "mamba2" else "model.layers"
    params = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for i, kind in enumerate(c.mixer_types):
        if kind == "gated_deltanet":
            p = f"blocks.{i}.attn."
            layer = {n.removeprefix(p): params.pop(n) for n in list(params) if n.startswith(p)}
            fused = gated_deltanet_to_qwen3_next(
                layer, c.delta_n_heads, c.delta_n_v_heads, c.delta_head_dim, c.delta_v_head_dim
            )
            out.update({f"{prefix}.{i}.linear_attn.{n}": t for n, t in fused.items()})
    for n, t in params.items():
        m = _LM_BLOCK.fullmatch(n)
        if n in top:
            out[top[n]] = t
        elif (
            m
            and c.is_moe_layer(int(m.group(1)))
            and m.group(2) in ("ffn.gate_proj.weight", "ffn.up_proj.weight", "ffn.down_proj.weight")
        ):
            out.update(unstack_experts(n, t, arch))
        elif m and m.group(2) in block:
            out[f"{prefix}.{m.group(1)}.{block[m.group(2)]}"] = t
        else:
            raise KeyError(f"lmstack parameter {n!r} has no HF name in a {arch} checkpoint")
    return out
