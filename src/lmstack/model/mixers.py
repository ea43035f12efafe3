"""Per-layer token mixers beyond global softmax attention, and the cache that serves them.

Seed 001 "注意力机制" (linear attention, Mamba-2, Gated DeltaNet, 3:1 linear:full hybrids, DSA),
"推理时注意力开销" (grouped sliding window: local layers with one global layer in a group);
seed 000 §1.9 (sliding window), §2.5 (local attention shrinks the KV cache).

``build_mixer(config, layer_idx, rope)`` is what ``transformer.token_mixer`` calls: it reads the layer's kind
(``mixer_spec.layer_kinds``: ``config.mixer_types``, MLA for an MLA model's attention layers) and builds
``MODULES[kind]``. Every mixer maps ``(x (B, T, D), meta) -> (B, T, D)``. What a kind costs, caches and
supports is its spec (``model.mixer_spec.SPECS``); adding a mixer = its module, its spec, its line here.

``MixerCache`` is a per-sequence cache for hybrids: attention layers keep K/V (a local layer only its
last W − 1), recurrent layers keep an O(1) state (plus the short convolution's last K − 1 inputs).
Pass it as ``kv_cache=``; prefill and decode then continue exactly where the last call stopped.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from lmstack.model.attention import Attention
from lmstack.model.config import ModelConfig
from lmstack.model.deltanet import GatedDeltaNet
from lmstack.model.dsa import SparseAttention
from lmstack.model.layers import RotaryEmbedding
from lmstack.model.linear_attention import LinearAttention
from lmstack.model.mamba2 import Mamba2Mixer
from lmstack.model.mixer_spec import SPECS, layer_kinds
from lmstack.model.mla import MLA
from lmstack.model.olmoe import OlmoeAttention
from lmstack.model.seam import AttentionImpl, AttentionMetadata, StoreThenAttend
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
MODULES = {
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


def build_mixer(config: ModelConfig, layer_idx: int, rope: RotaryEmbedding, **kw) -> nn.Module:
    """Layer ``layer_idx``'s token mixer: ``MODULES[kind]`` for its kind (``mixer_spec.layer_kinds``)."""
    return MODULES[layer_kinds(config)[layer_idx]](config, layer_idx, rope, **kw)


# ---- the cache -----------------------------------------------------------------------------------
class MixerCache(StoreThenAttend):
    """One sequence per row: K/V for attention layers (the last W − 1 for windowed ones), recurrent (and conv)
    states for the others. K/V live in buffers that grow by doubling, so a decode step writes one position
    instead of copying the whole cache. ``nbytes()`` reports what it holds (the used positions)."""

    def __init__(self) -> None:
        self._kv: dict[int, list] = {}  # layer -> [k (B, K, cap, H), v, positions (B, cap), n used]
        self.states: dict[int, tuple[Tensor, ...]] = {}
        self.extra: dict[tuple[int, str], Tensor] = {}  # e.g. DSA's indexer keys

    @property
    def kv(self) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """layer -> (k (B, K, S, H), v, positions (B, S)) of the held positions."""
        return {i: (k[:, :, :n], v[:, :, :n], p[:, :n]) for i, (k, v, p, n) in self._kv.items()}

    def update(
        self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        B, K, T, H = k.shape
        if positions.dim() == 1:
            positions = positions.expand(B, -1)
        entry = self._kv.get(layer_idx)
        n = 0 if entry is None else entry[3]
        if entry is None or n + T > entry[0].shape[2]:
            cap = max(16, n + T, 2 * (0 if entry is None else entry[0].shape[2]))
            kb, vb = k.new_empty(B, K, cap, H), v.new_empty(B, K, cap, v.shape[-1])
            pb = positions.new_full((B, cap), -1)
            if entry is not None:
                kb[:, :, :n], vb[:, :, :n], pb[:, :n] = (
                    entry[0][:, :, :n],
                    entry[1][:, :, :n],
                    entry[2][:, :n],
                )
            entry = self._kv[layer_idx] = [kb, vb, pb, n]
        kb, vb, pb, _ = entry
        kb[:, :, n : n + T], vb[:, :, n : n + T], pb[:, n : n + T] = k, v, positions
        entry[3] = n + T
        return kb[:, :, : n + T], vb[:, :, : n + T], pb[:, : n + T]

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
    ) -> Tensor:
        out = super().attend(layer_idx, q, k, v, meta, impl)
        entry = self._kv[layer_idx]
        keep = None if meta.window is None else max(meta.window - 1, 0)
        if (
            keep is not None and entry[3] > keep
        ):  # later queries never see more than the last W − 1 keys
            kb, vb, pb, n = entry
            kb[:, :, :keep], vb[:, :, :keep], pb[:, :keep] = (
                kb[:, :, n - keep : n].clone(),
                vb[:, :, n - keep : n].clone(),
                pb[:, n - keep : n].clone(),
            )
            entry[3] = keep
        return out

    def get_state(self, layer_idx: int):
        return self.states.get(layer_idx)

    def set_state(self, layer_idx: int, state: tuple[Tensor, ...]) -> None:
        self.states[layer_idx] = state

    def nbytes(self) -> dict[str, int]:
        """Bytes held: K/V (positions excluded), recurrent states, and extra per-layer tensors."""
        kv = sum(
            k.numel() * k.element_size() + v.numel() * v.element_size()
            for k, v, _ in self.kv.values()
        )
        st = sum(t.numel() * t.element_size() for s in self.states.values() for t in s)
        ex = sum(t.numel() * t.element_size() for t in self.extra.values())
        return {"kv": kv, "state": st, "extra": ex}


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
