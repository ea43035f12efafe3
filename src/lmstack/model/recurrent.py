"""Pieces the recurrent token mixers share: the short causal convolution with its carried inputs,
the gated RMSNorm, and reading a layer's state from the cache (seed 001 "注意力机制": Mamba-2, Gated DeltaNet)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lmstack.model.seam import AttentionMetadata


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution over time with its carried inputs.

    x: (B, T, Cd); weight (Cd, 1, Kc); state (B, Cd, Kc − 1): the previous call's last inputs (None = zeros).
    Returns y (B, T, Cd) and the new state (B, Cd, Kc − 1)."""
    B, T, Cd = x.shape
    Kc = weight.shape[-1]
    xt = x.transpose(1, 2)  # (B, Cd, T)
    if state is None:
        state = xt.new_zeros(B, Cd, Kc - 1)
    elif tuple(state.shape) != (B, Cd, Kc - 1):
        raise ValueError(f"conv state has shape {tuple(state.shape)}, expected (B, channels, conv_kernel - 1) = "
                         f"{(B, Cd, Kc - 1)}")
    padded = torch.cat([state.to(xt.dtype), xt], dim=-1)  # (B, Cd, Kc − 1 + T)
    y = F.conv1d(padded, weight, bias, groups=Cd)  # (B, Cd, T)
    return y.transpose(1, 2), padded[..., padded.shape[-1] - (Kc - 1):]


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, eps: float, group: int, norm_first: bool) -> Tensor:
    """RMSNorm over groups of ``group`` channels, gated by silu(z): norm(y)·γ·silu(z) (Gated DeltaNet,
    ``norm_first``) or norm(y·silu(z))·γ (Mamba-2). In fp32, returned in y's dtype."""
    dtype = y.dtype
    y32, g = y.float(), F.silu(z.float())
    if not norm_first:
        y32 = y32 * g
    shape = y32.shape
    y32 = y32.view(*shape[:-1], -1, group)
    y32 = (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)).view(shape)
    if norm_first:
        return ((weight * y32.to(dtype)).float() * g).to(dtype)
    return weight * y32.to(dtype)


def reject_packing(meta: AttentionMetadata, layer_idx: int, kind: str) -> None:
    if meta.document_ids is not None:
        raise ValueError(f"layer {layer_idx} ({kind}): packed documents (document_ids) are not supported by "
                         "recurrent mixers; train on unpacked rows")


def cached_state(meta: AttentionMetadata, layer_idx: int, kind: str):
    """The layer's recurrent state from ``meta.cache`` (None: no cache, or the first call)."""
    if meta.cache is None:
        return None
    if not hasattr(meta.cache, "get_state"):
        raise TypeError(f"layer {layer_idx} ({kind}) keeps a recurrent state, which {type(meta.cache).__name__} "
                        "cannot hold; decode hybrids with lmstack.model.mixers.MixerCache")
    return meta.cache.get_state(layer_idx)
