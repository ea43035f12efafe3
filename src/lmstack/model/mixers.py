"""Per-layer token mixers beyond global softmax attention, and the cache that serves them.

CS336 notes "注意力机制" (linear attention, Mamba-2, Gated DeltaNet, 3:1 linear:full hybrids, DSA),
"推理时注意力开销" (grouped sliding window: local layers with one global layer in a group);
Book of LLMs §1.9 (sliding window), §2.5 (local attention shrinks the KV cache).

``build_mixer(config, layer_idx, rope)`` is what ``transformer.token_mixer`` calls: it reads the layer's kind
(``mixer_spec.layer_kinds``: ``config.mixer_types``, MLA for an MLA model's attention layers) and builds
``MODULES[kind]``. Every mixer maps ``(x (B, T, D), meta) -> (B, T, D)``. What a kind costs, caches and
supports is its spec (``model.mixer_spec.SPECS``); adding a mixer = its module, its spec, its line here.

The per-sequence cache for hybrids (K/V for attention layers, recurrent states for the others) is
``inference.kv_cache.MixerCache``, with the other caches (``model.cache``: the contract).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lmstack.model.attention import Attention
from lmstack.model.config import ModelConfig
from lmstack.model.deltanet import GatedDeltaNet
from lmstack.model.dsa import SparseAttention
from lmstack.model.layers import RotaryEmbedding
from lmstack.model.linear_attention import LinearAttention
from lmstack.model.mamba2 import Mamba2Mixer
from lmstack.model.mixer_spec import SPECS, MixerSpec, layer_kinds, register
from lmstack.model.mla import MLA
from lmstack.model.olmoe import OlmoeAttention
from lmstack.model.seam import AttentionMetadata
from lmstack.model.variants import VariantAttention, uses_variant_attention


class LocalAttention(Attention):
    """Softmax attention restricted to a sliding window of W positions (Gemma-style local layers).
    The window is this layer's, not the model's: it replaces ``meta.window`` for this layer only."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, rope: RotaryEmbedding | None = None, **kw
    ):
        super().__init__(config, layer_idx, rope, **kw)
        self.window = config.local_window

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        return super().forward(x, dataclasses.replace(meta, window=self.window))


def softmax_attention(
    config: ModelConfig, layer_idx: int, rope: RotaryEmbedding, local: bool = False, **kw
) -> nn.Module:
    """A softmax-attention layer with the variants the config asks for: Gemma-2/3 / Qwen3-Next's
    (``model.variants``: soft-cap, output gate, own RoPE, offset QK-norm), a local window, OLMoE's whole-projection
    QK-norm and clipping (``model.olmoe``), else the plain GQA ``Attention``."""
    if uses_variant_attention(config):
        return VariantAttention(config, layer_idx, rope, **kw)
    if local:
        return LocalAttention(config, layer_idx, rope, **kw)
    if config.qk_norm_full or config.qkv_clip is not None:
        return OlmoeAttention(config, layer_idx, rope, **kw)
    return Attention(config, layer_idx, rope, **kw)


#: kind -> builder ``(config, layer_idx, rope, device=, dtype=) -> module``; the kinds are ``mixer_spec.SPECS``'
MODULES: dict[str, Callable[..., nn.Module]] = {
    "attention": softmax_attention,
    "local_attention": lambda c, i, rope, **kw: softmax_attention(c, i, rope, local=True, **kw),
    "mla": lambda c, i, rope, **kw: MLA(c, i, **kw),  # multi-head latent attention (DeepSeek-V2/V3)
    "dsa": lambda c, i, rope, **kw: SparseAttention(c, i, rope, **kw),
    "linear_attention": lambda c, i, rope, **kw: LinearAttention(c, i, **kw),
    "mamba2": lambda c, i, rope, **kw: Mamba2Mixer(c, i, **kw),
    "gated_deltanet": lambda c, i, rope, **kw: GatedDeltaNet(c, i, **kw),
}
if set(MODULES) != set(SPECS):
    raise ImportError(f"mixer modules {sorted(MODULES)} do not match the specs {sorted(SPECS)}")


def register_mixer(spec: MixerSpec, build) -> None:
    """Add a kind of token mixer from outside the package: its spec (``mixer_spec.register``) and its builder
    ``(config, layer_idx, rope, device=, dtype=) -> module`` mapping ``(x (B, T, D), meta) -> (B, T, D)``.
    ``tests/model/test_model_recipes.py`` does it with a toy mixer."""
    if spec.name in MODULES:
        raise ValueError(f"mixer {spec.name!r} already has a module; choose another name")
    register(spec)
    MODULES[spec.name] = build


def build_mixer(config: ModelConfig, layer_idx: int, rope: RotaryEmbedding, **kw) -> nn.Module:
    """Layer ``layer_idx``'s token mixer: ``MODULES[kind]`` for its kind (``mixer_spec.layer_kinds``)."""
    return MODULES[layer_kinds(config)[layer_idx]](config, layer_idx, rope, **kw)


@torch.no_grad()
def init_recurrent_parameters(model: nn.Module, seed: int = 0) -> None:
    """Reference initial values for the recurrent mixers' non-matrix parameters, which ``Transformer.init_weights``
    draws like any weight (N(0, σ²)): A = U[1, 16] (A_log = log A), Δ = exp(U[log 1e-3, log 1e-1]) through
    softplus⁻¹ into dt_bias, D = 1, conv weights U(±1/√K_c) (PyTorch's Conv1d default), conv bias 0."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, (Mamba2Mixer, GatedDeltaNet)):
            n = m.A_log.numel()
            m.A_log.copy_(torch.empty(n).uniform_(1.0, 16.0, generator=gen).log())
            dt = torch.exp(torch.empty(n).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(Δ)
            bound = m.conv1d.weight.shape[-1] ** -0.5
            m.conv1d.weight.copy_(
                torch.empty(m.conv1d.weight.shape).uniform_(-bound, bound, generator=gen)
            )
            if m.conv1d.bias is not None:
                m.conv1d.bias.zero_()
            if isinstance(m, Mamba2Mixer):
                m.D.fill_(1.0)
