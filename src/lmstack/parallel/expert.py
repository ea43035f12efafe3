"""Expert parallelism seam: all-to-all dispatch and combine of routed tokens.

Seed 001 "专家并行": experts live on different devices and each token's hidden state is sent to
the device of the expert it was routed to; EP shares the data-parallel ranks (EP ≤ DP). The MoE
model lands with its own issue; this module is the communication half it plugs into:

    recv, meta = dispatch(x, expert_ids, n_experts, group)   # tokens grouped by owning rank
    y_local = run_my_experts(recv, meta.local_expert_ids)    # (n_recv, D)
    y = combine(y_local, meta, group)                        # back in the original token order

Rank r owns experts [r·E/ep, (r+1)·E/ep). Both directions are differentiable: the backward of
an all-to-all is the reverse all-to-all (the same duality as all-gather / reduce-scatter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lmstack.parallel import collectives as C


@dataclass
class DispatchMeta:
    order: Tensor  # permutation that sorts tokens by destination rank
    send_counts: list[int]
    recv_counts: list[int]
    local_expert_ids: Tensor  # (n_recv,) expert id (global) of each received token


def _all_to_all(x: Tensor, send_counts: list[int], recv_counts: list[int], group) -> Tensor:
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    if C.group_size(group) == 1:
        out.copy_(x)
        return out
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, send_counts: list[int], recv_counts: list[int], group) -> Tensor:
        ctx.args = (send_counts, recv_counts, group)
        return _all_to_all(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        send_counts, recv_counts, group = ctx.args
        return _all_to_all(g.contiguous(), recv_counts, send_counts, group), None, None, None


def dispatch(x: Tensor, expert_ids: Tensor, n_experts: int, group=None) -> tuple[Tensor, DispatchMeta]:
    """x (T, D) tokens (one row per token-expert assignment), expert_ids (T,) -> the rows this rank's
    experts must process, (n_recv, D), and the metadata to send results back."""
    M = C.group_size(group)
    if n_experts % M:
        raise ValueError(f"expert parallelism: n_experts={n_experts} is not divisible by ep={M}")
    per = n_experts // M
    dest = expert_ids // per  # (T,) owning rank
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=M)
    recv_counts = send_counts.clone()
    if M > 1:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    recv = _AllToAll.apply(x[order], sc, rc, group)
    ids = _all_to_all(expert_ids[order][:, None], sc, rc, group)[:, 0]
    return recv, DispatchMeta(order, sc, rc, ids)


def combine(y: Tensor, meta: DispatchMeta, group=None) -> Tensor:
    """Send expert outputs (n_recv, D) back to their tokens' ranks, restoring the token order."""
    back = _AllToAll.apply(y, meta.recv_counts, meta.send_counts, group)  # (T, D) in sorted order
    return torch.zeros_like(back).index_add(0, meta.order, back)  # out[order[j]] = back[j]
