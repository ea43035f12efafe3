"""Expert parallelism seam: all-to-all dispatch and combine of routed tokens.

CS336 notes "专家并行": experts live on different devices and each token's hidden state is sent to
the device of the expert it was routed to; EP shares the data-parallel ranks (EP ≤ DP). The MoE
layer (``model.moe``) computes the experts; this module is the communication half it plugs into:

    recv, meta = dispatch(x, expert_ids, n_experts, group)   # tokens grouped by owning rank
    y_local = run_my_experts(recv, meta.local_expert_ids)    # (n_recv, D)
    y = combine(y_local, meta, group)                        # back in the original token order

Rank r owns experts [r·E/ep, (r+1)·E/ep). Both directions are differentiable: the backward of
an all-to-all is the reverse all-to-all (the same duality as all-gather / reduce-scatter).

``ExpertParallelMoE`` puts the seam to work on a ``model.moe.MoE``: the router and the shared experts
stay replicated, the routed experts are sliced so each rank keeps its E/ep, and the forward is route ->
dispatch -> grouped local experts -> combine. ``expert_parallel(model, group)`` swaps every MoE layer of
a plain model; ``sync_expert_parallel_grads`` then makes one data-parallel step over the same ranks equal
to single-process training on the concatenated batch (replicated grads averaged, expert grads / ep).

Composed with data parallelism (``parallelize`` with ``ep`` in the plan; ``mesh.dp = dp·ep`` ranks split
the batch): ``shard_experts`` swaps the MoE layers and scales each expert gradient by 1/ep as it arrives
(the all-to-all backward already summed the ep group's tokens into it), ``ExpertDataParallel`` then
averages the replicated gradients over all dp·ep ranks and the expert gradients over the dp ranks that
hold the same shard (``mesh.group("edp")``); ZeRO-1/2 shard the experts' states over that same group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lmstack.model.moe import MoE, expert_swiglu
from lmstack.parallel import collectives as C
from lmstack.parallel.ddp import GradSyncWrapper


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


def _count(x: Tensor, send_counts: list[int], group) -> None:
    """Inside ``collectives.count_bytes()``: add the bytes of the rows this rank sends to *other* ranks."""
    if C.group_size(group) > 1:
        me = dist.get_rank(group)
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        C.record_bytes("all_to_all", (sum(send_counts) - send_counts[me]) * row)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, send_counts: list[int], recv_counts: list[int], group) -> Tensor:
        ctx.args = (send_counts, recv_counts, group)
        _count(x, send_counts, group)
        return _all_to_all(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        send_counts, recv_counts, group = ctx.args
        _count(g, recv_counts, group)
        return _all_to_all(g.contiguous(), recv_counts, send_counts, group), None, None, None


def dispatch(
    x: Tensor, expert_ids: Tensor, n_experts: int, group=None
) -> tuple[Tensor, DispatchMeta]:
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


class ExpertParallelMoE(nn.Module):
    """``moe``'s routed experts sharded over ``group``: this rank holds experts [r·E/ep, (r+1)·E/ep).

    Parameters keep the MoE's names (``router.weight``, ``gate_proj.weight`` (E/ep, F, D), ...). The
    routing, the balance terms (on this rank's tokens) and the stats are the wrapped MoE's own code.
    """

    is_expert_parallel = True

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        M, r = C.group_size(group), (dist.get_rank(group) if dist.is_initialized() else 0)
        E = moe.n_experts
        if E % M:
            raise ValueError(f"expert parallelism: n_experts={E} is not divisible by ep={M}")
        if moe.capacity_factor is not None:
            raise ValueError(
                f"expert parallelism with capacity_factor={moe.capacity_factor}: token dropping "
                "is only implemented in the single-process MoE; use capacity_factor=None"
            )
        self.group, self.ep, self.per = group, M, E // M
        self.lo = r * self.per
        self.load_group = (
            None  # the data-parallel group: aux-free bias updates use the loads summed over it
        )
        self._moe = [
            moe
        ]  # not a submodule: its full expert weights are not this module's parameters
        self.router, self.shared, self.shared_gate = moe.router, moe.shared, moe.shared_gate
        for name in ("gate_proj", "up_proj", "down_proj"):
            full = getattr(moe, name)
            local = nn.Module()
            local.weight = nn.Parameter(full.weight.detach()[self.lo : self.lo + self.per].clone())
            setattr(self, name, local)
            setattr(
                moe, name, None
            )  # the full (E, ., .) weights are not needed any more: free them

    @property
    def aux_loss(self):
        return self._moe[0].aux_loss

    @property
    def stats(self):
        return self._moe[0].stats

    def aux_losses(self):
        return self._moe[0].aux_losses()

    @property
    def reads_token_ids(self) -> bool:  # a hash-routed MoE: the Block passes the input token ids
        return self._moe[0].reads_token_ids

    def update_bias(self, load: Tensor, rate: float) -> None:
        """Aux-free balancing from this rank's loads, summed over ``load_group`` when set, so that every
        replica of the (replicated) router moves its bias the same way (as one process on the whole batch)."""
        if self.load_group is not None and C.group_size(self.load_group) > 1:
            load = load.clone()
            dist.all_reduce(load, group=self.load_group)
        self._moe[0].update_bias(load, rate)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The sharded (not replicated) parameters: this rank's slices of the routed experts."""
        return [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]

    def forward(
        self, x: Tensor, token_ids: Tensor | None = None
    ) -> Tensor:  # (B, T, D) -> (B, T, D)
        moe = self._moe[0]
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, D)
        T, k = x.shape[0], moe.k
        r = moe.routing(x, token_ids)
        flat_e = r.expert_ids.reshape(-1)  # (T·k,) one row per (token, expert) assignment
        tok = torch.arange(T, device=x.device).repeat_interleave(k)  # (T·k,)
        recv, meta = dispatch(
            x[tok], flat_e, moe.n_experts, self.group
        )  # rows for this rank's experts
        local = meta.local_expert_ids - self.lo  # (n_recv,) in 0 .. E/ep - 1
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.per).tolist()
        y_sorted = expert_swiglu(
            recv[order], counts, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        )  # (n_recv, D)
        y = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted)  # back in received order
        back = combine(y, meta, self.group)  # (T·k, D) in assignment order
        out = torch.zeros_like(x).index_add(0, tok, back * r.weights.reshape(-1, 1).to(back.dtype))
        if self.shared is not None:
            s = self.shared(x)
            out = out + (
                torch.sigmoid(self.shared_gate(x)) * s if self.shared_gate is not None else s
            )
        moe._record(
            r,
            x.new_tensor(0.0),
            torch.bincount(flat_e, minlength=moe.n_experts),
            torch.zeros((), dtype=torch.long, device=x.device),
        )
        return out.view(shape)


def expert_parallel(model: nn.Module, group=None) -> nn.Module:
    """Replace every ``MoE`` in ``model`` (in place) by an ``ExpertParallelMoE`` over ``group``; returns it."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoE):
                setattr(parent, name, ExpertParallelMoE(child, group))
    return model


def sync_expert_parallel_grads(model: nn.Module, group=None) -> None:
    """Data parallelism over the ep ranks (EP ≤ DP, here EP = DP): after each rank's backward on its own
    batch (loss = its local mean), average the replicated parameters' grads over the ranks and divide the
    sharded experts' grads by ep — they already summed every rank's tokens through the all-to-all backward."""
    M = C.group_size(group)
    sharded = {
        id(p)
        for m in model.modules()
        if isinstance(m, ExpertParallelMoE)
        for p in m.expert_parameters()
    }
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) in sharded:
            p.grad.div_(M)
        elif M > 1:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(M)


def shard_experts(model: nn.Module, ep_group, load_group=None) -> list[nn.Parameter]:
    """``expert_parallel`` for training composed with data parallelism: swap every MoE of ``model``
    for an ``ExpertParallelMoE`` over ``ep_group`` and register a hook dividing each expert gradient by
    ep as it is accumulated (the all-to-all backward summed the ep group's losses into it; averaging it
    over the ranks of the same shard then gives the global mean). Returns the expert parameters."""
    from lmstack.model.moe import moe_modules

    if not moe_modules(model):
        raise ValueError(
            f"ep={C.group_size(ep_group)} but the model has no MoE layers (n_experts=0): "
            "expert parallelism needs a mixture-of-experts model"
        )
    expert_parallel(model, ep_group)
    M = C.group_size(ep_group)
    params = []
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            m.load_group = load_group
            params.extend(m.expert_parameters())
    if M > 1:
        for p in params:
            p.register_hook(lambda g, M=M: g / M)
    return params


@torch.no_grad()
def broadcast_expert_parallel(
    module: nn.Module, dp_group, edp_group, expert_params: list[nn.Parameter]
) -> None:
    """Make the replicas equal: replicated parameters and buffers from rank 0 of ``dp_group``, each
    expert shard from rank 0 of its ``edp_group`` (the ranks holding the same experts)."""
    ids = {id(p) for p in expert_params}
    for t in [p for p in module.parameters() if id(p) not in ids] + list(module.buffers()):
        C.broadcast(t.data, 0, dp_group)
    for p in expert_params:
        C.broadcast(p.data, 0, edp_group)


class ExpertDataParallel(GradSyncWrapper):
    """Data parallelism for a model whose experts are sharded over ep (forward is the module's).

    At the end of each synchronised backward: the replicated parameters' gradients are averaged over
    ``dp_group`` (all dp·ep ranks), the expert gradients over ``edp_group`` (the dp ranks holding the
    same shard), each as one flat all-reduce. Rank 0 of each group broadcasts its values at
    construction. ``no_sync()`` accumulates locally (gradient accumulation), like ``DataParallel``.
    """

    def __init__(self, module: nn.Module, dp_group, edp_group, expert_params: list[nn.Parameter]):
        super().__init__()
        self.module, self.dp_group, self.edp_group = module, dp_group, edp_group
        ids = {id(p) for p in expert_params}
        params = [p for p in module.parameters() if p.requires_grad]
        self.kinds = [
            (dp_group, [p for p in params if id(p) not in ids]),
            (edp_group, [p for p in params if id(p) in ids]),
        ]
        broadcast_expert_parallel(module, dp_group, edp_group, expert_params)
        self.require_sync = True
        self._queued = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: Tensor) -> None:
        if self.require_sync and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    @torch.no_grad()
    def _finish(self) -> None:
        self._queued = False
        for group, ps in self.kinds:
            M = C.group_size(group)
            if not ps or M == 1:
                continue
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps]
            )
            C.all_reduce(flat, group, impl="torch")
            flat.div_(M)
            off = 0
            for p in ps:
                g = flat[off : off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                off += p.numel()


@torch.no_grad()
def gather_experts(model: nn.Module, sd: dict[str, Tensor], ep_group) -> dict[str, Tensor]:
    """Replace each expert shard (E/ep, ., .) in ``sd`` (single-process names) by the whole (E, ., .)
    tensor, all-gathered over ``ep_group`` in rank order (rank r holds experts [r·E/ep, (r+1)·E/ep))."""
    M = C.group_size(ep_group)
    out = dict(sd)
    for name, mod in model.named_modules():
        if not isinstance(mod, ExpertParallelMoE):
            continue
        for attr in ("gate_proj", "up_proj", "down_proj"):
            key = f"{name}.{attr}.weight"
            if key not in out:
                continue
            w = out[key].detach().contiguous()
            parts = [torch.empty_like(w) for _ in range(M)]
            if M > 1:
                dist.all_gather(parts, w, group=ep_group)
            else:
                parts = [w]
            out[key] = torch.cat(parts, 0)
    return out
