"""Collectives on torch.distributed: ring all-reduce = reduce-scatter + all-gather, byte
counting, and autograd-aware collectives whose backward is the dual.

Book of LLMs §6.2 (broadcast, all-gather, reduce-scatter, all-reduce; ring all-reduce as
reduce-scatter + all-gather, each device talking only to its two neighbours; the duality
all-gather ↔ reduce-scatter and all-reduce ↔ all-reduce), CS336 notes "基本操作"
(all-reduce as reduce-scatter + all-gather costs 2(M-1)/M · n per device instead of (M-1) · n).

Two layers:

- ``ring_reduce_scatter`` / ``ring_all_gather`` / ``ring_all_reduce`` are the seed's algorithm
  written on point-to-point send/recv, so the bytes each rank sends can be counted
  (``CommCounter``) and compared with ``lmstack.accounting.comm``.
- ``reduce_scatter`` / ``all_gather`` / ``all_reduce`` are what the strategies call: the ring
  when ``impl="ring"`` (or inside ``count_bytes()``), torch's collective otherwise.
  Torch's collectives are counted with the same ring formula only when the caller opts in.

The autograd functions (``AllGatherFn`` …) are the building blocks of ZeRO-3, tensor and
sequence parallelism: the forward collective and its backward dual live in one place.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

# ---- byte counting ----------------------------------------------------------------------------


@dataclass
class CommCounter:
    """Bytes this rank sent, by collective kind ("all_reduce", "reduce_scatter", ...)."""

    sent: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.sent.values())


_state = threading.local()


def _counter() -> CommCounter | None:
    return getattr(_state, "counter", None)


def record_bytes(kind: str, nbytes: int) -> None:
    """Add ``nbytes`` sent by a ``kind`` collective to the ``count_bytes()`` counter, if one is active."""
    c = _counter()
    if c is not None:
        c.add(kind, nbytes)


@contextlib.contextmanager
def count_bytes():
    """Count the bytes this rank sends; inside it every collective here runs the ring on
    send/recv so the count is a measurement, not a formula.

        with count_bytes() as c:
            train_step()
        c.total  # bytes sent by this rank
    """
    prev = _counter()
    c = CommCounter()
    _state.counter = c
    try:
        yield c
    finally:
        _state.counter = prev


def group_ranks(group) -> tuple[int, int, list[int]]:
    """(my index in the group, group size, global ranks of the group in order)."""
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    return ranks.index(dist.get_rank()), len(ranks), ranks


def send_recv(send: Tensor, dst: int, recv: Tensor, src: int, kind: str) -> None:
    """Send to ``dst`` and receive from ``src`` at once (isend first, so a ring never deadlocks)."""
    req = dist.isend(send.contiguous(), dst)
    dist.recv(recv, src)
    req.wait()
    c = _counter()
    if c is not None:
        c.add(kind, send.numel() * send.element_size())


def _chunks(n: int, M: int) -> list[tuple[int, int]]:
    """Split n elements into M contiguous chunks as evenly as possible: [(start, length)]."""
    base, extra = divmod(n, M)
    out, start = [], 0
    for i in range(M):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out


# ---- the ring (Book of LLMs §6.2 “collectives”) -------------------------------------------------------------------


def ring_reduce_scatter_(flat: Tensor, group=None, kind: str = "reduce_scatter") -> tuple[int, int]:
    """In-place ring reduce-scatter of a 1-D tensor over the M ranks of ``group``.

    Step t = 0..M-2: rank i sends chunk (i - 1 - t) mod M to rank i+1 and adds the chunk
    (i - 2 - t) mod M it receives from rank i-1. After M-1 steps rank i holds the full sum of
    chunk i; every rank sent M-1 chunks = (M-1)/M · n elements.
    Returns (start, length) of chunk i.
    """
    me, M, ranks = group_ranks(group)
    chunks = _chunks(flat.numel(), M)
    if M == 1:
        return chunks[0]
    nxt, prv = ranks[(me + 1) % M], ranks[(me - 1) % M]
    for t in range(M - 1):
        s_start, s_len = chunks[(me - 1 - t) % M]
        r_start, r_len = chunks[(me - 2 - t) % M]
        buf = torch.empty(r_len, dtype=flat.dtype, device=flat.device)
        send_recv(flat[s_start : s_start + s_len], nxt, buf, prv, kind)
        flat[r_start : r_start + r_len] += buf
    return chunks[me]


def ring_all_gather_(flat: Tensor, owned: int, group=None, kind: str = "all_gather") -> None:
    """In-place ring all-gather: rank i starts owning chunk ``owned``; step t it forwards the
    chunk it got last step to rank i+1. Each rank sends (M-1)/M · n elements."""
    me, M, ranks = group_ranks(group)
    if M == 1:
        return
    chunks = _chunks(flat.numel(), M)
    nxt, prv = ranks[(me + 1) % M], ranks[(me - 1) % M]
    # rank j owns chunk (owned - me + j): the offset is the same on every rank
    for t in range(M - 1):
        s_start, s_len = chunks[(owned - t) % M]
        r_start, r_len = chunks[(owned - t - 1) % M]
        buf = torch.empty(r_len, dtype=flat.dtype, device=flat.device)
        send_recv(flat[s_start : s_start + s_len], nxt, buf, prv, kind)
        flat[r_start : r_start + r_len] = buf


def ring_all_reduce_(t: Tensor, group=None) -> Tensor:
    """Book of LLMs §6.2 “collectives” Ring All-Reduce = Reduce-Scatter + All-Gather, in place (sum).
    Each rank sends 2(M-1)/M · n elements in 2(M-1) steps (``accounting.comm.all_reduce_bytes``)."""
    flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
    me, M, _ = group_ranks(group)
    if M > 1:
        ring_reduce_scatter_(flat, group, kind="all_reduce")  # rank i holds the sum of chunk i
        ring_all_gather_(flat, me, group, kind="all_reduce")
    if flat.data_ptr() != t.data_ptr():
        t.copy_(flat.view_as(t))
    return t


# ---- the collectives the strategies call ---------------------------------------------------------


def use_ring(impl: str) -> bool:
    if impl not in ("auto", "ring", "torch"):
        raise ValueError(f"impl={impl!r}; expected 'auto', 'ring' or 'torch'")
    return impl == "ring" or (impl == "auto" and _counter() is not None)


def comm_device(group=None) -> torch.device:
    """Where small bookkeeping tensors (losses, norms, timings) must live for ``group``'s backend:
    the current CUDA device under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def all_reduce(t: Tensor, group=None, impl: str = "auto", async_op: bool = False):
    """Sum ``t`` over ``group`` in place. Returns a work handle when ``async_op`` (torch path)."""
    if group_size(group) == 1:
        return None
    if use_ring(impl):
        ring_all_reduce_(t, group)
        return None
    return dist.all_reduce(t, group=group, async_op=async_op)


def reduce_scatter(inp: Tensor, group=None, impl: str = "auto") -> Tensor:
    """1-D ``inp`` of M·c elements -> the sum of chunk ``rank`` (c elements) over the group."""
    me, M, _ = group_ranks(group)
    if inp.numel() % M:
        raise ValueError(
            f"reduce_scatter: {inp.numel()} elements do not divide into M={M} equal shards"
        )
    c = inp.numel() // M
    if M == 1:
        return inp.reshape(-1).clone()
    if use_ring(impl):
        flat = inp.reshape(-1).clone()
        start, length = ring_reduce_scatter_(flat, group)
        return flat[start : start + length].clone()
    out = torch.empty(c, dtype=inp.dtype, device=inp.device)
    reduce_scatter_into(out, inp.reshape(-1).contiguous(), group)
    return out


def all_gather(shard: Tensor, group=None, impl: str = "auto", out: Tensor | None = None) -> Tensor:
    """1-D ``shard`` of c elements from every rank -> M·c elements in rank order."""
    me, M, _ = group_ranks(group)
    c = shard.numel()
    if out is None:
        out = torch.empty(M * c, dtype=shard.dtype, device=shard.device)
    if M == 1:
        out.copy_(shard.reshape(-1))
        return out
    if use_ring(impl):
        out[me * c : (me + 1) * c] = shard.reshape(-1)
        ring_all_gather_(out, me, group)
        return out
    all_gather_into(out, shard.reshape(-1).contiguous(), group)
    return out


def reduce_scatter_into(out: Tensor, inp: Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def all_gather_into(out: Tensor, inp: Tensor, group, async_op: bool = False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def broadcast(t: Tensor, src_in_group: int = 0, group=None) -> Tensor:
    """Book of LLMs §6.2 “collectives” Broadcast: the group's rank ``src_in_group`` sends the same data to all."""
    _, M, ranks = group_ranks(group)
    if M > 1:
        dist.broadcast(t, src=ranks[src_in_group], group=group)
    return t


# ---- along a tensor dimension (sequence parallelism, vocab shards) -------------------------------


def all_gather_dim(x: Tensor, dim: int, group=None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (all ranks' shapes equal)."""
    _, M, _ = group_ranks(group)
    if M == 1:
        return x
    xt = x.movedim(dim, 0).contiguous()  # (s, ...)
    out = all_gather(xt.reshape(-1), group)  # (M·s·...)
    return out.view(M * xt.shape[0], *xt.shape[1:]).movedim(0, dim)


def reduce_scatter_dim(x: Tensor, dim: int, group=None) -> Tensor:
    """Sum over ranks, keep this rank's 1/M slice of ``dim``."""
    me, M, _ = group_ranks(group)
    if M == 1:
        return x
    if x.shape[dim] % M:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not divide into M={M} shards")
    xt = x.movedim(dim, 0).contiguous()
    out = reduce_scatter(xt.reshape(-1), group)
    return out.view(xt.shape[0] // M, *xt.shape[1:]).movedim(0, dim)


def split_dim(x: Tensor, dim: int, group=None) -> Tensor:
    """This rank's 1/M slice of ``dim`` (no communication)."""
    me, M, _ = group_ranks(group)
    if x.shape[dim] % M:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not divide into M={M} shards")
    return x.chunk(M, dim=dim)[me].contiguous()


# ---- autograd duals (Book of LLMs §6.2 "前后向对偶性") ---------------------------------------------


class AllGatherFn(torch.autograd.Function):
    """Forward all-gather along ``dim`` (removes sharding, A[I_X] -> A[I]); backward
    reduce-scatter (the fan-out's gradients are summed back onto the owning shard)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return reduce_scatter_dim(g, ctx.dim, ctx.group), None, None


class ReduceScatterFn(torch.autograd.Function):
    """Forward reduce-scatter along ``dim`` (adds sharding, A[I]{U_X} -> A[I_X]); backward
    all-gather (the sum's gradient is copied back to every addend)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return all_gather_dim(g.contiguous(), ctx.dim, ctx.group), None, None


class AllReduceFn(torch.autograd.Function):
    """Forward all-reduce (A{U_X} -> A), backward all-reduce (Book of LLMs §6.2 “collectives”: "All-Reduce 的反向
    传播是另一个完全相同的 All-Reduce"): right when each rank's copy of the output feeds a
    different rank-local loss and the objective is the sum of those losses. When the ranks'
    downstream work is identical (Megatron's g), use ``ReduceFromParallelFn`` instead."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        y = x.clone()
        all_reduce(y, group)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.clone()
        all_reduce(g, ctx.group)
        return g, None


class CopyToParallelFn(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward (every rank's partial input gradient
    is summed) — the input side of a column-parallel region (CS336 notes "张量并行": f and g swap
    in backward)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.clone()
        all_reduce(g, ctx.group)
        return g, None


class ReduceFromParallelFn(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum the row-parallel partial outputs), identity
    backward (the gradient of a sum is copied to each addend)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        y = x.clone()
        all_reduce(y, group)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


class GatherFn(torch.autograd.Function):
    """All-gather ``dim`` forward; keep this rank's slice of the gradient backward (for outputs
    that every rank uses identically, e.g. gathering vocab-sharded logits for a replicated loss)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x.contiguous(), dim, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return split_dim(g, ctx.dim, ctx.group), None, None
