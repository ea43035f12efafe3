"""Pieces the recurrent token mixers share: the short causal convolution with its carried inputs,
the gated RMSNorm, and reading a layer's state from the cache (CS336 notes "注意力机制": Mamba-2, Gated DeltaNet)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.cache import Ability, has
from lmstack.model.seam import AttentionMetadata


def causal_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution over time with its carried inputs.

    x: (B, T, Cd); weight (Cd, 1, Kc); state (B, Cd, Kc − 1): the previous call's last inputs (None = zeros).
    Returns y (B, T, Cd) and the new state (B, Cd, Kc − 1)."""
    B, T, Cd = x.shape
    Kc = weight.shape[-1]
    xt = x.transpose(1, 2)  # (B, Cd, T)
    if state is None:
        state = xt.new_zeros(B, Cd, Kc - 1)
    elif tuple(state.shape) != (B, Cd, Kc - 1):
        raise ValueError(
            f"conv state has shape {tuple(state.shape)}, expected (B, channels, conv_kernel - 1) = "
            f"{(B, Cd, Kc - 1)}"
        )
    padded = torch.cat([state.to(xt.dtype), xt], dim=-1)  # (B, Cd, Kc − 1 + T)
    if (
        T <= Kc
    ):  # decode: a few multiply-adds per channel; F.conv1d's setup costs more than the work
        y = (padded.unfold(-1, Kc, 1) * weight.view(Cd, 1, Kc)).sum(-1)  # (B, Cd, T)
        y = y if bias is None else y + bias[:, None]
    else:
        y = F.conv1d(padded, weight, bias, groups=Cd)  # (B, Cd, T)
    return y.transpose(1, 2), padded[..., padded.shape[-1] - (Kc - 1) :]


def gated_rms_norm(
    y: Tensor, z: Tensor, weight: Tensor, eps: float, group: int, norm_first: bool
) -> Tensor:
    """RMSNorm over groups of ``group`` channels, gated by silu(z): norm(y)·γ·silu(z) (Gated DeltaNet,
    ``norm_first``) or norm(y·silu(z))·γ (Mamba-2). In fp32 (fp64 for an fp64 y), returned in y's dtype."""
    dtype = y.dtype
    c = torch.float64 if dtype == torch.float64 else torch.float32
    y32, g = y.to(c), F.silu(z.to(c))
    if not norm_first:
        y32 = y32 * g
    shape = y32.shape
    y32 = y32.view(*shape[:-1], -1, group)
    y32 = (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)).view(shape)
    if norm_first:
        return ((weight * y32.to(dtype)).to(c) * g).to(dtype)
    return weight * y32.to(dtype)


def cached_state(meta: AttentionMetadata, layer_idx: int, kind: str):
    """The layer's recurrent state from ``meta.cache`` (None: no cache, or the first call)."""
    if meta.cache is None:
        return None
    if not has(meta.cache, Ability.RECURRENT_STATE):
        raise TypeError(
            f"layer {layer_idx} ({kind}) keeps a recurrent state, which {type(meta.cache).__name__} "
            "cannot hold (no Ability.RECURRENT_STATE); decode hybrids with "
            "lmstack.inference.kv_cache.MixerCache"
        )
    return meta.cache.get_state(layer_idx)


def per_document(fn, x: Tensor, document_ids: Tensor) -> Tensor:
    """Run ``fn`` ((1, T_doc, D) -> (1, T_doc, D), from a fresh state) on each packed document of each row:
    a recurrent state must not carry from one document into the next. x (B, T, D), document_ids (B, T)."""
    rows = []
    for b in range(x.shape[0]):
        ids = document_ids[b]
        cuts = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist(), ids.shape[0]]
        rows.append(torch.cat([fn(x[b : b + 1, s:e]) for s, e in zip(cuts, cuts[1:])], dim=1))
    return torch.cat(rows, dim=0)


class NormWeight(nn.Module):
    """Holds a gated norm's γ under the HF name ``norm.weight`` (applied by ``gated_rms_norm``)."""

    def __init__(
        self, n: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, device=device, dtype=dtype))


class RecurrentMixer(nn.Module):
    """A token mixer with a recurrent state: subclasses define ``mix(x, state) -> (y, new_state)``
    (state None = zeros); ``forward`` takes the state from / gives it to ``meta.cache`` and restarts it
    at every packed document boundary. A cache declaring ``Ability.RECURRENT_BATCH`` (the serving engine's
    ``inference.state_pool.RecurrentBatch``: several packed sequences, a state each) runs ``mix`` itself through
    its ``recurrent(layer_idx, x, mix) -> y``; any other cache must declare ``Ability.RECURRENT_STATE``."""

    kind = "recurrent"
    layer_idx = 0

    def mix(self, x: Tensor, state) -> tuple[Tensor, tuple]:
        raise NotImplementedError

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        if has(meta.cache, Ability.RECURRENT_BATCH):  # the engine's batch: a state per sequence
            return meta.cache.recurrent(self.layer_idx, x, self.mix)
        if meta.document_ids is not None:
            if meta.cache is not None:
                raise ValueError(
                    f"layer {self.layer_idx} ({self.kind}): document_ids with a cache; a MixerCache "
                    "holds one sequence per row"
                )
            return per_document(lambda seg: self.mix(seg, None)[0], x, meta.document_ids)
        y, state = self.mix(x, cached_state(meta, self.layer_idx, self.kind))
        if meta.cache is not None:
            meta.cache.set_state(self.layer_idx, state)
        return y
