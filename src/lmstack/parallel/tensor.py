"""Megatron tensor parallelism with sequence parallelism, vocab-parallel embedding and loss.

Book of LLMs §6.3 (four sharded-matmul cases), §6.6 (MLP: column-parallel W_up/W_gate -> local
activation -> row-parallel W_down, one all-reduce; attention: column-parallel Q/K/V split by
heads -> local attention -> row-parallel W_O, one all-reduce), CS336 notes "张量并行" (f and g
swap in backward; compute/communication ratio 4h/tp) and "序列并行和上下文并行" (in the norm
and residual regions the activations are split along S: all-gather before the column-parallel
matmul and reduce-scatter after the row-parallel one replace the all-reduce).

``tensor_parallel(model, group, sequence_parallel=False)`` shards a ``Transformer`` from the
outside — the model code and its attributes are unchanged, only its linears/embedding are replaced
by sharded ones (attention reads N/tp and K/tp from its projections' widths). What a layer's mixer
shards is what its spec declares (``model.mixer_spec``: softmax / local attention and linear attention
split by heads as below; MLA's per-head up-projections column- and W_O row-parallel with its latent
projections replicated); a mixer without a plan (Mamba-2, Gated DeltaNet, DSA) is refused by name
before anything is sharded:

    attn_norm -> [norm, f]        f: identity fwd / all-reduce bwd  (SP: all-gather S / reduce-scatter)
    q,k,v     -> column-parallel   W (N·H/tp, D), (K·H/tp, D): rank r gets heads r·N/tp .. and kv heads r·K/tp ..
    o_proj    -> row-parallel      W (D, N·H/tp) + g: all-reduce fwd / identity bwd  (SP: reduce-scatter S)
    ffn_norm  -> [norm, f];  gate/up column-parallel (F/tp, D); down row-parallel (D, F/tp) + g
    embed     -> vocab-parallel    W_e (V/tp, D): rows of other ranks give 0, then g (SP: reduce-scatter S)
    norm      -> [norm, f];  lm_head column-parallel over V (tied: the embedding shard itself)

so each block does one all-reduce after attention and one after the MLP in the forward, and
their two duals in the backward (``accounting.comm.tp_layer_bytes``). A mixture-of-experts FFN
(``model.moe.MoE`` or the expert-parallel one) is not split: it runs whole on every tp rank, so TP
shards the attention of those blocks only (their ffn_norm is left unwrapped). The model then returns
vocab-sharded logits (B, S, V/tp); ``vocab_parallel_cross_entropy`` computes the loss without
gathering V, or ``TensorParallel(gather_output=True)`` all-gathers them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.mixer_spec import UnsupportedMixer, tp_plan
from lmstack.model.moe import MoE
from lmstack.parallel import collectives as C


def _rank_size(group) -> tuple[int, int]:
    M = C.group_size(group)
    return (C.group_ranks(group)[0] if M > 1 else 0), M


def check_divisible(tp: int, **sizes: int) -> None:
    """The one tensor-parallel divisibility check: every split size (N, K, F, V, a linear's
    width) must be a multiple of tp. ``check_divisible(2, n_heads=4, d_ff=64)``."""
    for name, v in sizes.items():
        if v % tp:
            raise ValueError(f"tensor parallelism: {name}={v} is not divisible by tp={tp}")


def _keep_frozen(new: nn.Module, old: nn.Module) -> nn.Module:
    """The shards keep their parameters' ``requires_grad`` (a frozen weight stays frozen)."""
    for name in ("weight", "bias"):
        a, b = getattr(new, name, None), getattr(old, name, None)
        if a is not None and b is not None:
            a.requires_grad_(b.requires_grad)
    return new


class ColumnParallelLinear(nn.Module):
    """Y[.., O_tp] = X[.., I] · W[O_tp, I]ᵀ: the output features are split (Book of LLMs §6.3 “mesh notation and distributed matmuls” case 1:
    no communication). Holds rows [r·O/tp, (r+1)·O/tp) of the full (O, I) weight."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_linear(cls, lin: nn.Module, group) -> ColumnParallelLinear:
        r, M = _rank_size(group)
        check_divisible(M, out_features=lin.weight.shape[0])
        w = lin.weight.detach().chunk(M, 0)[r].clone()
        b = (
            lin.bias.detach().chunk(M, 0)[r].clone()
            if getattr(lin, "bias", None) is not None
            else None
        )
        return _keep_frozen(cls(w, b), lin)

    def forward(self, x: Tensor) -> Tensor:  # (B, S, I) -> (B, S, O/tp)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y[.., O]{U_tp} = X[.., I_tp] · W[O, I_tp]ᵀ, then g: all-reduce the partial sums (Book of LLMs
    §6.3 case 3), or reduce-scatter along S with sequence parallelism."""

    def __init__(
        self, weight: Tensor, group, sequence_parallel: bool = False, bias: Tensor | None = None
    ):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.sequence_parallel = group, sequence_parallel
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_linear(
        cls, lin: nn.Module, group, sequence_parallel: bool = False
    ) -> RowParallelLinear:
        r, M = _rank_size(group)
        check_divisible(M, in_features=lin.weight.shape[1])
        w = lin.weight.detach().chunk(M, 1)[r].clone()
        b = lin.bias.detach().clone() if getattr(lin, "bias", None) is not None else None
        return _keep_frozen(cls(w, group, sequence_parallel, b), lin)

    def forward(self, x: Tensor) -> Tensor:  # (B, S, I/tp) -> (B, S, O)  [SP: (B, S/tp, O)]
        y = F.linear(x, self.weight)  # partial sum over this rank's I/tp inputs
        if self.sequence_parallel:
            y = C.ReduceScatterFn.apply(y, 1, self.group)
        else:
            y = C.ReduceFromParallelFn.apply(y, self.group)
        return y + self.bias if self.bias is not None else y


class EnterParallelRegion(nn.Module):
    """Wraps the norm before a column-parallel region: f (identity fwd, all-reduce bwd) or, with
    sequence parallelism, all-gather along S (fwd) / reduce-scatter (bwd)."""

    def __init__(self, norm: nn.Module, group, sequence_parallel: bool = False):
        super().__init__()
        self.norm, self.group, self.sequence_parallel = norm, group, sequence_parallel

    @property
    def weight(self):
        return self.norm.weight

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)  # (B, S, D)  [SP: (B, S/tp, D)]
        if self.sequence_parallel:
            return C.AllGatherFn.apply(h, 1, self.group)  # (B, S, D)
        return C.CopyToParallelFn.apply(h, self.group)


class VocabParallelEmbedding(nn.Module):
    """W_e[V_tp, D]: rank r holds rows [r·V/tp, (r+1)·V/tp); a token outside them looks up 0 and
    the partial embeddings are summed (g), or reduce-scattered along S with SP."""

    def __init__(self, weight: Tensor, vocab_start: int, group, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start, self.group, self.sequence_parallel = vocab_start, group, sequence_parallel
        self.num_embeddings, self.embedding_dim = weight.shape

    @classmethod
    def from_embedding(
        cls, emb: nn.Module, group, sequence_parallel: bool = False
    ) -> VocabParallelEmbedding:
        r, M = _rank_size(group)
        V = emb.weight.shape[0]
        check_divisible(M, vocab_size=V)
        return _keep_frozen(
            cls(emb.weight.detach().chunk(M, 0)[r].clone(), r * (V // M), group, sequence_parallel),
            emb,
        )

    def forward(self, tokens: Tensor) -> Tensor:  # (B, S) -> (B, S, D)  [SP: (B, S/tp, D)]
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = self.weight[local.clamp(0, self.num_embeddings - 1)]
        x = x.masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return C.ReduceScatterFn.apply(x, 1, self.group)
        return C.ReduceFromParallelFn.apply(x, self.group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits: all-reduce the row max, the sum of exponentials
    and the target logit; never materialises (B, S, V) on one rank."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_start: int, group, ignore_index: int):
        x = logits.float()  # (T, V/tp)
        m = x.amax(dim=-1)
        _max_all_reduce(m, group)
        x = x - m[:, None]
        e = x.exp()
        sumexp = e.sum(-1)
        C.all_reduce(sumexp, group)
        local = targets - vocab_start
        inside = (local >= 0) & (local < x.shape[-1]) & (targets != ignore_index)
        idx = local.clamp(0, x.shape[-1] - 1)
        tgt = torch.where(inside, x.gather(-1, idx[:, None])[:, 0], torch.zeros_like(m))
        C.all_reduce(tgt, group)
        valid = targets != ignore_index
        n = valid.sum().clamp_min(1)
        loss = ((sumexp.log() - tgt) * valid).sum() / n
        probs = e / sumexp[:, None]
        ctx.save_for_backward(probs, idx, inside, valid)
        ctx.n = n
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        probs, idx, inside, valid = ctx.saved_tensors
        grad = probs.clone()
        grad[torch.arange(grad.shape[0]), idx] -= inside.float()
        grad = grad * (valid.float() / ctx.n)[:, None] * g
        return grad, None, None, None, None


def _max_all_reduce(t: Tensor, group) -> None:
    if C.group_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def vocab_parallel_cross_entropy(
    logits: Tensor, targets: Tensor, group, ignore_index: int = -100
) -> Tensor:
    """Mean cross-entropy of vocab-sharded logits (B, S, V/tp) against targets (B, S) with ids in
    [0, V): rank r's shard covers ids [r·V/tp, (r+1)·V/tp)."""
    r, M = _rank_size(group)
    Vl = logits.shape[-1]
    return _VocabParallelCE.apply(
        logits.reshape(-1, Vl), targets.reshape(-1), r * Vl, group, ignore_index
    )


def _allreduce_grad_hook(group):
    def hook(g: Tensor) -> Tensor:
        g = g.clone()
        C.all_reduce(g, group)
        return g

    return hook


def tensor_parallel_plan(model: nn.Module) -> list[tuple[nn.Module, tuple[tuple[str, str], ...]]]:
    """(mixer, its declared plan) for every block: what each layer's spec shards (``model.mixer_spec.tp_plan``:
    softmax attention's q/k/v column- and o row-parallel, ...). A layer whose mixer has no plan, or whose module
    lacks a submodule its plan names, raises ``UnsupportedMixer`` naming the layer — before anything is sharded."""
    cfg = model.config
    plans = []
    for i, block in enumerate(model.blocks):
        layer = getattr(block.attn, "layer_idx", i)  # a pipeline stage holds a slice of the layers
        plan = tp_plan(cfg, layer)
        missing = [
            name for name, _ in plan if not isinstance(getattr(block.attn, name, None), nn.Module)
        ]
        if missing:
            raise UnsupportedMixer(
                f"tensor parallelism: layer {layer}'s {type(block.attn).__name__} has no "
                f"{missing} that its plan {plan} shards"
            )
        plans.append((block.attn, plan))
    return plans


def tensor_parallel(model: nn.Module, group, sequence_parallel: bool = False) -> nn.Module:
    """Shard a ``lmstack.model.Transformer`` in place over ``group`` (see the module docstring): each layer's
    mixer as its spec declares (``tensor_parallel_plan``), the FFN, the embedding and the unembedding.
    Raises a clear error, before anything changes, when N, K, F or V is not divisible by tp or a layer's mixer
    cannot be sharded (Mamba-2, Gated DeltaNet, DSA, OLMoE's whole-projection QK-norm)."""
    cfg = model.config
    if getattr(cfg, "parallel_block", False):
        raise ValueError("tensor parallelism: parallel_block=True (GPT-J) is not supported")
    plans = tensor_parallel_plan(
        model
    )  # refuses an unshardable layer before anything (even the group) is touched
    r, M = _rank_size(group)
    check_divisible(
        M,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        vocab_size=cfg.vocab_size,
        **({"d_ff": cfg.d_ff} if cfg.block_ffn else {}),
    )
    sp = sequence_parallel
    replicated_partial = []  # replicated weights whose gradient is a partial sum over tp ranks
    if sp and any(
        isinstance(b.ffn, MoE) or getattr(b.ffn, "is_expert_parallel", False) for b in model.blocks
    ):
        raise ValueError(
            "tensor parallelism: sequence_parallel=True with mixture-of-experts layers is "
            "not supported (the MoE layers are not split over tp)"
        )
    for block, (a, plan) in zip(model.blocks, plans):
        for name, style in plan:  # the layer's declared plan (model.mixer_spec)
            sub = getattr(a, name)
            if style == "column":
                setattr(a, name, ColumnParallelLinear.from_linear(sub, group))
            elif style == "row":
                setattr(a, name, RowParallelLinear.from_linear(sub, group, sp))
            else:  # replicated, e.g. per-head QK-norm gammas shared over heads: each rank sees only its heads
                replicated_partial += list(sub.parameters())
        f = block.ffn
        moe = isinstance(f, MoE) or getattr(f, "is_expert_parallel", False)
        if f is not None and not moe:  # a mixture-of-experts FFN stays whole on every tp rank
            f.gate_proj = ColumnParallelLinear.from_linear(f.gate_proj, group)
            f.up_proj = ColumnParallelLinear.from_linear(f.up_proj, group)
            f.down_proj = RowParallelLinear.from_linear(f.down_proj, group, sp)
        if (
            sp
        ):  # norms over S/tp tokens (Gemma's sandwich norms too): their gradients are partial sums
            norms = (
                block.attn_norm,
                block.ffn_norm,
                getattr(block, "post_attn_norm", None),
                getattr(block, "post_ffn_norm", None),
            )
            replicated_partial += [n.weight for n in norms if n is not None]
        block.attn_norm = EnterParallelRegion(block.attn_norm, group, sp)
        if (
            f is not None and not moe
        ):  # before a replicated MoE the input gradient is already whole: no f
            block.ffn_norm = EnterParallelRegion(block.ffn_norm, group, sp)
    tied = model.lm_head is None
    model.embed = VocabParallelEmbedding.from_embedding(model.embed, group, sp)
    if not tied:
        model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group)
    if sp:
        replicated_partial.append(model.norm.weight)
    model.norm = EnterParallelRegion(model.norm, group, sp)
    for p in replicated_partial:
        p.register_hook(_allreduce_grad_hook(group))
    return model


class TensorParallel(nn.Module):
    """A tensor-parallel model with the plain interface: tokens (B, S) -> logits.

    ``gather_output=True`` (default) returns full logits (B, S, V), all-gathered along V with a
    backward that keeps this rank's slice (every rank computes the same loss);
    ``gather_output=False`` returns the (B, S, V/tp) shard for ``vocab_parallel_cross_entropy``.
    """

    def __init__(
        self, model: nn.Module, group, sequence_parallel: bool = False, gather_output: bool = True
    ):
        super().__init__()
        self.module = tensor_parallel(model, group, sequence_parallel)
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel
        r, self.M = _rank_size(group)

    def forward(self, tokens: Tensor, *args, **kwargs) -> Tensor:
        if self.sequence_parallel and tokens.shape[1] % self.M:
            raise ValueError(
                f"sequence parallelism: S={tokens.shape[1]} is not divisible by tp={self.M}"
            )
        logits = self.module(tokens, *args, **kwargs)  # (B, S, V/tp)
        if self.gather_output:
            return C.GatherFn.apply(logits, -1 % logits.dim(), self.group)
        return logits

    def full_state_dict(self) -> dict[str, Tensor]:
        """Gather the shards back into the single-process parameter names and shapes."""
        return gather_tp_state_dict(self.module, self.group)


def gather_tp_state_dict(
    model: nn.Module, group, only: set[int] | None = None
) -> dict[str, Tensor]:
    """Unsharded parameters by single-process name (``only``: ids of the parameters to include)."""
    out = {}
    for name, mod in model.named_modules():
        for attr, p in mod._parameters.items():
            if p is None or (only is not None and id(p) not in only):
                continue
            key = f"{name}.{attr}" if name else attr
            if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)) and attr in (
                "weight",
                "bias",
            ):
                full = C.all_gather_dim(p.detach().contiguous(), 0, group)
            elif isinstance(mod, RowParallelLinear) and attr == "weight":
                full = C.all_gather_dim(p.detach().contiguous(), 1, group)
            else:
                full = p.detach().clone()
            out[key] = full
    return {single_process_name(k): v for k, v in out.items()}


def single_process_name(k: str) -> str:
    """EnterParallelRegion wraps the norm ("blocks.0.attn_norm.norm.weight" -> "blocks.0.attn_norm.weight");
    the zero-bubble split wraps linears (".inner.")."""
    return k.replace("_norm.norm.", "_norm.").replace("norm.norm.", "norm.").replace(".inner.", ".")


def tp_sharded_ids(model: nn.Module) -> set[int]:
    """ids of the parameters split across the tp ranks (the rest are replicated)."""
    out = set()
    for mod in model.modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            out.update(id(p) for p in (mod.weight, getattr(mod, "bias", None)) if p is not None)
        elif isinstance(mod, RowParallelLinear):
            out.add(id(mod.weight))
    return out


def gather_tp_named(model: nn.Module, sd: dict[str, Tensor], group) -> dict[str, Tensor]:
    """A state dict of tp shards under ``model``'s names (e.g. gathered from ZeRO-3 flat shards)
    -> the full tensors under single-process names."""
    dims = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            dims[f"{name}.weight"] = dims[f"{name}.bias"] = 0
        elif isinstance(mod, RowParallelLinear):
            dims[f"{name}.weight"] = 1
    out = {}
    for k, v in sd.items():
        if k in dims:
            v = C.all_gather_dim(v.contiguous(), dims[k], group)
        out[single_process_name(k)] = v
    return out
