"""Mixture-of-experts feed-forward: a router picks k of E expert SwiGLUs per token.

CS336 notes "MoE": the top-k gate g_{i,t} = s_{i,t} if s_{i,t} ∈ TopK(s_t, k) else 0 with
s = Softmax(u_t · e_i), h_t = Σ_i g_{i,t} FFN_i(u_t) (+ the residual, added by the Block); shared
experts plus fine-grained routed experts (DeepSeekMoE; the routed/active/shared table); hash
routing as the baseline; the balance loss α·N·Σ f_i·P_i, its device-level variant, the router
z-loss, and DeepSeek-V3's aux-loss-free balancing by a per-expert bias on the selection scores.

Symbols: T tokens (B·S flattened), D model dim, E routed experts (the seed's N), k experts per
token, F one routed expert's hidden width.

Expert compute is grouped: the T·k (token, expert) assignments are sorted by expert and each
expert's rows go through one matmul per weight (``torch._grouped_mm`` on CUDA, one matmul per
expert elsewhere, ``ops.gemm.expert_swiglu``: oneDNN or BLAS by the CPU's GEMM policy) — the Python loop is
over experts, never over tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.layers import Linear, SwiGLU
from lmstack.ops.gemm import expert_swiglu

ROUTER_SCORES = ("softmax", "sigmoid")
ROUTER_ORDERS = (
    "softmax_topk",
    "topk_softmax",
)  # softmax then top-k | top-k of the logits then softmax
ROUTER_KINDS = ("topk", "hash")


@dataclass
class Routing:
    """One forward's routing decision for T tokens."""

    expert_ids: Tensor  # (T, k) int64, the chosen experts
    weights: Tensor  # (T, k) gate values g multiplying each chosen expert's output
    probs: Tensor  # (T, E) the router's distribution p(x) used by the balance loss (rows sum to 1)
    logits: Tensor | None  # (T, E) raw router logits (z-loss); None for hash routing


def route(
    logits: Tensor,
    k: int,
    score: str = "softmax",
    order: str = "softmax_topk",
    norm_topk: bool = False,
    scale: float = 1.0,
    bias: Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int = 1,
) -> Routing:
    """The top-k router on logits (T, E) -> Routing.

    ``score``: s = softmax(logits) (Mixtral, OLMoE, Qwen-MoE, DeepSeek-V2) or sigmoid(logits) (DeepSeek-V3).
    ``order``: "softmax_topk" picks the k largest s and gates with them; "topk_softmax" picks the k largest
    logits and gates with the softmax over those k only (for softmax scores this equals softmax_topk with
    renormalisation). ``norm_topk``: divide the k gate values by their sum. ``scale``: routed_scaling_factor.
    ``bias`` (E,): added to s for *selection only* (aux-loss-free balancing; the gate values stay s).
    ``n_groups`` / ``topk_groups``: group-limited routing — experts split into n_groups equal groups, each
    group scored by its largest selection score (softmax scores, DeepSeek-V2) or the sum of its top-2
    (sigmoid scores, DeepSeek-V3), and only experts in the best topk_groups groups may be chosen.
    """
    T, E = logits.shape
    logits32 = logits.float()
    s = logits32.sigmoid() if score == "sigmoid" else logits32.softmax(dim=-1)  # (T, E)
    probs = s / s.sum(dim=-1, keepdim=True) if score == "sigmoid" else s  # (T, E), rows sum to 1
    choice = (logits32 if order == "topk_softmax" else s).detach()
    if bias is not None:
        choice = choice + bias.float()
    if n_groups > 1:
        per = E // n_groups
        grouped = choice.view(T, n_groups, per)
        top = min(2, per) if score == "sigmoid" else 1
        group_score = grouped.topk(top, dim=-1).values.sum(dim=-1)  # (T, G)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    expert_ids = choice.topk(k, dim=-1).indices  # (T, k)
    if order == "topk_softmax":
        weights = logits32.gather(1, expert_ids).softmax(dim=-1)  # (T, k)
    else:
        weights = s.gather(1, expert_ids)  # (T, k)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(expert_ids, (weights * scale).to(logits.dtype), probs, logits)


HASH_MULT, HASH_STEP, HASH_PRIME = (
    2654435761,
    0x9E3779B1,
    2147483647,
)  # Knuth's multiplier, 2^32/φ, 2^31 − 1


def hash_route(token_ids: Tensor, n_experts: int, k: int = 1, seed: int = 0) -> Routing:
    """Hash routing (CS336 notes "MoE", the baseline): token id t goes to the k experts
    e_j = ((t·HASH_MULT + j·HASH_STEP + seed) mod HASH_PRIME) mod E, j = 0..k−1, each with gate 1/k;
    no parameters, a fixed function of the token (the same in training, prefill and decode), balanced
    in expectation over distinct tokens (skewed only as much as the token frequencies are)."""
    ids = token_ids.reshape(-1).long()  # (T,); t·HASH_MULT < 2^63 for any id < 2^31
    cols = [
        ((ids * HASH_MULT + j * HASH_STEP + seed) % HASH_PRIME) % n_experts for j in range(k)
    ]  # k hashes
    expert_ids = torch.stack(
        cols, dim=-1
    )  # (T, k)  (may repeat an expert when k > 1: a gate of 2/k then)
    T = ids.numel()
    probs = torch.zeros(T, n_experts, device=ids.device).scatter_add_(
        1, expert_ids, torch.full((T, k), 1.0 / k, device=ids.device)
    )
    return Routing(expert_ids, torch.full((T, k), 1.0 / k, device=ids.device), probs, None)


def balance_loss(probs: Tensor, expert_ids: Tensor, n_experts: int) -> Tensor:
    """The seed's L_bal / α = N·Σ_i f_i·P_i with f_i the fraction of the T·k assignments sent to expert i
    (k = 1: the seed's argmax count over T) and P_i the mean router probability of expert i.
    Equals 1 for a perfectly uniform router; ∂/∂p_i(x) = N·f_i / T (f_i carries no gradient)."""
    T = probs.shape[0]
    f = (
        torch.bincount(expert_ids.reshape(-1), minlength=n_experts).to(probs.dtype)
        / expert_ids.numel()
    )  # (E,)
    P = probs.mean(dim=0) if T else probs.sum(dim=0)  # (E,)
    return n_experts * (f * P).sum()


def device_balance_loss(
    probs: Tensor, expert_ids: Tensor, n_experts: int, n_devices: int
) -> Tensor:
    """DeepSeek-V2's device-level balance loss / α_dev: experts split into n_devices equal groups,
    Σ_d f'_d·P'_d with f'_d = mean over the group of N·f_i and P'_d = Σ over the group of P_i (1 when uniform)."""
    if n_experts % n_devices:
        raise ValueError(
            f"device balance: n_experts={n_experts} is not divisible by n_devices={n_devices}"
        )
    f = (
        torch.bincount(expert_ids.reshape(-1), minlength=n_experts).to(probs.dtype)
        / expert_ids.numel()
    )
    f_dev = (n_experts * f).view(n_devices, -1).mean(dim=1)  # (devices,)
    P_dev = probs.mean(dim=0).view(n_devices, -1).sum(dim=1)  # (devices,)
    return (f_dev * P_dev).sum()


def z_loss(logits: Tensor) -> Tensor:
    """Router z-loss / β (ST-MoE; CS336 notes "训练稳定性"): mean over tokens of logsumexp(logits)²."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def loop_reference(x: Tensor, routing: Routing, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """Slow reference for tests: for each expert, the masked sum over the tokens routed to it."""
    out = torch.zeros_like(x)
    for e in range(gate.shape[0]):
        w = (routing.weights * (routing.expert_ids == e)).sum(dim=-1, keepdim=True)  # (T, 1)
        out = out + w * F.linear(F.silu(F.linear(x, gate[e])) * F.linear(x, up[e]), down[e])
    return out


class ExpertWeights(nn.Module):
    """E stacked weight matrices ``weight`` (E, out, in): one Linear per expert, multiplied grouped."""

    def __init__(
        self,
        n_experts: int,
        in_features: int,
        out_features: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(n_experts, out_features, in_features, device=device, dtype=dtype)
        )
        if self.weight.device.type != "meta":
            std = 1.0 / math.sqrt(in_features)
            nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def extra_repr(self) -> str:
        E, out, inp = self.weight.shape
        return f"experts={E}, in_features={inp}, out_features={out}"


class Router(nn.Module):
    """The gate's expert embeddings e_i as rows of ``weight`` (E, D): logits = x Wᵀ. ``bias`` (E,), present
    with aux-loss-free balancing, is added to the scores for *selection only* (never to the logits or the
    gate values) and is moved by ``MoE.update_bias``, not by the optimizer (``requires_grad=False``)."""

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        selection_bias: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model, device=device, dtype=dtype))
        self.bias = (
            nn.Parameter(
                torch.zeros(n_experts, device=device, dtype=torch.float32), requires_grad=False
            )
            if selection_bias
            else None
        )
        if self.weight.device.type != "meta":
            std = 1.0 / math.sqrt(d_model)
            nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(
        self, x: Tensor
    ) -> Tensor:  # (T, D) -> logits (T, E), in fp32 as every HF MoE router
        return F.linear(x.float(), self.weight.float())


class MoE(nn.Module):
    """Routed experts (+ optional shared experts): (B, T, D) -> (B, T, D), a drop-in for SwiGLU.

    Parameters: ``router.weight`` (E, D) and, with aux-free balancing, ``router.bias`` (E,);
    ``gate_proj.weight`` / ``up_proj.weight`` (E, F, D), ``down_proj.weight`` (E, D, F); ``shared`` a
    SwiGLU of width F_shared; ``shared_gate`` (1, D) for Qwen-MoE's sigmoid-gated shared expert.

    After each forward, ``aux_loss`` holds the weighted sum of the enabled balance terms (a scalar tensor
    with gradient), ``stats`` the load counts (E,), dropped assignments and the unweighted terms.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        k: int,
        d_ff: int,
        n_shared: int = 0,
        d_ff_shared: int = 0,
        shared_gate: bool = False,
        score: str = "softmax",
        order: str = "softmax_topk",
        norm_topk: bool = False,
        scale: float = 1.0,
        n_groups: int = 1,
        topk_groups: int = 1,
        aux_free_bias: bool = False,
        capacity_factor: float | None = None,
        router: str = "topk",
        aux_loss_coef: float = 0.0,
        device_loss_coef: float = 0.0,
        n_devices: int = 1,
        z_loss_coef: float = 0.0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if not 1 <= k <= n_experts:
            raise ValueError(f"experts per token k={k} must be between 1 and n_experts={n_experts}")
        self.n_experts, self.k, self.d_ff = n_experts, k, d_ff
        self.score, self.order, self.norm_topk, self.scale = score, order, norm_topk, scale
        self.n_groups, self.topk_groups, self.capacity_factor, self.router_kind = (
            n_groups,
            topk_groups,
            capacity_factor,
            router,
        )
        self.aux_loss_coef, self.device_loss_coef, self.n_devices, self.z_loss_coef = (
            aux_loss_coef,
            device_loss_coef,
            n_devices,
            z_loss_coef,
        )
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.router = Router(d_model, n_experts, aux_free_bias, **kw)
        self.gate_proj = ExpertWeights(
            n_experts, d_model, d_ff, **kw
        )  # W_gate per expert (E, F, D)
        self.up_proj = ExpertWeights(n_experts, d_model, d_ff, **kw)  # W_up (E, F, D)
        self.down_proj = ExpertWeights(n_experts, d_ff, d_model, **kw)  # W_down (E, D, F)
        self.shared = SwiGLU(d_model, d_ff_shared, **kw) if n_shared else None
        self.shared_gate = Linear(d_model, 1, **kw) if (n_shared and shared_gate) else None
        self.reads_token_ids = (
            router == "hash"
        )  # the Block passes the input token ids (AttentionMetadata.token_ids)
        self.aux_loss: Tensor | None = None
        self.stats: dict[str, Tensor] = {}

    def routing(self, x: Tensor, token_ids: Tensor | None = None) -> Routing:
        """x (T, D) -> the routing decision; hash routing reads ``token_ids`` (B, S) with B·S = T instead."""
        if self.router_kind == "hash":
            if token_ids is None:
                raise ValueError(
                    "hash routing needs the input token ids: call moe(x, token_ids=tokens (B, S)); "
                    "a Transformer passes them (AttentionMetadata.token_ids), a pipeline stage "
                    "without the embedding cannot"
                )
            if token_ids.numel() != x.shape[0]:
                raise ValueError(
                    f"hash routing: token_ids has {token_ids.numel()} ids "
                    f"(shape {tuple(token_ids.shape)}) for {x.shape[0]} tokens"
                )
            return hash_route(token_ids.to(x.device), self.n_experts, self.k)
        return route(
            self.router(x),
            self.k,
            self.score,
            self.order,
            self.norm_topk,
            self.scale,
            self.router.bias,
            self.n_groups,
            self.topk_groups,
        )

    def capacity(self, T: int) -> int | None:
        """Per-expert capacity ceil(cf · T·k / E) assignments, or None (no dropping, the default)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * T * self.k / self.n_experts)

    def forward(
        self, x: Tensor, token_ids: Tensor | None = None
    ) -> Tensor:  # (B, T, D) -> (B, T, D)
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, D)
        T, E, k = x.shape[0], self.n_experts, self.k
        r = self.routing(x, token_ids)
        flat_e = r.expert_ids.reshape(-1)  # (T·k,)
        order = torch.argsort(
            flat_e, stable=True
        )  # assignments sorted by expert, in token order within one
        counts_t = torch.bincount(flat_e, minlength=E)  # (E,) load
        tok = order // k  # (T·k,) token of each sorted assignment
        w = r.weights.reshape(-1)[order]  # (T·k,)
        dropped = torch.zeros((), dtype=torch.long, device=x.device)
        cap = self.capacity(T)
        if cap is not None:  # keep the first `cap` assignments of each expert, in token order
            starts = torch.cumsum(counts_t, 0) - counts_t  # (E,)
            rank = (
                torch.arange(flat_e.numel(), device=x.device) - starts[flat_e[order]]
            )  # rank within its expert
            keep = rank < cap
            dropped = (~keep).sum()
            order, tok, w = order[keep], tok[keep], w[keep]
            counts_t = counts_t.clamp(max=cap)
        counts = counts_t.tolist()
        y = expert_swiglu(
            x[tok], counts, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        )  # (R, D)
        out = torch.zeros_like(x).index_add_(
            0, tok, y * w[:, None].to(y.dtype)
        )  # combine: Σ_i g_i FFN_i
        if self.shared is not None:
            s = self.shared(x)
            out = out + (
                torch.sigmoid(self.shared_gate(x)) * s if self.shared_gate is not None else s
            )
        self._record(r, x.new_tensor(0.0), counts_t, dropped)
        return out.view(shape)

    def _record(self, r: Routing, zero: Tensor, load: Tensor, dropped: Tensor) -> None:
        """The balance terms and load statistics of this forward, for the trainer (``moe_aux_loss``,
        ``moe_metrics``). Only when gradients are on: inference and evaluation skip them."""
        if not torch.is_grad_enabled():
            self.aux_loss, self.stats = None, {}
            return
        E = self.n_experts
        bal = balance_loss(r.probs, r.expert_ids, E)
        terms = {"balance": bal}
        aux = self.aux_loss_coef * bal
        if self.device_loss_coef and self.n_devices > 1:
            terms["device_balance"] = device_balance_loss(r.probs, r.expert_ids, E, self.n_devices)
            aux = aux + self.device_loss_coef * terms["device_balance"]
        if r.logits is not None:
            terms["z"] = z_loss(r.logits)
            if self.z_loss_coef:
                aux = aux + self.z_loss_coef * terms["z"]
        self.aux_loss = aux + zero
        full_load = torch.bincount(r.expert_ids.reshape(-1), minlength=E)
        self.stats = {
            "load": full_load.detach(),
            "kept": load.detach(),
            "dropped": dropped.detach(),
            **{k: v.detach() for k, v in terms.items()},
        }

    def aux_losses(self) -> dict[str, Tensor]:
        """This layer's weighted balance terms of the last training forward, named as the trainer logs them
        (``Transformer.aux_losses`` sums the layers'); {} after an inference or evaluation forward."""
        return {} if self.aux_loss is None else {"moe_aux_loss": self.aux_loss}

    @torch.no_grad()
    def update_bias(self, load: Tensor, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): b_i += rate · sign(mean load − load_i), so an overloaded
        expert's selection score drops and an underloaded one's rises; the gate values are unaffected."""
        if self.router.bias is None:
            raise ValueError("update_bias needs a MoE built with aux_free_bias=True")
        load = load.float()
        self.router.bias.add_(rate * torch.sign(load.mean() - load))

    def extra_repr(self) -> str:
        return (
            f"experts={self.n_experts}, k={self.k}, d_ff={self.d_ff}, score={self.score!r}, "
            f"order={self.order!r}, capacity_factor={self.capacity_factor}"
        )


def moe_from_config(c, device: torch.device | None = None, dtype: torch.dtype | None = None) -> MoE:
    """The MoE FFN a ``ModelConfig`` describes (``transformer.channel_mixer`` picks it per layer)."""
    d_ff = c.d_ff_expert or c.d_ff
    d_shared = c.d_ff_shared or c.n_shared_experts * d_ff
    return MoE(
        c.d_model,
        c.n_experts,
        c.n_experts_per_token,
        d_ff,
        c.n_shared_experts,
        d_shared,
        c.shared_expert_gate,
        c.router_score,
        c.router_order,
        c.router_norm_topk,
        c.router_scale,
        c.router_groups,
        c.router_topk_groups,
        c.router_aux_free_bias,
        c.capacity_factor,
        c.router,
        c.moe_aux_loss_coef,
        c.moe_device_loss_coef,
        c.moe_devices,
        c.moe_z_loss_coef,
        device=device,
        dtype=dtype,
    )


def moe_modules(model: nn.Module) -> list[MoE]:
    """The model's MoE layers: ``MoE`` and wrappers of one (``is_expert_parallel``, lmstack.parallel.expert)."""
    mods = [
        m for m in model.modules() if isinstance(m, MoE) or getattr(m, "is_expert_parallel", False)
    ]
    return cast("list[MoE]", mods)  # an expert-parallel wrapper has MoE's attributes


def moe_loss_coefs(c) -> dict[str, float]:
    """The ``ModelConfig`` fields that weight the MoE layers' auxiliary losses ({} for a dense model)."""
    if not c.n_experts:
        return {}
    names = ("moe_aux_loss_coef", "moe_device_loss_coef", "moe_z_loss_coef")
    return {n: getattr(c, n) for n in names}


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """Sum of every MoE layer's weighted auxiliary loss from the last forward (None: no MoE layers)."""
    losses = [m.aux_loss for m in moe_modules(model) if m.aux_loss is not None]
    return torch.stack([l.float() for l in losses]).sum() if losses else None


def moe_metrics(model: nn.Module) -> dict[str, float]:
    """Per-step training metrics over all MoE layers of the last forward: load max/mean ratio (1 = balanced),
    dropped assignments, mean balance / z terms, the fractions of (layer, expert) pairs that got < 1 % of
    their layer's assignments and none at all (collapse), and the per-expert load histogram summed over layers."""
    mods = [m for m in moe_modules(model) if m.stats]
    if not mods:
        return {}
    load = torch.stack([m.stats["load"].float() for m in mods])  # (L_moe, E)
    out = {
        "moe_load_max_over_mean": float(
            (load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)).mean()
        ),
        "moe_dropped": float(sum(int(m.stats["dropped"]) for m in mods)),
        "moe_balance": float(torch.stack([m.stats["balance"] for m in mods]).mean()),
        # collapse: share of (layer, expert) pairs getting < 1 % of their layer's assignments / none at all
        "moe_experts_below_1pct": float(
            (load < 0.01 * load.sum(dim=1, keepdim=True)).float().mean()
        ),
        "moe_experts_dead": float((load == 0).float().mean()),
    }
    if all("z" in m.stats for m in mods):
        out["moe_z"] = float(torch.stack([m.stats["z"] for m in mods]).mean())
    for i, c in enumerate(load.sum(dim=0).tolist()):
        out[f"moe_load_{i}"] = c
    return out


def update_router_biases(model: nn.Module, rate: float) -> None:
    """After an optimizer step: move every aux-free router bias toward balance from the last loads."""
    for m in moe_modules(model):
        if m.router.bias is not None and m.stats:
            m.update_bias(m.stats["load"], rate)
