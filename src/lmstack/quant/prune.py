"""Width pruning by activation importance, then logit distillation to recover (CS336 notes "有损提速":
pruning + distillation as in Minitron, Muralidharan et al. 2024).

Importance on calibration tokens (mean over B·S positions of an activation's magnitude):

- FFN channel f of a layer: mean |silu(x W_gateᵀ) ⊙ x W_upᵀ|_f — the input of W_down;
- attention: a KV group g (one K/V head and its N/K query heads, so GQA keeps its shape):
  mean over the group's query heads of the L2 norm of the head's attention output (the input of W_O);
- embedding channel d: mean |x_d| of every RMSNorm's output (attention, FFN, final) summed over layers.

Dropping residual channels changes what each RMSNorm divides by: rms over the kept channels (the
loud ones) exceeds rms over all, so every normalised activation would shrink. ``prune_width``
(``rescale_norms=True``) scales each norm's kept γ by sqrt((mean_kept E[x_d²] + ε) / (mean_all E[x_d²] + ε)),
the second moments of the norm's input measured on the calibration tokens, so the pruned norms
give the kept channels the magnitudes they had.

``prune_width(model, tokens, d_ff=…, n_kv_heads=…, d_model=…)`` keeps the most important channels /
groups in their original order and returns a new ``Transformer`` whose weights are slices of the old
ones (W_gate, W_up rows, W_down columns; W_Q/W_K/W_V rows, W_O columns; D columns/rows and γ entries
everywhere), with ``head_dim`` unchanged. ``distill_loss`` = T²·KL(softmax(z_t/T) ‖ softmax(z_s/T)) per
position; ``distill`` runs a few AdamW steps of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.layers import RMSNorm
from lmstack.model.transformer import Transformer
from lmstack.quant.gptq import calibration_batches


@torch.no_grad()
def importance(model: Transformer, tokens: Tensor) -> dict[str, list[Tensor] | Tensor]:
    """{"ffn": [(F,) per layer], "kv_groups": [(K,) per layer], "embed": (D,), "norm_ms": {norm name: (D,)
    mean x_d² of its input}} on ``tokens`` (B, S)."""
    calibration_batches(tokens, 1)
    cfg = model.config
    H, N, K = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    ffn = [torch.zeros(cfg.d_ff) for _ in model.blocks]
    heads = [torch.zeros(N) for _ in model.blocks]
    emb = torch.zeros(cfg.d_model)
    count = [0]
    hooks = []

    def add(
        acc: Tensor, value: Tensor
    ) -> None:  # a hook returning a tensor would replace the activation
        acc.add_(value)

    for i, block in enumerate(model.blocks):
        hooks.append(
            block.ffn.down_proj.register_forward_pre_hook(
                lambda m, a, i=i: add(ffn[i], a[0].abs().reshape(-1, a[0].shape[-1]).sum(0))
            )
        )
        hooks.append(
            block.attn.o_proj.register_forward_pre_hook(
                lambda m, a, i=i: add(heads[i], a[0].reshape(-1, N, H).norm(dim=-1).sum(0))
            )
        )
    norm_ms: dict[str, Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, RMSNorm) and m.weight.shape[0] == cfg.d_model:
            hooks.append(
                m.register_forward_hook(
                    lambda mod, a, out: add(emb, out.abs().reshape(-1, out.shape[-1]).sum(0))
                )
            )
            acc = norm_ms[name] = torch.zeros(cfg.d_model)
            hooks.append(
                m.register_forward_pre_hook(
                    lambda mod, a, acc=acc: add(
                        acc, a[0].float().pow(2).reshape(-1, a[0].shape[-1]).sum(0)
                    )
                )
            )
    try:
        for b in range(tokens.shape[0]):
            model(tokens[b : b + 1])
            count[0] += tokens.shape[1]
    finally:
        for h in hooks:
            h.remove()
    n = count[0]
    return {
        "ffn": [f / n for f in ffn],
        "kv_groups": [h.view(K, N // K).mean(1) / n for h in heads],
        "embed": emb / n,
        "norm_ms": {k: v / n for k, v in norm_ms.items()},
    }


def _keep(scores: Tensor, k: int) -> Tensor:
    return torch.sort(torch.topk(scores, k).indices).values


@torch.no_grad()
def prune_width(
    model: Transformer,
    tokens: Tensor,
    d_ff: int | None = None,
    n_kv_heads: int | None = None,
    d_model: int | None = None,
    rescale_norms: bool = True,
) -> Transformer:
    """A new, narrower Transformer keeping the most important FFN channels, KV groups and embedding channels;
    ``rescale_norms``: correct the RMSNorm γ for the dropped channels (module docstring)."""
    cfg = model.config
    d_ff, n_kv_heads, d_model = (
        d_ff or cfg.d_ff,
        n_kv_heads or cfg.n_kv_heads,
        d_model or cfg.d_model,
    )
    for name, new, old in (
        ("d_ff", d_ff, cfg.d_ff),
        ("n_kv_heads", n_kv_heads, cfg.n_kv_heads),
        ("d_model", d_model, cfg.d_model),
    ):
        if not 1 <= new <= old:
            raise ValueError(f"{name}={new}: expected 1 ≤ {name} ≤ the model's {old}")
    if (
        cfg.parallel_block
        or cfg.qkv_bias
        or any(not hasattr(b.ffn, "down_proj") for b in model.blocks)
    ):
        raise ValueError(
            "prune_width handles sequential Llama blocks with SwiGLU FFNs and no q/k/v bias"
        )
    imp = importance(model, tokens)
    G = cfg.n_heads // cfg.n_kv_heads  # query heads per KV head
    H = cfg.head_dim
    new_cfg = cfg.replace(
        d_ff=d_ff, n_kv_heads=n_kv_heads, n_heads=n_kv_heads * G, d_model=d_model, head_dim=H
    )
    student = Transformer(new_cfg)
    dk = _keep(imp["embed"], d_model)  # (D',)
    sd = model.state_dict()
    new_sd = {}
    for name, t in sd.items():
        if name.startswith("embed.") or name.startswith("lm_head."):
            new_sd[name] = t[:, dk]
        elif name == "norm.weight":
            new_sd[name] = t[dk]
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        fk = _keep(imp["ffn"][i], d_ff)
        gk = _keep(imp["kv_groups"][i], n_kv_heads)
        kv_rows = (gk[:, None] * H + torch.arange(H)).flatten()  # (K'·H,)
        q_heads = (gk[:, None] * G + torch.arange(G)).flatten()  # (N',)
        q_rows = (q_heads[:, None] * H + torch.arange(H)).flatten()  # (N'·H,)
        new_sd[p + "attn_norm.weight"] = sd[p + "attn_norm.weight"][dk]
        new_sd[p + "ffn_norm.weight"] = sd[p + "ffn_norm.weight"][dk]
        new_sd[p + "attn.q_proj.weight"] = sd[p + "attn.q_proj.weight"][q_rows][:, dk]
        new_sd[p + "attn.k_proj.weight"] = sd[p + "attn.k_proj.weight"][kv_rows][:, dk]
        new_sd[p + "attn.v_proj.weight"] = sd[p + "attn.v_proj.weight"][kv_rows][:, dk]
        new_sd[p + "attn.o_proj.weight"] = sd[p + "attn.o_proj.weight"][dk][:, q_rows]
        for qk in ("q_norm", "k_norm"):
            if p + f"attn.{qk}.weight" in sd:
                new_sd[p + f"attn.{qk}.weight"] = sd[p + f"attn.{qk}.weight"]
        new_sd[p + "ffn.gate_proj.weight"] = sd[p + "ffn.gate_proj.weight"][fk][:, dk]
        new_sd[p + "ffn.up_proj.weight"] = sd[p + "ffn.up_proj.weight"][fk][:, dk]
        new_sd[p + "ffn.down_proj.weight"] = sd[p + "ffn.down_proj.weight"][dk][:, fk]
    if rescale_norms and d_model < cfg.d_model:
        for name, ms in imp["norm_ms"].items():
            key = f"{name}.weight"
            eps = model.get_submodule(name).eps
            if key in new_sd:
                new_sd[key] = new_sd[key] * torch.sqrt(
                    (ms[dk].mean() + eps) / (ms.mean() + eps)
                ).to(new_sd[key].dtype)
    missing = set(student.state_dict()) - set(new_sd)
    if missing:
        raise ValueError(f"prune_width does not know how to slice {sorted(missing)[:3]}")
    student.load_state_dict({k: v.clone() for k, v in new_sd.items()}, strict=False)
    return student.eval()


def distill_loss(
    student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0
) -> Tensor:
    """T² · mean over positions of KL(softmax(z_t/T) ‖ softmax(z_s/T)); logits (..., V)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}; expected > 0")
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)  # (...,)
    return kl.mean() * temperature**2


def distill(
    student: nn.Module,
    teacher: nn.Module,
    tokens: Tensor,
    steps: int = 20,
    lr: float = 3e-4,
    temperature: float = 1.0,
    batch: int = 4,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """``steps`` AdamW steps of ``distill_loss`` on rows of ``tokens`` (B, S) (batches of ``batch`` rows in
    turn); returns the losses. ``on_step(step, loss)`` runs after each step (1-based; the student in eval
    mode during the call), e.g. to measure held-out perplexity along the way."""
    from tqdm import tqdm

    calibration_batches(tokens, 2)
    teacher.eval()
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in tqdm(range(steps), desc="distill", unit="step"):
        rows = torch.arange(step * batch, (step + 1) * batch) % tokens.shape[0]
        x = tokens[rows]
        with torch.no_grad():
            z_t = teacher(x)
        loss = distill_loss(student(x), z_t, temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            student.eval()
            on_step(step + 1, losses[-1])
            student.train()
    student.eval()
    return losses
