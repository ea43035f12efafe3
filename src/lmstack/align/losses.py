"""Post-training losses as pure functions on log-probabilities (CS336 notes "模型对齐：RL 后训练微调").

Every function takes tensors and returns tensors; nothing here runs a model. Symbols: B sequences
(B·G for a GRPO batch of G samples per prompt), T completion tokens, V the vocabulary; ``mask`` (B, T) is 1
on the tokens that are trained (the response) and 0 on prompt and padding. ``logp`` (B, T) is
log π_θ(y_t | x, y_<t) of the sampled/target token, ``old_logp`` the same under the policy that generated
the rollout, ``ref_logp`` under the frozen reference. Checked against TRL (DPOTrainer, GRPOTrainer,
SFTTrainer) and hand-worked numbers in tests/align/test_align_losses.py.

- SFT: masked token NLL (per-token or per-sequence normalisation), per-token entropy.
- Preference: DPO (sigmoid), IPO, robust/cDPO (label smoothing), hinge; Bradley–Terry reward-model loss;
  implicit rewards, margins and accuracy.
- Policy gradient: naive REINFORCE (−A·log π), with a baseline, PPO/GRPO clip with ε_low/ε_high, no clip,
  verl's dual clip; advantages (group-normalised, Dr. GRPO, batch std, RLOO); aggregation (GRPO, DAPO/BNPO,
  Dr. GRPO); KL estimators k1, k2, k3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
DPO_LOSSES = ("sigmoid", "ipo", "robust", "hinge")
PG_LOSSES = ("naive", "clip", "no_clip", "dual_clip")
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
GRPO_LOSS_TYPES = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
}
KL_ESTIMATORS = ("k1", "k2", "k3")


def _check_choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; expected one of {tuple(allowed)}")


# ---- token log-probabilities and SFT ----------------------------------------------------------------------


def token_logprobs(logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """log p(target) at each position: logits (B, T, V), targets (B, T) -> (B, T), 0 where ``ignore_index``.

    log softmax(U)_r = U_r − log Σ_v exp(U_v), computed in fp32 (a bf16 log-softmax loses the small
    differences between policy and reference that DPO and the PPO ratio are made of)."""
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} must be logits {tuple(logits.shape)} without V"
        )
    valid = targets != ignore_index
    safe = targets.masked_fill(~valid, 0)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return logp.masked_fill(~valid, 0.0)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the policy at each position, H_t = −Σ_v p_v log p_v: (B, T, V) -> (B, T)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def sft_loss(
    logp: Tensor, mask: Tensor, normalize: str = "token", num_tokens: float | None = None
) -> Tensor:
    """Masked negative log-likelihood of the response tokens (supervised fine-tuning).

    ``normalize="token"``: L = −Σ_{b,t} m_bt log p_bt / Σ_{b,t} m_bt — every response token weighs the same
    (TRL SFTTrainer's completion-only loss, HF's causal-LM loss with −100 labels).
    ``normalize="sequence"``: L = −(1/B) Σ_b (Σ_t m_bt log p_bt / Σ_t m_bt) — every example weighs the same,
    so long responses do not dominate. ``num_tokens``: the token normaliser in place of this batch's Σ m
    (data parallelism: the global batch's count over the ranks). logp, mask: (B, T) -> scalar."""
    _check_choice("normalize", normalize, ("token", "sequence"))
    m = mask.to(logp.dtype)
    if normalize == "token":
        n = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=logp.dtype)
        return -(logp * m).sum() / n.clamp(min=1.0)
    return (-(logp * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ m·x / Σ m over ``dim`` (all dims when None), 0 where the mask is empty."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1.0)


# ---- preference optimisation -----------------------------------------------------------------------------


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> Tensor:
    """Per-pair preference loss (B,) from sequence log-probs (each (B,), summed over the response tokens).

    With h = (log π_θ(y_w) − log π_ref(y_w)) − (log π_θ(y_l) − log π_ref(y_l)):

    - ``sigmoid`` (DPO, Rafailov et al. 2023, "Direct Preference Optimization"): L = −log σ(β h).
    - ``robust`` (cDPO/robust DPO, Chowdhury et al. 2024, "Provably Robust DPO"; ε = label_smoothing, the
      probability a label is flipped): L = [−(1−ε) log σ(β h) + ε log σ(−β h)] / (1 − 2ε). Unbiased under
      label noise. (Mitchell's conservative DPO would be −(1−ε) log σ(βh) − ε log σ(−βh); TRL's "robust"
      is the form above.)
    - ``hinge`` (SLiC, Zhao et al. 2023): L = max(0, 1 − β h).
    - ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm…", eq. 17; τ = β): L = (h' − 1/(2β))²,
      with h' the same difference of per-token *averaged* log-ratios (TRL normalises by the response
      lengths; pass ``chosen_lengths``/``rejected_lengths``, the response token counts (B,)).
    """
    _check_choice("loss_type", loss_type, DPO_LOSSES)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 0.5)")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                "loss_type='ipo' needs chosen_lengths and rejected_lengths (response token counts)"
            )
        h = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(
            min=1
        )
        return (h - 1.0 / (2.0 * beta)) ** 2
    z = beta * (chosen_ratio - rejected_ratio)
    if loss_type == "sigmoid":
        return -F.logsigmoid(z)
    if loss_type == "hinge":
        return torch.relu(1.0 - z)
    eps = label_smoothing  # robust
    return (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)


def dpo_rewards(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
) -> dict[str, Tensor]:
    """DPO's implicit rewards r(x, y) = β (log π_θ(y|x) − log π_ref(y|x)) and TRL's metrics, each a scalar:
    rewards/chosen, rewards/rejected (means), rewards/margins (mean r_w − r_l), rewards/accuracies
    (fraction with r_w > r_l)."""
    rc = beta * (chosen_logps - ref_chosen_logps).detach()
    rr = beta * (rejected_logps - ref_rejected_logps).detach()
    return {
        "rewards/chosen": rc.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/margins": (rc - rr).mean(),
        "rewards/accuracies": (rc > rr).float().mean(),
    }


def bradley_terry_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, margin: Tensor | None = None
) -> Tensor:
    """Reward-model loss (Bradley & Terry 1952; InstructGPT, Ouyang et al. 2022 eq. 1; TRL RewardTrainer):
    P(y_w ≻ y_l) = σ(r_w − r_l), L = −mean log σ(r_w − r_l − margin). Scores (B,) -> scalar."""
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


# ---- KL to the reference ---------------------------------------------------------------------------------


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from a token sampled from π_θ (Schulman 2020, "Approximating
    KL divergence"; verl's ``kl_penalty``). With δ = log π_ref − log π_θ (r = e^δ = π_ref/π_θ):

    - k1 = −δ (unbiased, high variance, can be negative),
    - k2 = δ²/2 (biased, low variance),
    - k3 = e^δ − δ − 1 (unbiased, always ≥ 0, low variance: what GRPO uses as its loss term).
    """
    _check_choice("kind", kind, KL_ESTIMATORS)
    delta = ref_logp - logp
    if kind == "k1":
        return -delta
    if kind == "k2":
        return 0.5 * delta**2
    return torch.exp(delta) - delta - 1.0


# ---- advantages ------------------------------------------------------------------------------------------


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of G={group_size} "
            "(expected (P·G,) with each prompt's G samples adjacent)"
        )
    return rewards.view(-1, group_size)  # (P, G)


def group_advantages(
    rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> Tensor:
    """GRPO's outcome advantage (Shao et al. 2024, "DeepSeekMath", §4.1.2): each sample's reward minus its
    group's mean, Â_i = (r_i − mean_G r) / (std + ε), the same for every token of the sample.

    ``scale="group"``: std = the group's unbiased (Bessel-corrected) standard deviation (GRPO, TRL's default);
    ``"batch"``: std over the whole batch (mean still per group; Hu et al. 2025, "REINFORCE++");
    ``"none"``: no division (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training": the std
    weighs easy/hard prompts unevenly). rewards (P·G,), each prompt's G samples adjacent -> (P·G,).
    A group of one has no spread: ``scale="group"`` with G = 1 is refused."""
    _check_choice("scale", scale, ("group", "batch", "none"))
    if scale == "group" and group_size < 2:
        raise ValueError(
            "group_size=1 with scale='group': a group of one sample has no standard deviation "
            "(and its advantage is always 0); use G >= 2, or scale='batch'/'none'"
        )
    g = _groups(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred.reshape(-1)
    std = g.std(dim=1, keepdim=True) if scale == "group" else rewards.std().expand_as(g)
    return (centred / (std + eps)).reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): the baseline of
    sample i is the mean reward of the *other* G−1 samples of its prompt,
    Â_i = r_i − (Σ_j r_j − r_i)/(G−1) = G/(G−1) · (r_i − mean_G r). rewards (P·G,) -> (P·G,)."""
    if group_size < 2:
        raise ValueError(
            "group_size=1 with RLOO: the leave-one-out baseline needs G >= 2 samples per prompt"
        )
    g = _groups(rewards, group_size)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


def zero_std_fraction(rewards: Tensor, group_size: int) -> float:
    """Fraction of groups whose G rewards are all equal (they carry no GRPO learning signal)."""
    g = _groups(rewards, group_size)
    return float((g.max(dim=1).values == g.min(dim=1).values).float().mean())


# ---- policy-gradient losses ------------------------------------------------------------------------------


def policy_gradient_loss(
    logp: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None = None,
    kind: str = "clip",
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip_c: float = 3.0,
    baseline: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token policy-gradient loss (B, T) and the clip indicators (B, T) for the metrics.

    A = ``advantages`` ((B,) broadcast over T, or (B, T)); ρ = exp(log π_θ − log π_old).

    - ``naive`` (REINFORCE, Williams 1992): ℓ = −(A − b)·log π_θ, b = ``baseline`` (0 without one).
    - ``no_clip``: ℓ = −ρ·A (the importance-weighted surrogate without a trust region; equal to ``naive`` in
      value of its gradient at ρ = 1).
    - ``clip`` (PPO, Schulman et al. 2017; GRPO; DAPO's asymmetric "clip-higher", Yu et al. 2025):
      ℓ = −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)·A).
    - ``dual_clip`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; verl's ``clip_ratio_c``):
      for A < 0 the clipped loss is further capped, ℓ = min(ℓ_clip, −c·A) with c > 1, so a huge ρ on a bad
      token cannot blow up the step.

    Indicators (for TRL's clip_ratio metrics): ``low`` = ρ < 1−ε_low with A < 0, ``high`` = ρ > 1+ε_high
    with A > 0 (the tokens whose gradient the clip zeroes), ``dual`` = the dual clip's cap was active.
    """
    _check_choice("kind", kind, PG_LOSSES)
    eps_high = eps_low if eps_high is None else eps_high
    A = advantages.unsqueeze(-1) if advantages.dim() == logp.dim() - 1 else advantages
    zeros = torch.zeros_like(logp, dtype=torch.bool)
    info = {"low": zeros, "high": zeros, "dual": zeros}
    if kind == "naive":
        b = (
            0.0
            if baseline is None
            else (
                baseline.unsqueeze(-1)
                if isinstance(baseline, Tensor) and baseline.dim() == logp.dim() - 1
                else baseline
            )
        )
        return -(A - b) * logp, info
    if old_logp is None:
        raise ValueError(
            f"kind={kind!r} needs old_logp (the log-probs of the policy that sampled the rollout)"
        )
    ratio = torch.exp(logp - old_logp)
    if kind == "no_clip":
        return -ratio * A, info
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(
            f"eps_low={eps_low}, eps_high={eps_high}: expected 0 <= eps_low < 1 and eps_high >= 0"
        )
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.min(ratio * A, clipped * A)
    info = {
        "low": (ratio < 1.0 - eps_low) & (A < 0),
        "high": (ratio > 1.0 + eps_high) & (A > 0),
        "dual": zeros,
    }
    if kind == "dual_clip":
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c={dual_clip_c} must be > 1")
        cap = -dual_clip_c * A
        capped = torch.min(loss, cap)
        info["dual"] = (A < 0) & (loss > cap)
        loss = torch.where(A < 0, capped, loss)
    return loss, info


def aggregate(
    per_token: Tensor, mask: Tensor, mode: str = "seq_mean_token_mean", max_len: int | None = None
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar (verl's ``loss_agg_mode``):

    - ``seq_mean_token_mean`` (GRPO): mean over each sequence's tokens, then over sequences — a short
      response's tokens weigh more than a long one's;
    - ``token_mean`` (DAPO, BNPO): Σ m·ℓ / Σ m over the batch — every token weighs the same;
    - ``seq_mean_token_sum_norm`` (Dr. GRPO): Σ m·ℓ / (B · L_max), a constant normaliser, so no length bias.
    """
    _check_choice("mode", mode, AGGREGATIONS)
    m = mask.to(per_token.dtype)
    if mode == "seq_mean_token_mean":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if mode == "token_mean":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if max_len is None:
        raise ValueError(
            "mode='seq_mean_token_sum_norm' (Dr. GRPO) needs max_len, the maximum completion length"
        )
    return (per_token * m).sum() / (per_token.shape[0] * max_len)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    eps_low: float = 0.2,
    eps_high: float | None = None,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    max_len: int | None = None,
    pg: str = "clip",
    dual_clip_c: float = 3.0,
    num_tokens: Tensor | float | None = None,
    kl_ratio_correction: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO's objective (DeepSeekMath eq. 21) as a loss: per token ℓ = ℓ_clip(ρ, A) + β·k3(π_θ, π_ref),
    with ``kl_ratio_correction`` the KL term weighted by ρ (DeepSeek-V3.2: then its gradient is the unbiased
    reverse-KL gradient for samples from π_old; TRL's ``use_bias_correction_kl``), reduced by ``loss_type``'s aggregation (``GRPO_LOSS_TYPES``). For ``dapo`` the normaliser is the number
    of response tokens ``num_tokens`` of the whole rollout batch when given (so micro-batches add up to the
    batch's token mean), else this micro-batch's. logp, old_logp, ref_logp, mask (B, T); advantages (B,).

    Returns (loss, metrics): kl (token mean), clip fractions low/high/region/dual (token means)."""
    _check_choice("loss_type", loss_type, GRPO_LOSS_TYPES)
    per_token, info = policy_gradient_loss(
        logp,
        advantages,
        old_logp,
        kind=pg,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip_c=dual_clip_c,
    )
    metrics: dict[str, float] = {}
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError(f"beta={beta} needs ref_logp (the reference model's log-probs)")
        kl = kl_estimate(logp, ref_logp, "k3")
        per_token = per_token + beta * (
            kl * torch.exp(logp - old_logp) if kl_ratio_correction else kl
        )
        metrics["kl"] = float(masked_mean(kl.detach(), mask))
    if loss_type == "dapo" and num_tokens is not None:
        loss = (per_token * mask.to(per_token.dtype)).sum() / torch.as_tensor(num_tokens).clamp(
            min=1.0
        )
    else:
        loss = aggregate(per_token, mask, GRPO_LOSS_TYPES[loss_type], max_len=max_len)
    for key in ("low", "high", "dual"):
        metrics[f"clip_ratio/{key}"] = float(masked_mean(info[key].float(), mask))
    metrics["clip_ratio/region"] = float(masked_mean((info["low"] | info["high"]).float(), mask))
    return loss, metrics
