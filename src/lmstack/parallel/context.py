"""Context parallelism: ring attention over sequence shards, causal and load-balanced.

CS336 notes "序列并行和上下文并行": context parallelism goes beyond sequence parallelism and also
splits the attention's activations (the keys/values) along the sequence; ring attention passes
the K/V shards around a ring, like the ring all-reduce. Book of LLMs §2.7 (online softmax): partial
results over disjoint key sets merge exactly through their log-sum-exp:

    lse = log(e^lse_a + e^lse_b),  O = e^(lse_a - lse) · O_a + e^(lse_b - lse) · O_b

Load balance: with a causal mask the last positions attend to the most keys. The sequence is
cut into 2·cp chunks and rank r takes chunks r and 2·cp-1-r, so every rank does the same work.

``context_parallel(model, group)`` sets ``RingAttention`` as the model's attention implementation
(behind the attention seam, the model's forward unchanged); ``ContextParallel`` picks this rank's tokens and positions and
returns its logits (B, S/cp, V). The loss over local tokens, averaged over the cp ranks (they
hold equal token counts), is the full-sequence mean; gradients are averaged over dp×cp.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lmstack.kernels.runtime import install_attention
from lmstack.model.mixer_spec import refuse
from lmstack.model.seam import AttentionMetadata
from lmstack.parallel import collectives as C


def load_balanced_positions(S: int, cp: int, rank: int) -> Tensor:
    """Positions of rank ``rank``'s tokens: chunks r and 2·cp-1-r of 2·cp equal chunks."""
    if S % (2 * cp):
        raise ValueError(f"context parallelism: S={S} must be divisible by 2·cp = {2 * cp}")
    c = S // (2 * cp)
    a, b = rank, 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)]
    )  # (S/cp,)


class _RingShift(torch.autograd.Function):
    """Forward: send x to the next rank of the ring, receive the previous rank's. Backward: the
    gradient travels the other way (send to the previous, receive from the next)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _shift(g.contiguous(), ctx.group, -1), None


def _shift(x: Tensor, group, direction: int) -> Tensor:
    me, M, ranks = C.group_ranks(group)
    out = torch.empty_like(x)
    C.send_recv(
        x.contiguous(),
        ranks[(me + direction) % M],
        out,
        ranks[(me - direction) % M],
        "ring_attention",
    )
    return out


def _block_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor
) -> tuple[Tensor, Tensor]:
    """Causal attention of q (B, N, T, H) over one key block k, v (B, N, Tk, H) in fp32.
    Returns O (B, N, T, H) normalised within the block and its lse (B, N, T); a query that sees no
    key of this block gets O = 0, lse = -inf."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, N, T, Tk)
    visible = k_pos[None, :] <= q_pos[:, None]  # (T, Tk)
    s = s.masked_fill(~visible, -torch.inf)
    m = s.amax(dim=-1, keepdim=True)  # (B, N, T, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    p = torch.exp(s - m)  # masked -> 0
    l = p.sum(-1, keepdim=True)  # (B, N, T, 1)
    o = (p @ v.float()) / l.clamp_min(1e-30)
    lse = torch.where(l > 0, m + torch.log(l.clamp_min(1e-30)), torch.full_like(l, -torch.inf))
    return o, lse[..., 0]


def _merge(
    o: Tensor | None, lse: Tensor | None, o_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Log-sum-exp merge of two partial attention results over disjoint key sets."""
    if o is None:
        return o_b, lse_b
    new = torch.logaddexp(lse, lse_b)  # (B, N, T)
    new_safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    wa = torch.exp(lse - new_safe)[..., None]
    wb = torch.exp(lse_b - new_safe)[..., None]
    return wa * o + wb * o_b, new


def ring_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, group) -> Tensor:
    """q (B, N, T, H), k/v (B, N, T, H) (GQA already expanded) and their absolute positions (T,)
    on each of the cp ranks -> causal attention output over the whole sequence, (B, N, T, H).
    cp - 1 ring steps; each step merges one block's partial result by log-sum-exp."""
    M = C.group_size(group)
    o = lse = None
    kv = torch.stack([k, v])  # (2, B, N, T, H): one message per step
    kp = k_pos
    for step in range(M):
        o_b, lse_b = _block_attention(q, kv[0], kv[1], q_pos, kp)
        o, lse = _merge(o, lse, o_b, lse_b)
        if step < M - 1:
            kv = _RingShift.apply(kv, group)
            kp = _shift(kp, group, +1)
    return o.to(q.dtype)


class RingAttention:
    """The attention implementation (``lmstack.model.seam.AttentionImpl``) of context parallelism:
    causal attention over every cp rank's keys with ``ring_attention``; the model's own ``Attention``
    computes q, k, v as always."""

    name = "ring"

    def __init__(self, group):
        self.group = group

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        # q (B, N, T, H), k/v (B, K, T, H): this rank's tokens -> (B, N, T, H)
        if (
            meta.key_positions is not None
            or meta.document_ids is not None
            or meta.window is not None
        ):
            raise ValueError(
                "context parallelism: kv caches, document_ids and sliding windows are not supported"
            )
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, N, T, H)
        pos = meta.positions if meta.positions.dim() == 1 else meta.positions[0]
        return ring_attention(q, k, v, pos, pos, self.group)


def context_parallel(model: nn.Module, group) -> nn.Module:
    """Run every layer's attention as ``RingAttention`` over ``group`` (the model's own forward). A layer whose
    spec says ring attention cannot run it (``model.mixer_spec``: recurrent mixers, which would get two
    non-contiguous chunks; local windows; MLA; DSA) is refused by name, and so is a soft-capped one
    (``RingAttention`` does not apply ``meta.softcap``: ``Transformer.set_attention`` refuses it)."""
    if model.config.sliding_window is not None:
        raise ValueError("context parallelism: sliding-window attention is not supported")
    refuse(model.config, "context_parallel", "context parallelism")
    if not isinstance(model.attention, RingAttention):
        install_attention(model, RingAttention(group))
    return model


class ContextParallel(nn.Module):
    """tokens (B, S) (the full sequence, same on every cp rank) -> this rank's logits (B, S/cp, V)
    at positions ``self.positions(S)``; use ``shard(targets)`` for the matching targets."""

    def __init__(self, model: nn.Module, group):
        super().__init__()
        self.module = context_parallel(model, group)
        self.group = group
        self.rank = C.group_ranks(group)[0] if C.group_size(group) > 1 else 0
        self.cp = C.group_size(group)

    def positions(self, S: int) -> Tensor:
        return load_balanced_positions(S, self.cp, self.rank)

    def shard(self, t: Tensor) -> Tensor:
        """This rank's tokens of a (B, S, ...) tensor."""
        return t[:, self.positions(t.shape[1])]

    def forward(
        self, tokens: Tensor, positions: Tensor | None = None, document_ids: Tensor | None = None
    ) -> Tensor:
        """Training mode: this rank's logits (B, S/cp, V). Eval mode: the logits of every rank
        all-gathered back into sequence order, (B, S, V), so an evaluation loop needs no change."""
        if positions is not None or document_ids is not None:
            raise ValueError(
                "context parallelism: positions/document_ids (packing) are not supported; "
                "the cp wrapper assigns the positions of its load-balanced chunks"
            )
        S = tokens.shape[1]
        pos = self.positions(S)
        logits = self.module(tokens[:, pos], positions=pos)  # (B, S/cp, V)
        if self.training or self.cp == 1:
            return logits
        every = C.all_gather_dim(logits.contiguous(), 1, self.group)  # (B, S, V) in rank order
        order = torch.cat([load_balanced_positions(S, self.cp, r) for r in range(self.cp)]).to(
            logits.device
        )
        out = torch.empty_like(every)
        out[:, order] = every
        return out
